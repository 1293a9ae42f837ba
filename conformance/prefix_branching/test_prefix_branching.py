"""Prefix-branching suite: generated trees (branch points at, one before and one after chunk
and track boundaries; concurrent siblings; eviction pressure); observed ``cached_tokens``
against the prefix oracle, and outputs on a hit against cold outputs.
"""

from __future__ import annotations

import pytest

from conformance.checks.prefix_branching import prefix_branching_verdict
from conformance.suites import exact_mode, grids, lookahead, oracle_for, settle, sizes_for, vocab_size
from conformance.workloads.runners import record_tree
from conformance.workloads.trees import branching_tree

pytestmark = pytest.mark.prefix_branching

SHAPES = {
    "sequential": dict(concurrent=False),
    "concurrent_then_eviction_pressure": dict(concurrent=True),
}


def _pressure(endpoint, shape: str, chunk: int) -> dict:
    """Enough short filler prompts to overflow the mamba pool (each stores one state)."""
    if shape == "sequential":
        return dict(pressure=0)
    slots = int(endpoint.info.get("max_mamba_cache_size") or 64)
    return dict(pressure=min(slots + 8, 160), pressure_len=chunk + 2)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_branching_tree(endpoint, shape, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    chunk, grid = grids(cell)
    tree = branching_tree(
        chunk=chunk,
        track_interval=grid,
        vocab_size=vocab_size(endpoint),
        fanout=size.tree_fanout,
        depth=size.tree_depth,
        max_new_tokens=size.tree_new_tokens,
        seed=len(shape),
        **SHAPES[shape],
        **_pressure(endpoint, shape, chunk),
    )
    recording = record_tree(endpoint.client, tree, top_k=0 if exact_mode(endpoint) else size.top_k)
    verdict = prefix_branching_verdict(
        recording,
        oracle_for(endpoint),
        lookahead=lookahead(endpoint),
        chunked_prefill_size=endpoint.info.get("chunked_prefill_size") or None,
        exact=exact_mode(endpoint),
        kl_cap=cell.model.thresholds.kl_abs_cap,
    )
    settle(record_verdict(verdict))
