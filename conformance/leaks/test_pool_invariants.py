"""Pool tier suite: SGLang 0.5.23's real Mamba memory management, on CPU, per cell.

Per cell (the plugin parametrises ``cell`` over the selected matrix): the hypothesis state
machine (``conformance.targets.pool.machine``) and the deterministic scenarios
(``conformance.targets.pool.scenarios``).  Cells that are identical for the pool
(strategy, page size, track interval, chunk size, fault) run once; the others reuse the
outcome.  ``test_pool_machine_coverage`` adds the page-64 and track-interval-128 pool keys
whatever tier is selected, so every run covers both page sizes and a non-default interval.
Without sglang every test here skips naming the cause (never a silent pass).
"""

from __future__ import annotations

from typing import Callable

import pytest

from conformance.matrix import load_matrix
from conformance.targets.pool import sglang_api
from conformance.targets.pool.runtime import PoolKey

pytestmark = pytest.mark.pool

_OUTCOMES: dict[tuple[str, PoolKey], BaseException | None] = {}


def _once(what: str, key: PoolKey, run: Callable[[], None]) -> None:
    """Run ``run`` once per (what, pool key); replay the same outcome for duplicate cells."""
    slot = (what, key)
    if slot in _OUTCOMES:
        if _OUTCOMES[slot] is not None:
            raise _OUTCOMES[slot]
        return
    try:
        run()
    except BaseException as e:
        _OUTCOMES[slot] = e
        raise
    _OUTCOMES[slot] = None


def _key(cell) -> PoolKey:
    sglang_api.require()
    return PoolKey.from_cell(cell)


def _coverage_cells() -> list:
    """One cell per (strategy, page 64 | interval 128) key, spread over the chunk sizes."""
    picked, seen = [], set()
    cells = [c for c in load_matrix().select(target="pool") if c.page_size != 1 or c.track_interval != 256]
    chunks = sorted({c.model.mamba_chunk_size for c in cells})
    for i, c in enumerate(sorted(cells, key=lambda c: (c.strategy.name, c.page_size, c.track_interval))):
        group = (c.strategy.name, c.page_size, c.track_interval)
        if group in seen or c.model.mamba_chunk_size != chunks[len(seen) % len(chunks)]:
            continue
        seen.add(group)
        picked.append(pytest.param(c, id=c.id, marks=[getattr(pytest.mark, m) for m in c.markers]))
    return picked


def test_pool_machine(cell):
    from conformance.targets.pool.scenarios import run_machine

    key = _key(cell)
    _once("machine", key, lambda: run_machine(key))


@pytest.mark.parametrize("cell", _coverage_cells())
def test_pool_machine_coverage(cell):
    from conformance.targets.pool.scenarios import run_machine

    key = _key(cell)
    _once("machine", key, lambda: run_machine(key))


@pytest.mark.parametrize(
    "scenario",
    ["branch_at_chunk_boundary", "session_reuse", "lazy_boundary_full_pool", "refused_after_match", "lazy_alloc_fail_effects"],
)
def test_pool_scenario(cell, scenario):
    from conformance.targets.pool.scenarios import SCENARIOS

    key = _key(cell)
    run, strategies = SCENARIOS[scenario]
    if key.strategy not in strategies:
        pytest.skip(f"scenario {scenario} applies to {', '.join(strategies)} only")
    _once(scenario, key, lambda: run(key))
