"""Start one cell's server on the selected target and hand back an :class:`Endpoint`.

The one place that turns (cell, options) into a running, health-checked server:
free port, per-cell log file, fault env, GPUs for the xdist worker, teardown.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from conformance.checks.leaks import death_cause
from conformance.client import SGLangClient
from conformance.errors import KitError, PortTakenError, ServerDiedError, ServerStartError
from conformance.matrix.cells import Cell
from conformance.targets.base import Endpoint, LaunchSpec
from conformance.targets.launcher import ServerProcess, free_port
from conformance.targets.plugin_proof import check_plugins, check_weights_loaded
from conformance.targets.registry import target_for
from conformance.sglang_plugins.activation import read_report
from conformance.sglang_plugins.activation import REPORT_ENV


def spec_for(cell: Cell, options: Any, *, port: int | None = None) -> LaunchSpec:
    """The command and env of ``cell``'s server on the selected target (``Target.launch_spec``)."""
    return target_for(options).launch_spec(cell, options, port=port or free_port())


def _with_plugin_failure(error: ServerStartError, name: str, report: Path, log_path: Path) -> ServerStartError:
    """A start-up failure whose root cause is a kit plugin that failed inside SGLang (SGLang
    logs that and carries on, so the crash comes later): name the plugin's error instead."""
    bad = [r for r in read_report(report) if r.get("status") == "error"]
    if not bad:
        return error
    r = bad[0]
    return ServerStartError(f"{name}: kit plugin {r.get('plugin')} failed in SGLang's {r.get('role')} process: {r.get('error')} (log {log_path})")


#: Starts of one cell when the picked port was taken by another process in between.
PORT_ATTEMPTS = 3


@dataclass(frozen=True)
class StartedCell:
    """A cell's server process that has started (health-checked), not yet handed out."""

    cell: Cell
    target: str
    spec: LaunchSpec
    process: ServerProcess
    name: str  # "<target> server for <cell>", for messages
    plugin_report: Path  # where the kit's plugins inside SGLang report that they ran
    log_path: Path


@contextlib.contextmanager
def serve_cell(cell: Cell, options: Any, *, log_dir: Path) -> Iterator[Endpoint]:
    """Start the cell's server (on a new port when the picked one was taken meanwhile by
    another process: a concurrent worker's server), yield its endpoint, stop it."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            started = _start_cell(cell, options, log_dir)
            break
        except PortTakenError:
            if attempt == PORT_ATTEMPTS:
                raise
    yield from _yield_endpoint(started)


def log_path_for(cell: Cell, log_dir: Path) -> Path:
    """Where a cell's server log goes."""
    return Path(log_dir) / f"{cell.id}.log"


def _start_cell(cell: Cell, options: Any, log_dir: Path) -> StartedCell:
    spec = spec_for(cell, options)
    log_path = log_path_for(cell, log_dir)
    env = dict(spec.env)
    plugin_report = log_path.with_suffix(".plugins.jsonl")
    if spec.plugins:
        plugin_report.parent.mkdir(parents=True, exist_ok=True)
        plugin_report.unlink(missing_ok=True)
        env[REPORT_ENV] = str(plugin_report)
    name = f"{options.target} server for {cell.id}"
    proc = ServerProcess(
        name=name,
        argv=spec.argv,
        env=env,
        health_url=spec.base_url + spec.health_path,
        log_path=log_path,
        start_timeout_s=spec.start_timeout_s,
        term_grace_s=spec.term_grace_s,
        entry=spec.entry,
        entry_argv=spec.entry_argv,
        preload=spec.preload,
        preimport_env=spec.env if spec.preimport else None,
    )
    try:
        proc.start()
    except PortTakenError:
        raise
    except ServerStartError as e:
        raise _with_plugin_failure(e, name, plugin_report, log_path) if spec.plugins else e
    return StartedCell(cell, options.target, spec, proc, name, plugin_report, log_path)


def _yield_endpoint(started: StartedCell) -> Iterator[Endpoint]:
    """The started server's endpoint (its plugins proven first); the server stops after."""
    spec, proc = started.spec, started.process
    client = SGLangClient(spec.base_url, liveness=proc.exit_reason)
    try:
        if spec.plugins:
            try:
                check_plugins(started.name, started.plugin_report, spec.plugins, started.log_path)
                check_weights_loaded(started.name, started.log_path)
            except BaseException:
                proc.stop()
                raise
        try:
            info = client.server_info()
        except KitError:
            info = {}
        yield Endpoint(cell=started.cell, target=started.target, base_url=spec.base_url, client=client, process=proc, info=info)
    finally:
        client.close()
        proc.stop_soon()  # the next cell's server starts while this one winds down

#: How long one liveness question may take on a busy server before it is asked again.
HEALTH_TIMEOUT_S = 20.0

def not_serving(client: SGLangClient, alive: Any = None, log_text: Any = None) -> str | None:
    """Why the server is not serving (its process exited, or its scheduler does not answer);
    None while it serves.  The question is ``/server_info``, which SGLang answers from the
    scheduler's internal state (a hung scheduler leaves it unanswered); SGLang's ``/health``
    sleeps a whole second before it answers, which cost the programs a second per program.
    A release without ``/server_info`` is asked ``/health``.  A slow answer on a busy server
    is retried, not a death."""
    why = alive() if alive else None
    if why:
        return why
    status = ""
    path = "/server_info"
    for _ in range(3):
        try:
            resp = client.request("GET", path, timeout=HEALTH_TIMEOUT_S, ok=(200, 404, 500, 502, 503, 504))
        except ServerDiedError as e:
            status = str(e)
            if "no answer within" in status:
                continue
            break
        if resp.status_code == 404 and path != "/health":
            path = "/health"
            continue
        if resp.status_code == 200:
            return None
        status = f"{path} answers {resp.status_code}"
        break
    return f"{status}; {death_cause(log_text() if log_text else '')}"
