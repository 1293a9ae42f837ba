"""What every suite shares: turning a Verdict into a test outcome, per-target workload
sizes, the cell's resolved grids, and the idle probe taken after each scenario.

Suites stay three-phase (record, then check, then settle) and import from here rather
than repeating the binding in each file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import pytest

from conformance.recordings import IdleProbe
from conformance.checks.prefix_oracle import PrefixOracle
from conformance.matrix.cells import Cell
from conformance.records import Verdict
from conformance.report.phases import phase
from conformance.targets.registry import target_for
from conformance.workloads import idle
from conformance.checks.hit_bounds import StrategyGrid, prefill_never_tracked


class ServedCell(Protocol):
    """What these helpers read of a served cell: an ``Endpoint``, or a PD cell's ``PDEndpoint``."""

    @property
    def cell(self) -> Cell: ...
    @property
    def target(self) -> str: ...
    @property
    def info(self) -> dict[str, Any]: ...
    @property
    def extra(self) -> dict[str, Any]: ...


def settle(verdict: Verdict) -> Verdict:
    """fail -> test failure with the numbers (a known SGLang bug, still present: an
    expected failure, ``conformance.session.known_bugs``); skip -> test skip with the stated reason."""
    if verdict.status == "fail" and "known_bug" in verdict.details:
        pytest.xfail(verdict.summary())
    if verdict.status == "fail":
        pytest.fail(verdict.summary(), pytrace=False)
    if verdict.status == "skip":
        pytest.skip(f"{verdict.check}: {verdict.reason}")
    return verdict


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: small on the CPU reference target, the anchor's budget on GPUs."""

    kl_prompts: int
    kl_new_tokens: int
    kl_max_len: int
    kl_turn1_tokens: int
    top_k: int
    tree_fanout: int
    tree_depth: int
    tree_new_tokens: int
    gsm8k_n: int
    gsm8k_shots: int
    gsm8k_new_tokens: int
    load_requests: int
    load_new_tokens: int
    session_turns: int


# A decode step of a tiny twin costs ~10-25 ms on CPU (transformers' per-call overhead),
# so CPU workloads keep generated tokens few and prompts around the boundaries.
CPU_SIZES = Sizes(
    kl_prompts=4, kl_new_tokens=8, kl_max_len=600, kl_turn1_tokens=8, top_k=5,
    tree_fanout=2, tree_depth=2, tree_new_tokens=3,
    gsm8k_n=6, gsm8k_shots=2, gsm8k_new_tokens=16,
    load_requests=6, load_new_tokens=12, session_turns=3,
)
GPU_SIZES = Sizes(
    kl_prompts=32, kl_new_tokens=128, kl_max_len=2048, kl_turn1_tokens=64, top_k=20,
    tree_fanout=4, tree_depth=3, tree_new_tokens=16,
    gsm8k_n=400, gsm8k_shots=5, gsm8k_new_tokens=384,
    load_requests=64, load_new_tokens=128, session_turns=5,
)


def on_cpu(endpoint: ServedCell) -> bool:
    return target_for(endpoint).on_cpu()


def sizes_for(endpoint: ServedCell) -> Sizes:
    return CPU_SIZES if on_cpu(endpoint) else GPU_SIZES


def exact_mode(endpoint: ServedCell) -> bool:
    """Deterministic CPU targets in float32 (the reference engine; real SGLang on CPU with
    ``--dtype float32``): cached and cold runs must give the same tokens."""
    return target_for(endpoint).exact_mode(endpoint.info)


def vocab_size(endpoint: ServedCell, default: int = 512) -> int:
    return int(endpoint.info.get("vocab_size") or default)


def grids(cell: Cell) -> tuple[int, int]:
    """(SGLang's mamba cache chunk, SGLang's decode track grid) for the cell."""
    return cell.grid.chunk, cell.grid.track_grid


def lookahead(endpoint: ServedCell) -> int:
    """1 when the server overlaps scheduling (one step in flight), else 0."""
    return target_for(endpoint).engine.lookahead(endpoint.cell, endpoint.info)


def oracle_for(endpoint: ServedCell) -> PrefixOracle:
    cell = endpoint.cell
    return PrefixOracle(
        cell.strategy,
        cell.grid.chunk,
        cell.page_size,
        cell.track_interval,
        lazy_alloc_fail=cell.fault.name == "lazy_alloc_fail",
        branching=branch_points_skipped(endpoint) is None,
    )


def branch_points_skipped(endpoint: ServedCell) -> str | None:
    """SGLang's own words when the installed release stores no Mamba state at a branch point
    on this cell (a HiCache cell on 0.5.13-0.5.16: ``probes.Features.hicache_branching_skipped``),
    so the prefix oracle owes no branch-point hit there; None on every other cell."""
    if endpoint.cell.cache_variant.name != "hicache":
        return None
    from conformance.sglang_api import probes  # deferred: the probe imports SGLang; only a HiCache cell, which only real SGLang serves, needs it

    return probes.probe().hicache_branching_skipped


def idle_deadline(endpoint: ServedCell) -> float:
    """How long to wait for idle gauges: SGLang refreshes them lazily (up to 30 s); the
    reference server at once. Once a probe of the cell has failed, later ones wait briefly."""
    if any(not p.reached for p in endpoint.extra.get("idle_probes", [])):
        return 1.0
    return target_for(endpoint).engine.idle_deadline_s


def note_idle_probe(endpoint: ServedCell, probe: IdleProbe) -> IdleProbe:
    """Keep a scenario's idle probe on the endpoint; the leaks suite judges them all."""
    endpoint.extra.setdefault("idle_probes", []).append(probe)
    return probe


def pool_tier_asked(config: pytest.Config) -> bool:
    """Whether the run asked for the pool tier itself (its target, or a ``pool`` marker
    expression): then an SGLang the pool tier cannot use fails the run instead of skipping."""
    markexpr = str(getattr(config.option, "markexpr", "") or "")
    target = getattr(config.option, "target", None)
    return bool(target and not target_for(target).serves_http()) or "pool" in markexpr.replace("(", " ").replace(")", " ").split()


def no_prefill_stores(endpoint) -> str | None:
    """Why no prefill on this server can store a Mamba state (the prefill_hit scenario then has
    nothing to hit: a skip saying so, never a pass), or None.  Read off the server's own
    ``chunked_prefill_size`` (the ``chunked_prefill = sub-chunk`` axis cell: 32 < grid 64)."""
    cell, g = endpoint.cell, endpoint.cell.grid
    info = endpoint.info or {}
    budget = int(info.get("chunked_prefill_size") or 0)
    if budget > 0 and prefill_never_tracked(StrategyGrid(g.chunk, g.page_size, g.track_interval, strategy=cell.strategy), budget):
        return (f"prefill_hit: no prefill on this server stores a Mamba state: --chunked-prefill-size {budget} is below the "
                f"checkpoint grid {g.checkpoint_grid} (SGLang warns at start that such chunks skip Mamba state checkpoints); "
                "its decode hits are compared where the suite has them")
    return None


def idle_probe(client: Any, scenario: str, **kw: Any) -> IdleProbe:
    """SGLang's idle invariant read from outside (``conformance.workloads.idle.idle_probe``),
    timed as the run's ``idle probes`` phase."""
    with phase("idle probes"):
        return idle.idle_probe(client, scenario, **kw)
