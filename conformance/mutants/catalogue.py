"""Which cells each seeded fault runs on, for ``hybrid-conformance mutants``.

The faults themselves (:class:`conformance.matrix.faults.SeededFault` records: name, layer, the real
bug, where injected, what catches it) live with their layers:
``conformance/reference/faults.py`` (reference engine, env ``HYBRID_CONFORMANCE_FAULT``),
``conformance/mutants/pool_faults.py`` (monkeypatches of SGLang's real functions) and
``conformance/sglang_plugins/faults/`` (hooks in real SGLang servers, env
``HYBRID_CONFORMANCE_SGLANG_FAULT``); each record names where it can show.  This module
turns that into where each is exercised: the smallest selection of cells on which the
fault can show, so the whole catalogue runs in minutes (the reference engine) or well
under an hour (one real SGLang server per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from conformance.errors import KitError
from conformance.matrix.faults import FAULT_ENV, PAIRED_AB, PD_FAULT_ENV, POOL_LAYER, REFERENCE_LAYER, SGLANG_FAULT_ENV, SGLANG_LAYER, SeededFault
from conformance.matrix.strategy import BASELINE, strategy_named
from conformance.targets.registry import target_for
from conformance.reference.faults import FAULTS
from conformance.sglang_plugins.faults.catalogue import faults
from conformance.matrix.cells import load_matrix
from conformance.matrix.cells import TIERS
from conformance.matrix import axes


@dataclass(frozen=True)
class MutantPlan:
    """A pytest selection that one fault (or the clean run) is measured on."""

    key: str
    target: str = "reference"
    suites: tuple[str, ...] = ("kl", "prefix_branching", "gsm8k", "leaks")
    models: str | None = None
    strategies: str | None = None
    page_sizes: str | None = None
    server_options: str | None = None  # axis=value,... (conformance.matrix.axes): the cell's server options
    tier: str | None = "premerge"
    faults: str | None = "none"
    keyword: str | None = None
    stop_at_first: bool = False
    timeout_s: float = 900.0
    fault_env: str = FAULT_ENV
    extra_args: tuple[str, ...] = ()  # more pytest arguments (e.g. the programs suite's --budget)
    #: Not a pytest selection: the paired A/B perf test on cell ``keyword`` (``perf-ab --fault``),
    #: for a fault whose record names it in ``seen_by`` (no suite's check can see it).
    paired_ab: bool = False


EXTRA = MutantPlan("qwen3-next/extra_buffer", models="qwen3-next", strategies="extra_buffer")
LAZY = MutantPlan("qwen3-next/extra_buffer_lazy", models="qwen3-next", strategies="extra_buffer_lazy")
LAZY_FAIL = MutantPlan("qwen3-next/extra_buffer_lazy+lazy_alloc_fail", models="qwen3-next", strategies="extra_buffer_lazy", faults="lazy_alloc_fail")
MAMBA2 = MutantPlan("nemotron-h/extra_buffer", models="nemotron-h", strategies="extra_buffer", tier="standard")
PD = MutantPlan("qwen3-next/extra_buffer:disagg", suites=("disagg",), models="qwen3-next", strategies="extra_buffer", fault_env=PD_FAULT_ENV)

NO_BUFFER = MutantPlan("qwen3-next/no_buffer", models="qwen3-next", strategies="no_buffer")
#: The reference engine's cells, by (model family, strategy, matrix fault): a reference fault
#: runs on the cell its record names (its first family and strategy; default EXTRA's).
REFERENCE_CELLS: dict[tuple[str | None, str | None, str | None], MutantPlan] = {
    (p.models, p.strategies, p.faults): p for p in (EXTRA, LAZY, LAZY_FAIL, MAMBA2, NO_BUFFER)
}

#: The CI subset: one fault per check kind that must catch it.
FAST_REFERENCE = ("pingpong_leak_on_finish", "cached_tokens_overreport", "state_scaled_1pct", "idle_check_disabled_with_leak")
FAST_POOL = ("pingpong_leak_on_finish", "cow_skipped", "track_boundary_late")
FAST_SGLANG_CPU = ("pingpong_leak_on_finish", "cow_skipped")

#: A real SGLang server starts in 30-240 s on a shared 2-core machine; the suites of a cell
#: take a few minutes more.
SGLANG_CPU_TIMEOUT_S = 1500.0


def _reference_cell(fault: SeededFault) -> MutantPlan:
    """The cell a reference fault runs on: its first model family and strategy (default
    EXTRA's), with the matrix fault its record needs."""
    family = fault.families[0] if fault.families else EXTRA.models
    strategy = fault.strategies[0] if fault.strategies else EXTRA.strategies
    return REFERENCE_CELLS[(family, strategy, fault.cell_fault)]


def reference_plans() -> dict[str, MutantPlan]:
    from conformance.reference.pd import PD_FAULTS  # deferred: the PD roles import torch; only the reference catalogue needs them

    plans = {name: _reference_cell(f) for name, f in FAULTS.items()}
    plans.update({name: PD for name in PD_FAULTS})
    return plans


def pool_plans() -> dict[str, MutantPlan]:
    from conformance.mutants.pool_faults import FAULTS  # deferred: the pool faults import torch and SGLang's pools; only the pool catalogue needs them

    plans = {}
    for name, spec in FAULTS.items():
        strategies = spec.strategies
        key = f"pool/{','.join(strategies) if strategies else 'all'}"
        # -x: a pool fault is caught by the first failing invariant (its shrunk program is the numbers)
        plans[name] = MutantPlan(key, target="pool", suites=(), strategies=",".join(strategies) if strategies else None, tier="premerge", faults=None, stop_at_first=True)
    return plans


def sglang_cpu_plans(names: tuple[str, ...] | None = None) -> dict[str, MutantPlan]:
    """Each real-SGLang fault (of ``names``, default all) on the cheapest premerge cell where
    it can show (its first model family and strategy, with the matrix fault it needs).
    A fault judged by the perf suite also runs the model's ``no_buffer`` cell, whose
    timings the perf ratios (``ttft_vs_no_buffer``, ``decode_vs_no_buffer``) divide by.
    Faults of one cell share one selection of suites -- the union of what the selected
    ones need -- so one clean run per cell vouches for all of them; each fault runs its own
    catching suite first and stops at the first failure.  A fault only the paired A/B sees
    (``seen_by``) gets a paired A/B plan instead (:func:`paired_ab_plan`)."""
    selected = {n: f for n, f in faults().items() if names is None or n in names}
    ab = {n: paired_ab_plan(f) for n, f in selected.items() if PAIRED_AB in f.seen_by}
    selected = {n: f for n, f in selected.items() if n not in ab}

    def cell_of(f) -> tuple[str, str, str, str]:
        strategy = f.strategies[0]
        if "perf" in f.suites and not strategy_named(strategy).is_baseline:  # the perf ratios are taken against the baseline sibling
            strategy = f"{BASELINE},{strategy}"
        # an option at its strategy's default (overlap=on for extra_buffer) is the plain cell's own
        return f.families[0], strategy, f.cell_fault, "" if at_defaults(f) else ",".join(f.options), f.cache_variant

    needed: dict[tuple[str, str, str, str, str], set[str]] = {}
    for f in selected.values():
        needed.setdefault(cell_of(f), set()).update(f.suites)
    plans = {}
    for name, f in selected.items():
        model, strategy, cell_fault, options, variant = cell_of(f)
        union = needed[(model, strategy, cell_fault, options, variant)]
        suites = tuple(f.suites) + tuple(s for s in ("kl", "prefix_branching", "leaks", "gsm8k", "perf") if s in union and s not in f.suites)
        fault_part = "" if cell_fault == "none" else f"+{cell_fault}"
        options_part = f"[{options}]" if options else ""
        variant_part = "" if variant == "radix" else f"-{variant}"
        key = f"sglang-cpu/{model}/{strategy}{fault_part}{options_part}{variant_part}:{'+'.join(sorted(union))}"
        plans[name] = MutantPlan(
            key, target="sglang-cpu", suites=suites, models=model, strategies=strategy, faults=cell_fault,
            server_options=options or None,
            # a fault that needs a server option runs on its standard-tier axis cell; one that
            # needs a cache variant (a host tier) on that variant's nightly cell, picked by its id;
            # one that needs a matrix fault on the smallest tier that has that fault's cells
            tier="nightly" if variant != "radix" else "standard" if options else _fault_tier(cell_fault),
            page_sizes="1" if variant != "radix" else None, keyword=f"p1-t256-{variant}" if variant != "radix" else None,
            stop_at_first=True, timeout_s=SGLANG_CPU_TIMEOUT_S, fault_env=SGLANG_FAULT_ENV,
        )
    return {**plans, **ab}


#: Two servers start per paired A/B run (one pair, ~30 paired requests).
PAIRED_AB_TIMEOUT_S = 900.0
#: The plan key's suffix of a paired A/B plan.
PAIRED_AB_KEY = "perf-ab"


def paired_ab_plan(f: SeededFault) -> MutantPlan:
    """A fault the paired A/B sees: one pair of servers of its first premerge cell (its first
    model family and strategy, plain), the fault on one drawn side (``perf-ab --fault``)."""
    cells = [c for c in load_matrix().cells if c.model.family == f.families[0] and c.strategy.name == f.strategies[0]
             and c.tier == "premerge" and not c.fault.injected and not c.options and c.cache_variant.name == "radix"]
    if not cells:
        raise KitError(f"fault {f.name}: no plain premerge cell of {f.families[0]} / {f.strategies[0]} for its paired A/B")
    return MutantPlan(f"sglang-cpu/{cells[0].id}:{PAIRED_AB_KEY}", target="sglang-cpu", suites=(), keyword=cells[0].id, tier=None,
                      faults=None, stop_at_first=True, timeout_s=PAIRED_AB_TIMEOUT_S, fault_env=SGLANG_FAULT_ENV, paired_ab=True)



def _fault_tier(cell_fault: str) -> str:
    """The smallest tier of the matrix with a cell of the matrix fault ``cell_fault``."""
    tiers = {c.tier for c in load_matrix().cells if c.fault.name == cell_fault}
    return next((t for t in TIERS if t in tiers), TIERS[0])


def at_defaults(f: SeededFault) -> bool:
    """The fault's server options are all its strategy's defaults (its cell is a plain one)."""
    return axes.all_default(f.options, strategy_named(f.strategies[0]))


@dataclass(frozen=True)
class Catalogue:
    """One fault layer's seeded faults for ``mutants``: every plan, and the CI subset (``--fast``)."""

    plans: Callable[[], dict[str, MutantPlan]]
    fast: tuple[str, ...]


#: Fault layer (``conformance.matrix.faults.LAYERS``) -> its catalogue; ``mutants --target T``
#: scores the layer T's record names (``Target.faults``; the option's choices:
#: ``conformance.targets.registry.MUTANT_TARGETS``).
CATALOGUES: dict[str, Catalogue] = {
    REFERENCE_LAYER: Catalogue(reference_plans, FAST_REFERENCE),
    POOL_LAYER: Catalogue(pool_plans, FAST_POOL),
    SGLANG_LAYER: Catalogue(sglang_cpu_plans, FAST_SGLANG_CPU),
}


def catalogue_for(target: str) -> Catalogue:
    """The catalogue ``mutants --target target`` scores."""
    return CATALOGUES[target_for(target).faults]
