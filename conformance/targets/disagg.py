"""The PD disaggregation cell: a prefill server, a decode server and a router as ONE unit.

The unit's commands come from its target (``Target.pd_spec``, built by
``conformance.targets.pd_launch``); :func:`pd_spec_for` asks the selected target.
``validate_pd_spec`` runs SGLang's own parser on the two server commands (and
``sglang_router``'s parser on the router's when it is installed).  ``serve_pd`` starts the
three processes together (each with its own log), health-checks them, and tears all of
them down together, also on failure.  ``extra_buffer_lazy`` is refused under PD by SGLang
0.5.23: :func:`not_applicable` says so in one line.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from conformance.client import SGLangClient
from conformance.errors import KitError, PortTakenError
from conformance.matrix.cells import Cell
from conformance.targets.launcher import ServerProcess
from conformance.targets.pd_launch import ROUTER_LAUNCHER, PDPorts, PDSpec, contract_refusal
from conformance.targets.plugin_proof import check_plugins
from conformance.targets.registry import target_for
from conformance.targets.sglang import Validation, strip_launcher
from conformance.targets.option_refusal import resolution_refusal
from conformance.targets.sglang import validate_server_args
from conformance.sglang_plugins.activation import REPORT_ENV

ROLES = ("prefill", "decode", "router")
#: Starts of a PD unit when a picked port was taken by another process in between.
PORT_ATTEMPTS = 3


def not_applicable(cell: Cell, target: str | None = None) -> str | None:
    """The one-line reason a cell has no PD variant, or None.  Without ``target`` (``plan``):
    SGLang 0.5.23's contract, which refuses extra_buffer_lazy under PD; with one, the target
    answers (``Target.pd_not_applicable``): the kit's own engine follows that contract, while
    on real SGLang the installed release answers: the cell is started under PD, and a refusal
    at start (0.5.19 and later: "extra_buffer_lazy unsupported under PD disaggregation") is
    ``na`` with SGLang's own line (:func:`pd_launch_refusal`), while 0.5.13-0.5.18 accept the
    strategy and serve it."""
    return contract_refusal(cell) if target is None else target_for(target).pd_not_applicable(cell)


def pd_log_path(log_dir: Path, cell: Cell, role: str) -> Path:
    """Where the PD server ``role`` of ``cell`` logs (its start and :func:`pd_launch_refusal` read it)."""
    return log_dir / f"{cell.id}-pd-{role}.log"


def pd_launch_refusal(cell: Cell, log_dir: Path) -> str | None:
    """SGLang's refusal, from its PD server logs, of a cell outside the 0.5.23 PD contract
    (a server stopped while resolving its arguments); None for any other start failure,
    which stays a failure, and for every cell inside the contract."""
    if cell.strategy.pd:
        return None
    for role in ("prefill", "decode"):
        try:
            text = pd_log_path(Path(log_dir), cell, role).read_text(errors="replace")
        except OSError:
            continue
        line = resolution_refusal(text)
        if line:
            return f"SGLang refuses {cell.strategy.name} under PD disaggregation at start ({role} server): {line}"
    return None


def target_refusal(target: str) -> str | None:
    """Why PD cannot run on ``target`` on this machine (one line), or None."""
    return target_for(target).pd_refusal()


def validate_router_argv(argv: Sequence[str], launcher: str = ROUTER_LAUNCHER) -> Validation:
    """The router command's shape; plus ``sglang_router``'s own parser when it is installed."""
    args = strip_launcher(argv, launcher)
    if "--pd-disaggregation" not in args:
        return Validation(False, "router command lacks --pd-disaggregation")
    for flag in ("--prefill", "--decode"):
        if args.count(flag) != 1:
            return Validation(False, f"router command must name exactly one {flag} URL, got {args.count(flag)}")
        value = args[args.index(flag) + 1] if args.index(flag) + 1 < len(args) else ""
        if not value.startswith("http://"):
            return Validation(False, f"router {flag} takes a URL, got {value!r}")
    try:
        import argparse

        from sglang_router.router_args import RouterArgs  # type: ignore[import-not-found]
    except ImportError:
        return Validation(True, "ok (shape only: sglang_router is not installed)")
    parser = argparse.ArgumentParser(prog="sglang_router.launch_router", exit_on_error=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    try:
        parsed = RouterArgs.from_cli_args(parser.parse_args(args), use_router_prefix=False)
    except (SystemExit, argparse.ArgumentError, ValueError) as e:
        return Validation(False, f"sglang_router's parser rejected the arguments: {e}")
    if not parsed.pd_disaggregation or len(parsed.prefill_urls) != 1 or len(parsed.decode_urls) != 1:
        return Validation(False, f"sglang_router parsed {parsed.prefill_urls} / {parsed.decode_urls}, expected one prefill and one decode")
    return Validation(True, "ok (sglang_router's parser)")


def validate_pd_spec(spec: PDSpec, cell: Cell, *, config: Path | None = None) -> dict[str, Validation]:
    """Each role's command through its own parser: SGLang's for prefill/decode."""
    server_launcher = spec.launchers.get("server", "python -m sglang.launch_server")
    out = {role: validate_server_args(strip_launcher(s.argv, server_launcher), cell, config=config)
           for role, s in (("prefill", spec.prefill), ("decode", spec.decode))}
    out["router"] = validate_router_argv(spec.router.argv, spec.launchers.get("router", ROUTER_LAUNCHER))
    return out


def pd_spec_for(cell: Cell, options: Any, *, ports: PDPorts | None = None) -> PDSpec:
    """The PD commands for ``cell`` on the selected target (KitError when n/a)."""
    return target_for(options).pd_spec(cell, options, ports=ports)


# ------------------------------------------------------------------ the running cell
@dataclass
class PDEndpoint:
    """A healthy PD cell: ``router`` is the client the workloads talk to; ``prefill`` and
    ``decode`` reach each server directly (idle gauges, flush)."""

    cell: Cell
    target: str
    router: SGLangClient
    prefill: SGLangClient
    decode: SGLangClient
    processes: dict[str, ServerProcess]
    spec: PDSpec
    info: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def client(self) -> SGLangClient:
        return self.router

    @property
    def base_url(self) -> str:
        return self.router.base_url

    def alive(self) -> bool:
        return all(p.alive() for p in self.processes.values())

    def exit_reasons(self) -> dict[str, str]:
        return {role: r for role, p in self.processes.items() if (r := p.exit_reason())}

    def log_texts(self) -> dict[str, str]:
        return {role: p.log_text() for role, p in self.processes.items()}

    def log_paths(self) -> dict[str, Path]:
        return {role: p.log_path for role, p in self.processes.items()}


def _start_together(procs: Sequence[ServerProcess], release: threading.Event) -> None:
    """Start ``procs`` concurrently; on the first failure stop them all and raise it.

    Each is started from its own thread that then waits on ``release``: Linux sends the
    launcher's PR_SET_PDEATHSIG signal when the creating THREAD exits, so a thread that
    returned at once would kill its server.  Set ``release`` after stopping the servers.
    """
    errors: list[BaseException] = []
    done = threading.Semaphore(0)

    def run(p: ServerProcess) -> None:
        try:
            p.start()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
        finally:
            done.release()
        release.wait()

    for p in procs:
        threading.Thread(target=run, args=(p,), name=f"start {p.name}", daemon=True).start()
    deadline = time.monotonic() + max(p.start_timeout_s for p in procs) + 60
    for _ in procs:
        if not done.acquire(timeout=max(deadline - time.monotonic(), 0)):
            errors.append(KitError(f"PD servers did not finish starting by the deadline: {', '.join(p.name for p in procs)}"))
            break
        if errors:
            break
    if errors:
        for p in procs:  # the others' health waits then end at once
            p.stop()
        raise errors[0]


def _with_report(env: dict[str, str], report: Path | None) -> dict[str, str]:
    """``env`` plus where the kit's plugins inside this PD server prove they ran (a fresh file)."""
    if report is None:
        return dict(env)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    return {**env, REPORT_ENV: str(report)}


