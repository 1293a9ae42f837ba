"""Pool tier suite: the installed SGLang's real Mamba memory management, on CPU, per cell.

Per cell (the plugin parametrises ``cell`` over the selected matrix): the hypothesis state
machine (``conformance.targets.pool.machine``) and the deterministic scenarios
(``conformance.targets.pool.scenarios``).  Cells that are identical for the pool
(strategy, page size, track interval, chunk size, fault) run once; the others reuse the
outcome.  ``test_pool_machine_coverage`` adds the page-64 and track-interval-128 pool keys
whatever tier is selected, so every run covers both page sizes and a non-default interval.
The driver that fits the installed release is chosen by feature probes
(``conformance.sglang_api``); the probe's one line is in the report header.  A cell or
scenario the release cannot run is skipped as ``n/a: <the release's own reason>`` (not a
pass, not a failure); without a usable sglang every test skips naming the cause, and fails
naming it when the pool tier was asked for explicitly (``--target pool``, ``-m pool``).
"""

from __future__ import annotations

from typing import Callable

import pytest

from conformance.matrix.cells import load_matrix
from conformance.sglang_api import pool as sglang_pool
from conformance.sglang_api.pool_driver import NotApplicable
from conformance.sglang_api.pool_runtime import PoolKey
from conformance.session.suite_support import pool_tier_asked
from conformance.targets.pool.scenarios import SCENARIOS, not_applicable, run_machine

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
    except NotApplicable as e:
        _OUTCOMES[slot] = pytest.skip.Exception(f"n/a: {e}")
        pytest.skip(f"n/a: {e}")
    except BaseException as e:
        _OUTCOMES[slot] = e
        raise
    _OUTCOMES[slot] = None


def _key(cell, request) -> PoolKey:
    api = sglang_pool.require(pool_tier_asked(request.config))
    key = PoolKey.from_cell(cell)
    reason = api.driver.gap(api, key)
    if reason:
        pytest.skip(f"n/a: {reason}")
    return key


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


def test_pool_machine(cell, request):
    key = _key(cell, request)
    _once("machine", key, lambda: run_machine(key))


@pytest.mark.parametrize("cell", _coverage_cells())
def test_pool_machine_coverage(cell, request):
    key = _key(cell, request)
    _once("machine", key, lambda: run_machine(key))


def _scenario_names() -> list[str]:
    return list(SCENARIOS)


@pytest.mark.parametrize("scenario", _scenario_names())
def test_pool_scenario(cell, scenario, request):
    key = _key(cell, request)
    reason = not_applicable(scenario, key)
    if reason:
        pytest.skip(f"n/a: {reason}" if "applies to" not in reason else reason)
    run, _strategies = SCENARIOS[scenario]
    _once(scenario, key, lambda: run(key))

