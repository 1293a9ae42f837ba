"""The target registry: one :class:`Target` per ``--target`` value, and the only place
that knows the targets by name.

Everything the kit used to ask by comparing a target's name, or by testing one of its
flags, it asks the target object (``target_for(name)`` / ``TARGETS[name]``), and the
target answers: how a cell's server (and its PD unit) starts and on which GPUs, what
preflight checks (:meth:`Target.needs`), which suites and checks apply, whether results are
exact, the model it serves, what its engine is (:class:`ServingEngine`: idle gauges, lookahead,
the evidence its servers leave, the perf label), which options ``run`` forwards to
pytest, which verbs take it.  Every list of target names the fronts offer (``mutants``,
``fuzz``, ``replay``, ``perf-ab``, ...) is derived here.  Adding a target is one entry here
(and its name in ``conformance.matrix.cells.TARGETS``, which cells list).

Dependency direction: this module imports the launch classes of its own package,
``matrix``, ``sglang_api`` and ``errors``; front modules (cli, plugin, preflight, suites, ...)
import it, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from conformance.errors import KitError
from conformance.matrix.cells import TARGETS as TARGET_NAMES, Cell
from conformance.matrix.faults import LAYERS, POOL_LAYER, REFERENCE_LAYER, SGLANG_LAYER
from conformance.targets.base import LaunchSpec, ServerTarget
from conformance.targets.pd_launch import (
    PDPorts, PDSpec, contract_refusal, cpu_transfer_refusal, reference_pd_spec, sglang_cpu_pd_spec, sglang_gpu_pd_spec,
)
from conformance.targets.reference import ReferenceTarget
from conformance.targets.sglang import SGLangTarget, gpus_for_worker, visible_gpus, worker_index
from conformance.targets.sglang_cpu import SGLangCpuTarget
from conformance.sglang_api import probes # a cell with server options or a gated strategy: SGLang's answers
from conformance.targets.option_refusal import gate_refusal, probed_refusal, start_refusal
from conformance.targets.pool.gate import PoolGate # pytest's own: only inside a pytest session

#: The options of the SGLang-on-GPU launch that ``run`` forwards to pytest for the targets that use them.
GPU_LAUNCH_OPTIONS = ("sglang_launcher", "gpus_per_worker", "twins")
#: The optional verbs a target may take (:attr:`Target.verbs`), besides run, preflight, plan and fuzz.
VALIDATE = "plan --validate"
PERF_AB = "perf-ab"


# ------------------------------------------------------------------ what answers


@dataclass(frozen=True)
class ServingEngine:
    """What answers on a target's servers.  What preflight needs, how long idle gauges take,
    whether decoding looks ahead, the evidence the servers leave beside their logs and how
    the perf block names them follow from it."""

    label: str
    #: It is SGLang (an installed SGLang is needed); else the kit's own engine.
    sglang: bool = True
    #: Its servers load the kit's SGLang plugins: the entry points and the ``sgl_kernel``
    #: stand-in are needed; the observe plugin leaves per-request and per-node records beside
    #: the server log and publishes its gauges; seeded faults report when they fire.
    plugins: bool = False
    #: Flags its commands pass that SGLang's parser must accept.
    flags: tuple[str, ...] = ()

    @property
    def idle_deadline_s(self) -> float:
        """How long idle gauges may take: SGLang refreshes them lazily (up to 30 s); the kit's engine at once."""
        return 45.0 if self.sglang else 5.0

    def lookahead(self, cell: Cell, info: Mapping[str, Any]) -> int:
        """1 when the server overlaps scheduling (one step in flight), else 0; the kit's engine never does."""
        return int(self.sglang and self.track_slot_overlap(cell, info))

    def track_slot_overlap(self, cell: Cell, info: Mapping[str, Any]) -> bool:
        """Whether the server holds the track slots SGLang holds with its overlap scheduler on.
        SGLang: as its server info says.  The kit's engine decodes without lookahead (it
        reports the overlap scheduler off) but holds the slots of the strategy's contract."""
        if not self.sglang:
            return cell.strategy.overlap
        return not info.get("disable_overlap_schedule", not cell.strategy.overlap)

    def plugin_log(self, log_path: Path | str | None) -> Path | None:
        """The server log beside which the kit's plugins leave their records, or None (no log,
        or no kit plugin runs in this engine)."""
        return Path(log_path) if self.plugins and log_path is not None else None

    def perf_label(self, target: str, info: Mapping[str, Any]) -> str:
        """What served the cell, as the perf block names it: SGLang (and its version), or the
        kit's own engine -- allowed, and labelled as not SGLang."""
        version = info.get("version") or "unknown version"
        if not self.sglang:
            return f"{target}: the kit's own engine (not SGLang; reports {version})"
        return f"SGLang {version} ({target})"