@contextlib.contextmanager
def serve_pd(cell: Cell, options: Any, *, log_dir: Path, spec: PDSpec | None = None) -> Iterator[PDEndpoint]:
    """Start the cell's prefill and decode servers together, then its router; yield a
    :class:`PDEndpoint`; tear all three down together (also on failure).  A port taken by
    another process between picking and binding (Mooncake's TCP transport and other cells
    take ports too) starts the unit again on new ports, as ``serving.serve_cell`` does."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        picked = spec or pd_spec_for(cell, options)
        try:
            procs, release = _start_pd(cell, options, picked, Path(log_dir))
            break
        except PortTakenError:
            if spec is not None or attempt == PORT_ATTEMPTS:
                raise
    clients: list[SGLangClient] = []
    try:

        def dead() -> str | None:
            gone = {role: r for role, p in procs.items() if (r := p.exit_reason())}
            return "; ".join(f"PD {role}: {r}" for role, r in gone.items()) or None

        router = SGLangClient(picked.router.base_url, liveness=dead, batches=picked.router_batches)
        prefill = SGLangClient(picked.prefill.base_url, liveness=procs["prefill"].exit_reason)
        decode = SGLangClient(picked.decode.base_url, liveness=procs["decode"].exit_reason)
        clients = [router, prefill, decode]
        try:
            info = router.server_info()
        except (KitError, ValueError):  # sglang_router may answer without a JSON body
            info = {}
        yield PDEndpoint(cell, options.target, router, prefill, decode, procs, picked, info)
    finally:
        for c in clients:
            c.close()
        _stop_pd(procs, release)


def _stop_pd(procs: dict[str, ServerProcess], release: threading.Event) -> None:
    for role in ("router", "decode", "prefill"):
        procs[role].stop()
    release.set()


def _start_pd(cell: Cell, options: Any, spec: PDSpec, log_dir: Path) -> tuple[dict[str, ServerProcess], threading.Event]:
    """The three processes of ``spec`` started and proven (the kit's plugins ran inside SGLang,
    which only logs a failing one); on any failure all of them are stopped and it is raised."""
    reports = {role: log_dir / f"{cell.id}-pd-{role}.plugins.jsonl" for role, s in spec.specs().items() if s.plugins}
    procs = {
        role: ServerProcess(
            name=f"{options.target} PD {role} for {cell.id}", argv=s.argv, env=_with_report(s.env, reports.get(role)),
            health_url=s.base_url + s.health_path, log_path=pd_log_path(log_dir, cell, role), start_timeout_s=s.start_timeout_s,
            term_grace_s=s.term_grace_s,
        )
        for role, s in spec.specs().items()
    }
    release = threading.Event()
    try:
        _start_together([procs["prefill"], procs["decode"]], release)
        for role, report in reports.items():
            check_plugins(procs[role].name, report, spec.specs()[role].plugins, procs[role].log_path)
        procs["router"].start()
    except BaseException:
        _stop_pd(procs, release)
        raise
    return procs, release
