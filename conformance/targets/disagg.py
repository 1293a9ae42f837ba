"""The PD disaggregation cell: a prefill server, a decode server and a router as ONE unit.

``sglang_pd_spec`` builds SGLang's three commands for a cell (``--disaggregation-mode
prefill|decode`` with a shared ``--disaggregation-bootstrap-port``, the decode server on its
own GPUs via ``--base-gpu-id``, an optional ``--disaggregation-transfer-backend``, and
``sglang_router.launch_router --pd-disaggregation``); ``sglang_cpu_pd_spec`` the same roles on
``sglang-cpu`` (the cell's CPU command, Mooncake over TCP, the CPU plugin's PD bridge);
``reference_pd_spec`` the reference target's (``conformance.reference.pd`` roles and ``conformance.reference.router``).
``validate_pd_spec`` runs SGLang's own parser on the two server commands (and
``sglang_router``'s parser on the router's when it is installed).  ``serve_pd`` starts the
three processes together (each with its own log), health-checks them, and tears all of
them down together, also on failure.  ``extra_buffer_lazy`` is refused under PD by SGLang
0.5.23: :func:`not_applicable` says so in one line.
"""

from __future__ import annotations


import contextlib
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from conformance.client import SGLangClient
from conformance.errors import KitError, PortTakenError
from conformance.matrix.cells import Cell
from conformance.targets.base import LaunchSpec
from conformance.targets.launcher import ServerProcess, free_port
from conformance.targets.plugin_proof import check_plugins
from conformance.targets.registry import target_for
from conformance.targets.sglang import SGLangTarget, Validation, gpus_for_worker, strip_launcher

LAZY_REFUSAL = "extra_buffer_lazy is refused under PD disaggregation by SGLang 0.5.23 (not applicable)"
ROUTER_LAUNCHER = "python -m sglang_router.launch_router"
#: env knobs (until the plugin has options for them)
TRANSFER_BACKEND_ENV = "HYBRID_CONFORMANCE_PD_TRANSFER_BACKEND"
ROUTER_LAUNCHER_ENV = "HYBRID_CONFORMANCE_SGLANG_ROUTER"
TRANSFER_BACKENDS = ("mooncake", "nixl", "mooncake_tcp", "mori", "ascend")
ROLES = ("prefill", "decode", "router")
#: Starts of a PD unit when a picked port was taken by another process in between.
PORT_ATTEMPTS = 3
REFERENCE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def not_applicable(cell: Cell, target: str | None = None) -> str | None:
    """The one-line reason a cell has no PD variant, or None.  Without ``target`` (``plan``)
    and on the kit's own engines: SGLang 0.5.23's contract, which refuses extra_buffer_lazy
    under PD.  On real SGLang the installed release answers: the cell is started under PD,
    and a refusal at start (0.5.19 and later: "extra_buffer_lazy unsupported under PD
    disaggregation") is ``na`` with SGLang's own line (:func:`pd_launch_refusal`), while
    0.5.13-0.5.18 accept the strategy and serve it."""
    if cell.strategy.pd or (target is not None and not target_for(target).kit_engine):
        return None
    return LAZY_REFUSAL


def pd_log_path(log_dir: Path, cell: Cell, role: str) -> Path:
    """Where the PD server ``role`` of ``cell`` logs (its start and :func:`pd_launch_refusal` read it)."""
    return log_dir / f"{cell.id}-pd-{role}.log"


def pd_launch_refusal(cell: Cell, log_dir: Path) -> str | None:
    """SGLang's refusal, from its PD server logs, of a cell outside the 0.5.23 PD contract
    (a server stopped while resolving its arguments); None for any other start failure,
    which stays a failure, and for every cell inside the contract."""
    from conformance.targets.option_refusal import resolution_refusal

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