KIT_ENGINE = ServingEngine("the kit's own engine", sglang=False)
SGLANG = ServingEngine("SGLang")
SGLANG_WITH_KIT_PLUGINS = ServingEngine("SGLang with the kit's plugins", plugins=True, flags=("--device",))


@dataclass(frozen=True)
class Placement:
    """Where a target's servers run: on this machine's CPU, or on CUDA GPUs (GPU sizes, the
    ``gpu`` marker, the GPU preflight, GPUs per xdist worker)."""

    #: The pytest marker its cells carry.
    marker: str
    cuda: bool = False

    def gpus(self, cell: Cell, options: Any) -> list[str] | None:
        """The GPUs of this xdist worker that serve ``cell`` (None on CPU)."""
        if not self.cuda:
            return None
        tp = 1 if options.twins else cell.model.tp_size
        if tp > options.gpus_per_worker:
            raise KitError(f"cell {cell.id}: needs tp_size {tp} GPUs but --gpus-per-worker is {options.gpus_per_worker}")
        return gpus_for_worker(worker_index(), options.gpus_per_worker)[:tp]

    def default_workers(self, gpus_per_worker: int, cores: int) -> int:
        """The xdist workers of a run without ``-n``: two on CPU (fewer cores: fewer); on GPUs
        one per ``gpus_per_worker`` block of visible GPUs."""
        if not self.cuda:
            return min(2, cores)
        visible = visible_gpus()[0] or []
        return max(1, len(visible) // max(1, gpus_per_worker))

    def pick(self, *, cpu: Any, gpu: Any) -> Any:
        """The value for this placement (e.g. workload sizes)."""
        return gpu if self.cuda else cpu


CPU = Placement("cpu")
GPU = Placement("gpu", cuda=True)


@dataclass(frozen=True)
class PD:
    """How a target serves a cell's PD unit (prefill + decode + router)."""

    #: Builds the unit's three commands: ``(cell, options, ports) -> PDSpec``.
    spec: Callable[[Cell, Any, PDPorts], PDSpec]
    #: The flags the disagg suite needs SGLang's parser to accept.
    sglang_flags: tuple[str, ...] = ("--disaggregation-mode",)
    #: Why a cell has no PD variant: SGLang 0.5.23's contract (the kit's engine follows it), or
    #: None when the installed release answers at start (real SGLang).
    not_applicable: Callable[[Cell], str | None] = lambda cell: None
    #: Why PD cannot run on this machine, SGLang's own answer when asked for its transfer
    #: engine (probed before any cell starts); None: nothing to ask.
    machine_refusal: Callable[[], str | None] | None = None


@dataclass(frozen=True)
class Needs:
    """What a run on a target needs, checked by preflight before any server starts."""

    gpus: bool  # visible CUDA GPUs, enough per worker
    sglang: bool  # an installed SGLang
    probe: bool  # SGLang imported in a child interpreter: its version and the features the selection needs
    plugins: bool  # the kit's SGLang entry points, the sgl_kernel stand-in and the launch mode
    pd_transport: bool  # SGLang's PD transfer engine on this machine (the disagg suite)
    sglang_flags: tuple[str, ...]  # flags SGLang's parser must accept, always
    pd_sglang_flags: tuple[str, ...]  # ... and with the disagg suite


# ------------------------------------------------------------------ the target


@dataclass(frozen=True)
class Target:
    """What the kit needs to know about one target: records and methods that answer the
    questions that used to be comparisons of its name or tests of its flags."""

    name: str
    help: str
    #: Builds the launch-spec maker for a cell's HTTP server from the run's options (None:
    #: the target serves no HTTP cell: the in-process pool tier; server suites are
    #: deselected, a run that ran nothing is not green, the report header shows SGLang's probes).
    server: Callable[[Any], ServerTarget] | None = None
    engine: ServingEngine = SGLANG
    placement: Placement = CPU
    #: Which model it serves: ``"always"`` the tiny twins, ``"flag"`` the twins with ``--twins``
    #: (else the HF models), ``"never"`` no model (the pool tier).
    twins: str = "always"
    #: Cached and cold runs must give the same tokens: ``"always"``, ``"float32"`` (when the
    #: server runs in float32), ``"never"``.
    exact: str = "never"
    #: How it serves a cell's PD unit (None: it serves none).
    pd: PD | None = None
    #: Suites added to the default selection (perf from the standard tier up, ``conformance.suites.perf.selection``).
    suites: tuple[str, ...] = ()
    #: The target the agreement suite compares this one with (None: agreement n/a).
    agrees_with: str | None = None
    #: Its own options (dests) that ``run`` forwards to pytest (``conformance.session.options.forward``).
    forwards: tuple[str, ...] = ()
    #: The optional verbs that take it (:data:`VALIDATE`, :data:`PERF_AB`).
    verbs: tuple[str, ...] = ()
    #: The seeded-fault layer (``conformance.matrix.faults.LAYERS``) ``mutants --target`` scores on it.
    faults: str | None = None

    # ------------------------------------------------------------------ questions

    @property
    def marker(self) -> str:
        """The pytest marker a cell of this target carries (``gpu`` or ``cpu``)."""
        return self.placement.marker

    def serves_http(self) -> bool:
        """It serves cells over SGLang's HTTP API (else it runs only the in-process pool tier)."""
        return self.server is not None

    def loads_kit_plugins(self) -> bool:
        """Its servers load the kit's SGLang plugins (evidence beside the log, seeded faults that report firing)."""
        return self.engine.plugins

    def on_cpu(self) -> bool:
        """Its servers run on this machine's CPU (CPU workload sizes)."""
        return not self.placement.cuda

    def accepts(self, verb: str) -> bool:
        """An optional verb (:data:`VALIDATE`, :data:`PERF_AB`) takes this target."""
        return verb in self.verbs

    def uses_option(self, dest: str) -> bool:
        """``run`` forwards its option ``dest`` to pytest for this target."""
        return dest in self.forwards

    def runs_by_default(self, suite: str) -> bool:
        """``suite`` is one of its own, added to the default selection."""
        return suite in self.suites

    def needs(self) -> Needs:
        """What preflight checks for a run on this target."""
        return Needs(
            gpus=self.placement.cuda, sglang=self.engine.sglang, probe=self.engine.sglang and self.serves_http(),
            plugins=self.engine.plugins, pd_transport=self.pd is not None and self.pd.machine_refusal is not None,
            sglang_flags=self.engine.flags, pd_sglang_flags=self.pd.sglang_flags if self.pd else (),
        )

    # ------------------------------------------------------------------ serving a cell

    def launcher(self, options: Any) -> ServerTarget:
        """The launch-spec maker for this run's options (KitError when it serves no HTTP cell)."""
        if self.server is None:
            raise KitError(f"target {self.name!r} does not serve HTTP cells")
        return self.server(options)

    def launch_spec(self, cell: Cell, options: Any, *, port: int) -> LaunchSpec:
        """The command and env of ``cell``'s server on this target, on its GPUs if it has any
        (KitError when it cannot serve the cell)."""
        server = self.launcher(options)
        reason = server.supports(cell)
        if reason:
            raise KitError(f"cell {cell.id}: not applicable on target {self.name}: {reason}")
        return server.launch_spec(cell, port=port, gpus=self.placement.gpus(cell, options))

    def option_refusal(self, cell: Cell) -> str | None:
        """SGLang's own reason, before launch, that ``cell`` is not applicable here: the
        installed parser lacks what the cell's server-option axes pass, or (where the kit's CPU
        plugin answers SGLang's device gate) the release gates its extra-buffer strategy on the
        device with nothing the plugin answers, or it would stop the cell at a start-up assert
        (``start_refusal``), or the release does not declare a test switch of SGLang's own the
        cell's fault sets (``SGLANG_TEST_RETRACT``).  None: launch it (and always on the kit's engine)."""
        gated = self.engine.plugins and cell.strategy.has_buffer
        if not self.needs().probe or not (cell.options or cell.strategy.has_buffer or cell.fault.env):
            return None
        features = probes.probe()
        return (probed_refusal(cell, features) or (gate_refusal(cell, features) if gated else None)
                or start_refusal(cell, features, twins=self.serves_twins())
                or features.test_switch_missing(dict(cell.fault.env)))

    def serves_twins(self, twins: bool = False) -> bool:
        return self.twins == "always" or (self.twins == "flag" and twins)

    def served_model(self, cell: Cell, twins: bool = False) -> str | None:
        """The model a cell's server loads: the tiny twin, the HF model, or None (no server)."""
        if self.serves_twins(twins):
            return cell.model.twin
        return cell.model.hf_path if self.twins == "flag" else None

    def exact_mode(self, info: Mapping[str, Any]) -> bool:
        """Deterministic: cached and cold runs must give the same tokens."""
        return self.exact == "always" or (self.exact == "float32" and str(info.get("dtype", "float32")) == "float32")

    def replay_options(self, dtype: str | None) -> str:
        """The target's own options a replay command carries (``--dtype`` unless float32)."""
        return f" --dtype {dtype}" if dtype and self.uses_option("dtype") and dtype != "float32" else ""

    # ------------------------------------------------------------------ PD

    def pd_not_applicable(self, cell: Cell) -> str | None:
        """The one-line reason ``cell`` has no PD variant on this target, or None."""
        return self.pd.not_applicable(cell) if self.pd else None

    def pd_refusal(self) -> str | None:
        """Why PD cannot run on this target on this machine (one line), or None."""
        return self.pd.machine_refusal() if self.pd and self.pd.machine_refusal else None

    def pd_spec(self, cell: Cell, options: Any, *, ports: PDPorts | None = None) -> PDSpec:
        """The PD commands for ``cell`` on this target (KitError when n/a)."""
        reason = self.pd_not_applicable(cell)
        if reason:
            raise KitError(f"cell {cell.id}: {reason}")
        if self.pd is None:
            raise KitError(f"target {self.name!r} does not serve PD cells")
        return self.pd.spec(cell, options, ports or PDPorts.pick())

    # ------------------------------------------------------------------ a pytest session

    def session_plugins(self) -> dict[str, Any]:
        """The pytest plugins a session on this target registers, by name: on the pool tier a
        gate that fails a run which tested nothing."""
        if self.serves_http():
            return {}
        return {"hybrid-conformance-pool-gate": PoolGate()}


def _sglang(options: Any) -> ServerTarget:
    return SGLangTarget(launcher=options.sglang_launcher, twins=options.twins)


def _sglang_cpu(options: Any) -> SGLangCpuTarget:
    return SGLangCpuTarget(dtype=getattr(options, "dtype", None) or "float32")


def _reference(options: Any) -> ServerTarget:
    return ReferenceTarget()


def _reference_pd(cell: Cell, options: Any, ports: PDPorts) -> PDSpec:
    if "reference" not in cell.targets:
        raise KitError(f"cell {cell.id}: not applicable on target reference: cache variant {cell.cache_variant.name!r} is served by real SGLang only")
    return reference_pd_spec(cell, ports=ports)


def _sglang_cpu_pd(cell: Cell, options: Any, ports: PDPorts) -> PDSpec:
    return sglang_cpu_pd_spec(cell, _sglang_cpu(options), ports=ports)


def _sglang_gpu_pd(cell: Cell, options: Any, ports: PDPorts) -> PDSpec:
    return sglang_gpu_pd_spec(cell, options, ports=ports)


_ALL = (
    Target("reference", "the kit's embedded CPU engine", server=_reference, engine=KIT_ENGINE, exact="always",
           pd=PD(_reference_pd, sglang_flags=(), not_applicable=contract_refusal), faults=REFERENCE_LAYER),
    Target("sglang", "real sglang serve on GPUs", server=_sglang, placement=GPU, twins="flag", pd=PD(_sglang_gpu_pd),
           suites=("perf",), verbs=(VALIDATE,), forwards=GPU_LAUNCH_OPTIONS),
    Target("sglang-cpu", "real SGLang on CPU serving the twins", server=_sglang_cpu, engine=SGLANG_WITH_KIT_PLUGINS, exact="float32",
           pd=PD(_sglang_cpu_pd, machine_refusal=cpu_transfer_refusal), suites=("agreement", "perf"), forwards=("dtype",),
           agrees_with="reference", verbs=(PERF_AB,), faults=SGLANG_LAYER),
    Target("pool", "only the in-process pool tier", twins="never", faults=POOL_LAYER),
)

#: Every target by name, in ``conformance.matrix.cells.TARGETS`` order.
TARGETS: dict[str, Target] = {t.name: t for t in _ALL}
assert tuple(TARGETS) == TARGET_NAMES, "conformance.matrix.cells.TARGETS and the registry list the same targets"
assert all(t.faults is None or t.faults in LAYERS for t in _ALL), "a target's seeded faults are one layer of conformance.matrix.faults"
assert all(t.loads_kit_plugins() for t in _ALL if t.accepts(PERF_AB)), "perf-ab's graded fault is a kit plugin inside the servers"
#: The target that runs the in-process pool tier (tests marked ``pool`` bind to it whatever ``--target`` is).
POOL = next(t for t in _ALL if not t.serves_http())
#: The targets that serve cells over HTTP (``replay``, ``known-bugs``, ``mutants --programs``).
HTTP_TARGETS = tuple(t.name for t in _ALL if t.serves_http())
#: The targets where the perf suite runs by default (named in messages).
PERF_TARGETS = tuple(t.name for t in _ALL if t.runs_by_default("perf"))
#: The kit's own engines (a failure there is a kit bug, never a known SGLang bug).
KIT_ENGINE_TARGETS = tuple(t.name for t in _ALL if not t.engine.sglang)
#: ``hybrid-conformance mutants --target``: the targets with seeded faults, in the order of
#: their fault layers; the first (the kit's engine) is the default.
MUTANT_TARGETS = tuple(sorted((t.name for t in _ALL if t.faults), key=lambda name: list(LAYERS).index(TARGETS[name].faults)))
#: ``fuzz``'s, ``replay``'s and ``known-bugs``' default target: the kit's own engine (fast and
#: exact); ``run``'s is ``conformance.matrix.cells.DEFAULT_TARGET``.
FUZZ_TARGET = KIT_ENGINE_TARGETS[0]


def accepting(verb: str) -> tuple[str, ...]:
    """The targets an optional verb takes, in registry order."""
    return tuple(t.name for t in _ALL if t.accepts(verb))


def option_users(dest: str) -> tuple[str, ...]:
    """The targets whose own option ``dest`` ``run`` forwards."""
    return tuple(t.name for t in _ALL if t.uses_option(dest))


def target_for(what: Any) -> Target:
    """The target of a name, or of anything with a ``target`` name (options, endpoint, plan)."""
    name = what if isinstance(what, str) else what.target
    try:
        return TARGETS[name]
    except KeyError:
        raise KitError(f"--target: unknown value {name!r}; allowed: {', '.join(TARGETS)}") from None


def target_help(names: Sequence[str] | None = None) -> str:
    """``--target`` help: each target (``names``, else every one) and what it is (the fronts add the default)."""
    return "who answers: " + ", ".join(f"{t.name} ({t.help})" for t in _ALL if names is None or t.name in names)
