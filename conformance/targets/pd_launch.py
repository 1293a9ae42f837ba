"""A cell's PD unit as commands: a prefill server, a decode server and a router, launching nothing.

``sglang_pd_spec`` builds SGLang's three commands for a cell (``--disaggregation-mode
prefill|decode`` with a shared ``--disaggregation-bootstrap-port``, the decode server on its
own GPUs via ``--base-gpu-id``, an optional ``--disaggregation-transfer-backend``, and
``sglang_router.launch_router --pd-disaggregation``), ``sglang_gpu_pd_spec`` places them on an
xdist worker's GPUs; ``sglang_cpu_pd_spec`` the same roles on ``sglang-cpu`` (the cell's CPU
command, Mooncake over TCP, the CPU plugin's PD bridge); ``reference_pd_spec`` the reference
target's (``conformance.reference.pd`` roles and ``conformance.reference.router``).  Each
target's record (``conformance.targets.registry``) names its builder; ``conformance.targets.disagg``
validates and starts the unit.  ``extra_buffer_lazy`` is refused under PD by SGLang 0.5.23:
:func:`contract_refusal` says so in one line.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from conformance.errors import KitError
from conformance.matrix.cells import Cell
from conformance.targets.base import LaunchSpec
from conformance.targets.sglang import SGLangTarget, gpus_for_worker, worker_index
from conformance.targets.sglang_cpu import SGLangCpuTarget
from conformance.sglang_contract.metric_names import PD_PENDING_TRANSFERS
from conformance.sglang_api import probes
from conformance.targets.launcher import free_port  # the launcher (httpx, process groups) only when ports are picked
from conformance.sglang_plugins import activation

LAZY_REFUSAL = "extra_buffer_lazy is refused under PD disaggregation by SGLang 0.5.23 (not applicable)"
ROUTER_LAUNCHER = "python -m sglang_router.launch_router"
#: env knobs (until the plugin has options for them)
TRANSFER_BACKEND_ENV = "HYBRID_CONFORMANCE_PD_TRANSFER_BACKEND"
ROUTER_LAUNCHER_ENV = "HYBRID_CONFORMANCE_SGLANG_ROUTER"
TRANSFER_BACKENDS = ("mooncake", "nixl", "mooncake_tcp", "mori", "ascend")
REFERENCE_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def contract_refusal(cell: Cell) -> str | None:
    """SGLang 0.5.23's PD contract for ``cell``: the one-line reason it has no PD variant
    (extra_buffer_lazy), or None.  What ``plan`` says, and what the kit's own engine follows."""
    return None if cell.strategy.pd else LAZY_REFUSAL


def env_for_role(cell: Cell, role: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` for the PD server ``role`` of ``cell``: without the cell fault's variables when
    the fault is for the other role only (``pd_roles`` in the matrix); plus the fault's
    ``pd_env`` (every PD server)."""
    both = dict(cell.fault.pd_env)
    if role in cell.fault.pd_roles:
        return {**env, **both}
    theirs = dict(cell.fault.env)
    return {**{k: v for k, v in env.items() if k not in theirs}, **both}


def cpu_transfer_refusal() -> str | None:
    """SGLang's own answer when asked for its default PD transfer engine here (probed once);
    None when it builds (the non-CUDA Mooncake wheel and libibverbs installed)."""
    refusal = probes.probe().pd_transfer_refusal
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
    #: Idle gauges its servers publish besides SGLang's Mamba and KV gauges (the reference PD roles' pending transfers).
    extra_gauges: tuple[str, ...] = ()

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

def sglang_gpu_pd_spec(cell: Cell, options: Any, *, ports: PDPorts) -> PDSpec:
    """SGLang's three commands for ``cell`` on the xdist worker's GPUs: its first tp GPUs serve
    the cell's non-PD server, the next two blocks of tp the prefill and decode servers."""
    tp = 1 if options.twins else cell.model.tp_size
    if 3 * tp > options.gpus_per_worker:  # the worker's first tp GPUs serve the cell's non-PD server
        raise KitError(f"cell {cell.id}: PD needs {3 * tp} GPUs per worker (tp {tp} each for the non-PD server, prefill and decode) "
                       f"but --gpus-per-worker is {options.gpus_per_worker}")
    gpus = gpus_for_worker(worker_index(), options.gpus_per_worker)[tp : 3 * tp]
    target = SGLangTarget(launcher=options.sglang_launcher, twins=options.twins)
    return sglang_pd_spec(cell, target=target, ports=ports, gpus=gpus,
                          transfer_backend=os.environ.get(TRANSFER_BACKEND_ENV) or None,
                          router_launcher=os.environ.get(ROUTER_LAUNCHER_ENV) or ROUTER_LAUNCHER)


# ------------------------------------------------------------------ SGLang on CPU
#: SGLang's PD transport on ``sglang-cpu``: its own Mooncake backend (the non-CUDA wheel),
#: forced onto TCP (this machine has no RDMA device); read by SGLang's
#: ``mooncake_transfer_engine.py``.
CPU_TRANSFER_BACKEND = "mooncake"
CPU_TRANSFER_PROTOCOL = "tcp"
CPU_TRANSFER_ENV = {"MC_FORCE_TCP": "1"}


def sglang_cpu_pd_spec(cell: Cell, target: SGLangCpuTarget, *, ports: PDPorts) -> PDSpec:
    """Real SGLang's prefill and decode servers on CPU (the cell's ``sglang-cpu`` command and
    environment, plus the PD flags, Mooncake over TCP and the CPU plugin's PD bridges:
    ``conformance.sglang_plugins.cpu.pd_bridge``) and ``sglang_router`` in front."""
    shared = ["--disaggregation-bootstrap-port", str(ports.bootstrap), "--disaggregation-transfer-backend", CPU_TRANSFER_BACKEND]
    launcher = f"{target.python} -m sglang.launch_server"

    def server(role: str, port: int) -> LaunchSpec:
        base = target.launch_spec(cell, port=port)
        env = env_for_role(cell, role, {**base.env, **CPU_TRANSFER_ENV, activation.PD_ENV: "1"})
        return LaunchSpec(argv=[*base.argv, "--disaggregation-mode", role, *shared], env=env, port=port, health_path="/health",
                          start_timeout_s=base.start_timeout_s, plugins=base.plugins, term_grace_s=base.term_grace_s)

    router_launcher = os.environ.get(ROUTER_LAUNCHER_ENV) or f"{target.python} -m sglang_router.launch_router"
    return PDSpec(server("prefill", ports.prefill), server("decode", ports.decode), _router_spec(ports, router_launcher), ports.bootstrap,
                  CPU_TRANSFER_BACKEND, {"server": launcher, "router": router_launcher})


def transport(spec: PDSpec) -> dict[str, str]:
    """The PD cell's transfer backend and protocol, as the report records them."""
    backend = spec.transfer_backend or "mooncake"  # SGLang's default backend
    protocol = CPU_TRANSFER_PROTOCOL if spec.prefill.env.get("MC_FORCE_TCP") == "1" else "default"
    return {"backend": backend, "protocol": protocol} if spec.launchers else {"backend": "reference", "protocol": "http"}


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
                  LaunchSpec(argv=router_argv, env=dict(REFERENCE_ENV), port=ports.router, start_timeout_s=120.0), router_batches=True,
                  extra_gauges=(PD_PENDING_TRANSFERS,))