def env_for_role(cell: Cell, role: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` for the PD server ``role`` of ``cell``: without the cell fault's variables when
    the fault is for the other role only (``pd_roles`` in the matrix); plus the fault's
    ``pd_env`` (every PD server)."""
    both = dict(cell.fault.pd_env)
    if role in cell.fault.pd_roles:
        return {**env, **both}
    theirs = dict(cell.fault.env)
    return {**{k: v for k, v in env.items() if k not in theirs}, **both}


def target_refusal(target: str) -> str | None:
    """Why PD cannot run on ``target`` on this machine (one line), or None."""
    if target_for(target).pd_probe_refusal:
        return _sglang_cpu_pd_refusal()
    return None


def _sglang_cpu_pd_refusal() -> str | None:
    """SGLang's own answer when asked for its default PD transfer engine here (probed once);
    None when it builds (the non-CUDA Mooncake wheel and libibverbs installed)."""
    from conformance.sglang_api.probes import probe

    refusal = probe().pd_transfer_refusal
    if refusal:
        return f"not applicable on sglang-cpu: SGLang's PD transfer engine refuses this machine: {refusal} (ci/setup-cpu.sh installs it)"
    return None


@dataclass(frozen=True)
class PDPorts:
    prefill: int
    decode: int
    router: int
    bootstrap: int
    router_metrics: int | None = None  # sglang_router's Prometheus exporter (its default 29000 is shared by every router)

    @classmethod
    def pick(cls) -> "PDPorts":
        ports: list[int] = []
        while len(ports) < 5:  # distinct free ports
            p = free_port()
            if p not in ports:
                ports.append(p)
        return cls(*ports)


@dataclass(frozen=True)
class PDSpec:
    """The three commands of one PD cell (launching nothing)."""

    prefill: LaunchSpec
    decode: LaunchSpec
    router: LaunchSpec
    bootstrap_port: int | None = None
    transfer_backend: str | None = None
    launchers: dict[str, str] = field(default_factory=dict)
    #: The router takes a batched ``/generate`` (the reference router does; ``sglang_router`` does not).
    router_batches: bool = False

    def specs(self) -> dict[str, LaunchSpec]:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}

    def describe(self) -> dict[str, Any]:
        """JSON-able commands for ``plan`` output: each role's argv, env and health URL."""
        roles = {role: {"command": list(s.argv), "env": dict(s.env), "health": s.base_url + s.health_path} for role, s in self.specs().items()}
        return {**roles, "bootstrap_port": self.bootstrap_port, "transfer_backend": self.transfer_backend}


# ------------------------------------------------------------------ SGLang
def sglang_pd_spec(
    cell: Cell,
    *,
    target: SGLangTarget,
    ports: PDPorts,
    gpus: Sequence[int] | None = None,
    transfer_backend: str | None = None,
    router_launcher: str = ROUTER_LAUNCHER,
) -> PDSpec:
    """SGLang's prefill, decode and router commands for ``cell`` (lazy cells included: the
    refusal is SGLang's to make, see :func:`validate_pd_spec`)."""
    if transfer_backend is not None and transfer_backend not in TRANSFER_BACKENDS:
        raise KitError(f"--disaggregation-transfer-backend: unknown value {transfer_backend!r}; allowed: {', '.join(TRANSFER_BACKENDS)}")
    tp = 1 if target.twins else cell.model.tp_size
    model_path = target.model_path(cell)
    shared = ["--disaggregation-bootstrap-port", str(ports.bootstrap)]
    if transfer_backend:
        shared += ["--disaggregation-transfer-backend", transfer_backend]
    launcher = shlex.split(target.launcher)
    env = dict(cell.env)
    if gpus is not None:
        if len(gpus) < 2 * tp:
            raise KitError(f"cell {cell.id}: PD needs {2 * tp} GPUs (tp {tp} for prefill + tp {tp} for decode), got {len(gpus)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus[: 2 * tp])

    def server(role: str, port: int, base_gpu: int) -> LaunchSpec:
        args = target.server_args(cell, model_path=model_path, port=port)
        args += ["--disaggregation-mode", role, *shared, "--base-gpu-id", str(base_gpu)]
        return LaunchSpec(argv=[*launcher, *args], env=env_for_role(cell, role, env), port=port, health_path="/health", start_timeout_s=1200.0)

    return PDSpec(server("prefill", ports.prefill, 0), server("decode", ports.decode, tp), _router_spec(ports, router_launcher), ports.bootstrap,
                  transfer_backend, {"server": target.launcher, "router": router_launcher})


#: ``sglang_router``'s own resilience switched off: the kit judges each answer SGLang gave.  With
#: its defaults the router re-sends a request SGLang failed (up to 5 tries: a failed transfer is
#: hidden, or answered by a second run of the request) and, after 10 failures in 120 s, opens its
#: circuit breaker on the worker (every later request: 503 "No available servers: No prefill
#: workers available", while both SGLang servers are healthy).  That is the router's policy, not
#: SGLang's Mamba code; a cell whose transfers fail on purpose (``SGLANG_TEST_DISAGG_FAILURE_PROB``)
#: trips it within one load.
ROUTER_AS_IS_FLAGS = ("--disable-retries", "--disable-circuit-breaker")
#: The router's own readiness route: it is up only once its prefill and decode workers are registered.
ROUTER_READY_PATH = "/readiness"


def _router_spec(ports: PDPorts, router_launcher: str) -> LaunchSpec:
    """``sglang_router``'s PD router in front of the cell's prefill (with its bootstrap port) and
    decode, passing each SGLang answer on as it came (``ROUTER_AS_IS_FLAGS``)."""
    argv = [
        *shlex.split(router_launcher), "--pd-disaggregation",
        "--prefill", f"http://127.0.0.1:{ports.prefill}", str(ports.bootstrap),
        "--decode", f"http://127.0.0.1:{ports.decode}",
        "--host", "127.0.0.1", "--port", str(ports.router), *ROUTER_AS_IS_FLAGS,
    ]
    if ports.router_metrics is not None:
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports.router_metrics)]
    # ``/health`` is the router's liveness (200 at once); its workers are registered in the
    # background a second or more later, and a request before that gets 503 "No available
    # servers: No prefill workers available".  ``/readiness`` answers 200 once it has healthy workers.
    return LaunchSpec(argv=argv, env={}, port=ports.router, health_path=ROUTER_READY_PATH, start_timeout_s=300.0)


# ------------------------------------------------------------------ SGLang on CPU
#: SGLang's PD transport on ``sglang-cpu``: its own Mooncake backend (the non-CUDA wheel),
#: forced onto TCP (this machine has no RDMA device); read by SGLang's
#: ``mooncake_transfer_engine.py``.
CPU_TRANSFER_BACKEND = "mooncake"
CPU_TRANSFER_PROTOCOL = "tcp"
CPU_TRANSFER_ENV = {"MC_FORCE_TCP": "1"}


def sglang_cpu_pd_spec(cell: Cell, options: Any, *, ports: PDPorts) -> PDSpec:
    """Real SGLang's prefill and decode servers on CPU (the cell's ``sglang-cpu`` command and
    environment, plus the PD flags, Mooncake over TCP and the CPU plugin's PD bridges:
    ``conformance.sglang_plugins.cpu.pd_bridge``) and ``sglang_router`` in front."""
    from conformance.sglang_plugins import activation

    target = target_for(options).launcher(options)
    shared = ["--disaggregation-bootstrap-port", str(ports.bootstrap), "--disaggregation-transfer-backend", CPU_TRANSFER_BACKEND]
    launcher = f"{target.python} -m sglang.launch_server"

    def server(role: str, port: int) -> LaunchSpec:
        base = target.launch_spec(cell, port=port)
        env = env_for_role(cell, role, {**base.env, **CPU_TRANSFER_ENV, activation.PD_ENV: "1"})
        return LaunchSpec(argv=[*base.argv, "--disaggregation-mode", role, *shared], env=env, port=port, health_path="/health",
                          start_timeout_s=base.start_timeout_s, plugins=base.plugins)

    router_launcher = os.environ.get(ROUTER_LAUNCHER_ENV) or f"{target.python} -m sglang_router.launch_router"
    return PDSpec(server("prefill", ports.prefill), server("decode", ports.decode), _router_spec(ports, router_launcher), ports.bootstrap,
                  CPU_TRANSFER_BACKEND, {"server": launcher, "router": router_launcher})


def transport(spec: PDSpec) -> dict[str, str]:
    """The PD cell's transfer backend and protocol, as the report records them."""
    backend = spec.transfer_backend or "mooncake"  # SGLang's default backend
    protocol = CPU_TRANSFER_PROTOCOL if spec.prefill.env.get("MC_FORCE_TCP") == "1" else "default"
    return {"backend": backend, "protocol": protocol} if spec.launchers else {"backend": "reference", "protocol": "http"}


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
    from conformance.targets.sglang import validate_server_args

    server_launcher = spec.launchers.get("server", "python -m sglang.launch_server")
    out = {role: validate_server_args(strip_launcher(s.argv, server_launcher), cell, config=config)
           for role, s in (("prefill", spec.prefill), ("decode", spec.decode))}
    out["router"] = validate_router_argv(spec.router.argv, spec.launchers.get("router", ROUTER_LAUNCHER))
    return out


# ------------------------------------------------------------------ reference
def reference_pd_spec(
    cell: Cell, *, ports: PDPorts, model: str | None = None, python: str | None = None, role_env: dict[str, dict[str, str]] | None = None
) -> PDSpec:
    """The reference target's PD roles and router for ``cell`` (``model`` overrides the twin;
    ``role_env`` adds env per role, e.g. a seeded fault on the prefill role only)."""
    python = python or sys.executable
    common = [
        "--model", model or cell.model.twin, "--strategy", cell.strategy.name,
        "--page-size", str(cell.page_size), "--track-interval", str(cell.track_interval), "--host", "127.0.0.1",
    ]
    env = {**REFERENCE_ENV, **cell.env}
    decode_url = f"http://127.0.0.1:{ports.decode}"

    def role(name: str, port: int, extra: list[str]) -> LaunchSpec:
        argv = [python, "-m", "conformance.reference.pd", "--disaggregation-mode", name, *common, "--port", str(port), *extra]
        return LaunchSpec(argv=argv, env=env_for_role(cell, name, {**env, **(role_env or {}).get(name, {})}), port=port, start_timeout_s=180.0)

    router_argv = [python, "-m", "conformance.reference.router", "--prefill", f"http://127.0.0.1:{ports.prefill}",
                   "--decode", decode_url, "--host", "127.0.0.1", "--port", str(ports.router)]
    return PDSpec(role("prefill", ports.prefill, ["--decode-url", decode_url]), role("decode", ports.decode, []),
                  LaunchSpec(argv=router_argv, env=dict(REFERENCE_ENV), port=ports.router, start_timeout_s=120.0), router_batches=True)


def pd_spec_for(cell: Cell, options: Any, *, ports: PDPorts | None = None) -> PDSpec:
    """The PD commands for ``cell`` on the selected target (KitError when n/a)."""
    reason = not_applicable(cell, target_for(options).name)
    if reason:
        raise KitError(f"cell {cell.id}: {reason}")
    ports = ports or PDPorts.pick()
    kind = target_for(options)
    if kind.kit_engine:
        if kind.name not in cell.targets:
            raise KitError(f"cell {cell.id}: not applicable on target {kind.name}: cache variant {cell.cache_variant.name!r} is served by real SGLang only")
        return reference_pd_spec(cell, ports=ports)
    if kind.serves_pd and kind.kit_plugins:  # real SGLang on CPU
        return sglang_cpu_pd_spec(cell, options, ports=ports)
    if not (kind.serves_pd and kind.on_gpu):
        raise KitError(f"target {options.target!r} does not serve PD cells")
    from conformance.targets.serving import worker_index

    tp = 1 if options.twins else cell.model.tp_size
    if 3 * tp > options.gpus_per_worker:  # the worker's first tp GPUs serve the cell's non-PD server
        raise KitError(f"cell {cell.id}: PD needs {3 * tp} GPUs per worker (tp {tp} each for the non-PD server, prefill and decode) "
                       f"but --gpus-per-worker is {options.gpus_per_worker}")
    gpus = gpus_for_worker(worker_index(), options.gpus_per_worker)[tp : 3 * tp]
    target = SGLangTarget(launcher=options.sglang_launcher, twins=options.twins)
    return sglang_pd_spec(cell, target=target, ports=ports, gpus=gpus,
                          transfer_backend=os.environ.get(TRANSFER_BACKEND_ENV) or None,
                          router_launcher=os.environ.get(ROUTER_LAUNCHER_ENV) or ROUTER_LAUNCHER)


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
    from conformance.sglang_plugins.activation import REPORT_ENV

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
