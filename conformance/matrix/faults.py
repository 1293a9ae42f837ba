"""The one record of a seeded fault, for every layer, and the env vars that switch faults on.

A :class:`SeededFault` says what the fault is (``description``), the real bug it mimics
(``real_bug``), its layer and so how it is switched on (:attr:`SeededFault.switch`), where it is
injected (``injected_at``), what a check sees (``observable``) and which suites are expected
to catch it (``suites``) or which check outside them can (``seen_by``), plus where it can show (``strategies``, ``families``,
``cell_fault``) for the ``mutants`` plans, and its :class:`FaultGroup` (``group``: why it was
written, e.g. for the request programs or a server-option axis).  Each layer keeps its own registry of these
records and its own injection code:

* ``reference``: the reference engine's hooks ask its ``FaultSwitch``
  (``conformance/reference/faults.py``, ``program_faults.py``);
* ``reference-pd``: the reference engine's PD roles (``conformance/reference/pd.py``);
* ``pool``: monkeypatches of SGLang's real pool classes, the record's ``patch``
  (``conformance/mutants/pool_faults.py``);
* ``sglang``: hooks in a real SGLang server, the record's ``hooks``
  (``conformance/sglang_plugins/faults/``).

Imported inside real SGLang server processes and by the reference engine: it imports
nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: The reference engine's fault (and the pool tier's, under ``-p conformance.mutants.pool_faults``).
FAULT_ENV = "HYBRID_CONFORMANCE_FAULT"
#: The reference engine's PD fault (seen by the PD roles only).
PD_FAULT_ENV = "HYBRID_CONFORMANCE_PD_FAULT"
#: The real-SGLang fault, loaded by the ``hybrid_conformance_faults`` general plugin.
SGLANG_FAULT_ENV = "HYBRID_CONFORMANCE_SGLANG_FAULT"
#: SGLang's own test switch that makes the lazy ping-pong slot allocation fail.
LAZY_ALLOC_FAIL_ENV = "SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL"
#: SGLang's own test switch that makes a PD transfer poll fail with this probability.
DISAGG_FAILURE_ENV = "SGLANG_TEST_DISAGG_FAILURE_PROB"
#: The grade of the real-SGLang fault ``step_slowdown`` (a fraction of a step's work, or ``@file``).
STEP_SLOWDOWN_ENV = "HYBRID_CONFORMANCE_STEP_SLOWDOWN"
#: Every seeded-fault switch the kit knows (its own three, the slowdown's grade and SGLang's
#: two test switches).
FAULT_SWITCHES = (FAULT_ENV, PD_FAULT_ENV, SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV, LAZY_ALLOC_FAIL_ENV, DISAGG_FAILURE_ENV)
#: A check outside the suites that can see a fault: the paired A/B perf test (two servers of
#: one cell, the fault on one; ``hybrid-conformance perf-ab``, ``conformance/checks/perf_ab.py``).
#: A fault whose record names it in ``seen_by`` is scored by ``mutants`` through it.
PAIRED_AB = "perf A/B (paired)"
#: Every check a record's ``seen_by`` may name.
SEEN_BY = (PAIRED_AB,)


@dataclass(frozen=True)
class Layer:
    """Where a fault lives: the env var that names it and how it is switched on there."""

    name: str
    title: str
    env: str
    how: str


#: The layers' names (a fault record's ``layer``; a target's ``faults``, ``conformance.targets.registry``).
REFERENCE_LAYER = "reference"
REFERENCE_PD_LAYER = "reference-pd"
POOL_LAYER = "pool"
SGLANG_LAYER = "sglang"
LAYERS: dict[str, Layer] = {layer.name: layer for layer in (
    Layer(REFERENCE_LAYER, "Reference engine", FAULT_ENV,
          f"switched on with `{FAULT_ENV}=<name>` (read once, in `conformance/reference/faults.py`)"),
    Layer(REFERENCE_PD_LAYER, "Reference PD roles", PD_FAULT_ENV,
          f"switched on with `{PD_FAULT_ENV}=<name>` (read in `conformance/reference/pd.py`, seen by the PD roles only)"),
    Layer(POOL_LAYER, "Pool tier (SGLang's real classes)", FAULT_ENV,
          f"monkeypatches loaded with `pytest -p conformance.mutants.pool_faults` and `{FAULT_ENV}=<name>`"),
    Layer(SGLANG_LAYER, "Real SGLang (targets `sglang-cpu` and `sglang`)", SGLANG_FAULT_ENV,
          "hooks registered through SGLang's own `HookRegistry` by the kit's general plugin `hybrid_conformance_faults`, "
          f"in the scheduler process of the servers the kit launches, when `{SGLANG_FAULT_ENV}=<name>` "
          "is set (one module per fault in `conformance/sglang_plugins/faults/`; each hook proves it took effect and "
          "reports when it fires). Scored with `hybrid-conformance mutants --target sglang-cpu` (one real SGLang server "
          "per run; its fast subset `hybrid-conformance mutants --target sglang-cpu --fast` runs in the scheduled "
          "workflow); each is first shown harmful by a direct probe in `tests/test_sglang_fault_probes.py`, whose fast "
          "subset CI runs"),
)}


@dataclass(frozen=True)
class FaultGroup:
    """A kind of seeded fault: why it was written and what its cell needs."""

    name: str
    about: str


GROUPS: dict[str, FaultGroup] = {group.name: group for group in (
    FaultGroup("scripted", "SGLang's known regressions and the bug classes the scripted suites catch"),
    FaultGroup("programs", "written for the request programs: bug classes the scripted suites rarely or never reach "
                           "(`mutants --programs` measures them)"),
    FaultGroup("option", "written for the server-option axes: each shows only with its option on (`SeededFault.options`), "
                         "so its cell is a standard-tier axis cell"),
    FaultGroup("pd", "PD disaggregation: injected in the disaggregation code, fires only in PD roles"),
    FaultGroup("hicache", "HiCache: injected in SGLang's host pools; its cell is a `hicache` cache-variant cell"),
)}


@dataclass(frozen=True)
class SeededFault:
    """A seeded fault of any layer (see the module docstring).

    ``hooks`` (layer ``sglang``: the SGLang ``Hook`` records) and ``patch`` (layer ``pool``:
    ``patch(api, setattr_like)``) are the layer's own injection; ``strategies`` /
    ``families`` empty means any; ``suites``: the suites whose checks must catch it, first
    the one expected to; ``cell_fault``: the matrix fault its cell needs too.
    """

    name: str
    layer: str
    description: str
    real_bug: str
    injected_at: str = ""
    observable: str = ""
    suites: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    families: tuple[str, ...] = ()
    cell_fault: str = "none"
    #: Server-option axis values (``axis=value``) the fault only shows under; its cell sets them.
    options: tuple[str, ...] = ()
    #: The matrix cache variant its cell needs (``hicache``: a host tier); "radix" is the default cell.
    cache_variant: str = "radix"
    hooks: tuple[Any, ...] = ()
    patch: Callable[[Any, Callable], None] | None = None
    #: Checks outside the suites that can see it (``SEEN_BY``): ``mutants`` scores it through
    #: them instead of a suite's checks (e.g. a small slowdown no suite's threshold can see).
    seen_by: tuple[str, ...] = ()
    #: Its :data:`GROUPS` entry: why it was written.
    group: str = "scripted"

    def __post_init__(self) -> None:
        if self.layer not in LAYERS:
            raise ValueError(f"fault {self.name}: layer {self.layer!r}, known: {', '.join(LAYERS)}")
        if self.group not in GROUPS:
            raise ValueError(f"fault {self.name}: group {self.group!r}, known: {', '.join(GROUPS)}")
        unknown = [c for c in self.seen_by if c not in SEEN_BY]
        if unknown:
            raise ValueError(f"fault {self.name}: seen_by {unknown[0]!r}, known: {', '.join(SEEN_BY)}")

    @property
    def env(self) -> str:
        """The env var that switches this fault on."""
        return LAYERS[self.layer].env

    @property
    def switch(self) -> str:
        """How to switch it on, as typed: ``ENV=name``."""
        return f"{self.env}={self.name}"


def registry(*faults: SeededFault) -> dict[str, SeededFault]:
    """Name -> fault; a name given twice is an error."""
    out: dict[str, SeededFault] = {}
    for f in faults:
        if f.name in out:
            raise ValueError(f"fault {f.name} declared twice")
        out[f.name] = f
    return out
