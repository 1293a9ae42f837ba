"""The target registry: one :class:`Target` per ``--target`` value, and the only place
that knows the targets by name.

Everything the kit used to ask by comparing a target's name it now asks the target
object (``target_for(name)`` / ``TARGETS[name]``): how a cell's server is started,
what preflight checks, which suites and checks apply, whether results are exact, the
model it serves, how long its idle gauges take, which options ``run`` forwards to
pytest, what the report records.  Adding a target is one entry here (and its name in
``conformance.matrix.cells.TARGETS``, which cells list).

Dependency direction: this module imports the launch classes of its own package,
``matrix`` and ``errors``; front modules (cli, plugin, preflight, suites, ...) import it,
never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from conformance.errors import KitError
from conformance.matrix.cells import TARGETS as TARGET_NAMES, Cell
from conformance.targets.base import ServerTarget
from conformance.targets.reference import ReferenceTarget
from conformance.targets.sglang import SGLangTarget
from conformance.targets.sglang_cpu import SGLangCpuTarget

#: The options of the SGLang-on-GPU launch that ``run`` forwards to pytest for the targets that use them.
GPU_LAUNCH_OPTIONS = ("sglang_launcher", "gpus_per_worker", "twins")


@dataclass(frozen=True)
class Target:
    """What the kit needs to know about one target; every field answers one question that
    used to be a comparison of the target's name."""

    name: str
    help: str
    #: Builds the launch-spec maker for a cell's HTTP server from the run's options (None:
    #: the target serves no HTTP cell, e.g. the in-process pool tier).
    server: Callable[[Any], ServerTarget] | None = None
    #: The kit's own engine, not SGLang (no SGLang needed; decodes without lookahead;
    #: idle gauges at once; perf block labelled as not SGLang).
    kit_engine: bool = False
    #: Serves on CUDA GPUs (GPU sizes, ``gpu`` marker, GPU preflight, GPUs per worker).
    on_gpu: bool = False
    #: Which model it serves: ``"always"`` the tiny twins, ``"flag"`` the twins with ``--twins``
    #: (else the HF models), ``"never"`` no model (the pool tier).
    twins: str = "always"
    #: Cached and cold runs must give the same tokens: ``"always"``, ``"float32"`` (when the
    #: server runs in float32), ``"never"``.
    exact: str = "never"
    #: Runs only the in-process pool tier (server suites are deselected; a run that ran
    #: nothing is not green; the report header shows SGLang's feature probes).
    pool_only: bool = False
    #: Needs an installed SGLang (preflight), and probes its import (``probe_sglang``).
    needs_sglang: bool = False
    probes_sglang: bool = False
    #: Needs the kit's SGLang entry points and the ``sgl_kernel`` stand-in (real SGLang on CPU).
    kit_plugins: bool = False
    #: Flags the selection needs SGLang's parser to accept, always / with the disagg suite.
    sglang_flags: tuple[str, ...] = ()
    pd_sglang_flags: tuple[str, ...] = ()
    #: Serves the PD (disaggregation) unit; ``pd_probe_refusal``: SGLang's own probe says why not.
    serves_pd: bool = True
    pd_probe_refusal: bool = False
    #: Suites added to the default selection (perf only where :attr:`perf` allows it).
    suites: tuple[str, ...] = ()
    #: The perf suite runs by default here (standard tier up): a real SGLang target.
    perf: bool = False
    #: ``--dtype`` applies (and a replay command carries it).
    takes_dtype: bool = False
    #: ``plan --validate`` checks its commands with SGLang's own parser.
    validates_commands: bool = False
    #: The target the agreement suite compares this one with (None: agreement n/a).
    agrees_with: str | None = None
    #: Its own options (dests) that ``run`` forwards to pytest (``conformance.session.options.forward``).
    forwards: tuple[str, ...] = ()

    # ------------------------------------------------------------------ questions

    @property
    def marker(self) -> str:
        """The pytest marker a cell of this target carries (``gpu`` or ``cpu``)."""
        return "gpu" if self.on_gpu else "cpu"

    @property
    def serves_http(self) -> bool:
        return self.server is not None

    def launcher(self, options: Any) -> ServerTarget:
        """The launch-spec maker for this run's options (KitError when it serves no HTTP cell)."""
        if self.server is None:
            raise KitError(f"target {self.name!r} does not serve HTTP cells")
        return self.server(options)

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

    def lookahead(self, cell: Cell, info: Mapping[str, Any]) -> int:
        """1 when the server overlaps scheduling (one step in flight), else 0."""
        if self.kit_engine:
            return 0
        return 0 if info.get("disable_overlap_schedule", not cell.strategy.overlap) else 1

    @property
    def idle_deadline_s(self) -> float:
        """How long idle gauges may take: SGLang refreshes them lazily (up to 30 s)."""
        return 5.0 if self.kit_engine else 45.0


def _sglang(options: Any) -> ServerTarget:
    return SGLangTarget(launcher=options.sglang_launcher, twins=options.twins)


def _sglang_cpu(options: Any) -> ServerTarget:
    return SGLangCpuTarget(dtype=getattr(options, "dtype", None) or "float32")


def _reference(options: Any) -> ServerTarget:
    return ReferenceTarget()


_ALL = (
    Target("reference", "the kit's embedded CPU engine", server=_reference, kit_engine=True, exact="always"),
    Target("sglang", "real sglang serve on GPUs", server=_sglang, on_gpu=True, twins="flag", needs_sglang=True, probes_sglang=True,
           pd_sglang_flags=("--disaggregation-mode",), suites=("perf",), perf=True, validates_commands=True, forwards=GPU_LAUNCH_OPTIONS),
    Target("sglang-cpu", "real SGLang on CPU serving the twins", server=_sglang_cpu, exact="float32", needs_sglang=True, probes_sglang=True,
           kit_plugins=True, sglang_flags=("--device",), pd_sglang_flags=("--disaggregation-mode",), pd_probe_refusal=True, suites=("agreement", "perf"), perf=True,
           takes_dtype=True, forwards=("dtype",), agrees_with="reference"),
    Target("pool", "only the in-process pool tier", twins="never", pool_only=True, needs_sglang=True),
)

#: Every target by name, in ``conformance.matrix.cells.TARGETS`` order.
TARGETS: dict[str, Target] = {t.name: t for t in _ALL}
assert tuple(TARGETS) == TARGET_NAMES, "conformance.matrix.cells.TARGETS and the registry list the same targets"
#: The target that runs the in-process pool tier (tests marked ``pool`` bind to it whatever ``--target`` is).
POOL = next(t for t in _ALL if t.pool_only)
#: The targets where the perf suite runs by default (named in messages).
PERF_TARGETS = tuple(t.name for t in _ALL if t.perf)


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
