"""The pool harness over SGLang's real classes: slot counts per strategy, back to totals,
and each invariant failing on a seeded violation (and passing on the clean pools)."""

from __future__ import annotations

import pytest

from conformance.sglang_api import pool as sglang_api
from conformance.sglang_api import state_marker
from conformance.sglang_api.pool_base import cpu_pin_memory_guard
from conformance.sglang_api.pool_runtime import PoolKey
from conformance.targets.pool import invariants
from conformance.targets.pool.harness import PoolHarness, PoolSizes, StateMismatch

pytestmark = pytest.mark.pool


@pytest.fixture
def make():
    sglang_api.require()

    def build(strategy="extra_buffer", page=1, interval=256, chunk=64, fault=False, **sizes):
        h = PoolHarness(PoolKey(strategy, page, interval, chunk, fault), PoolSizes(**sizes))
        h.activate()
        return h

    return build


def _prefill(h, rid, prompt):
    run = h.admit(rid, prompt)
    while not run.prefill_done:
        h.prefill_chunk(run)
    return run


@pytest.mark.parametrize("strategy, held", [("no_buffer", 1), ("extra_buffer", 3), ("extra_buffer_lazy", 2)])
def test_slots_held_per_request_and_back_to_totals(make, strategy, held):
    h = make(strategy)
    run = _prefill(h, "A", [1] * 130)
    assert len(invariants.request_slots(h, run)) == held
    for _ in range(300):
        h.decode(run)
        invariants.check_all(h)
    h.finish(run)
    invariants.check_all(h)
    h.evict_all()
    invariants.back_to_totals(h)


def test_resolved_chunk_comes_from_the_model_config(make):
    assert make("extra_buffer", chunk=64).chunk == 64
    assert make("extra_buffer", chunk=256).chunk == 256
    h = make("extra_buffer", page=64, interval=128, chunk=128)
    assert (h.chunk, h.checkpoint_grid, h.track_grid) == (128, 128, 128)


def test_leaked_slot_fails_partition_and_sglang_checker(make):
    h = make("extra_buffer")
    h.finish(_prefill(h, "A", [1] * 70))
    invariants.check_all(h)
    h.rtp.mamba_allocator.alloc(1)  # taken by nobody
    with pytest.raises(invariants.PoolInvariantError, match=r"slot_partition.*leaked"):
        invariants.slot_partition(h)
    with pytest.raises(invariants.PoolInvariantError, match=r"sglang_checker.*memory leak detected.*\[mamba\]"):
        invariants.sglang_checker(h)


def test_wrong_state_in_tree_fails_tree_states(make):
    h = make("extra_buffer")
    h.finish(_prefill(h, "A", [1] * 70))
    (key, slot), = invariants.tree_state_keys(h).items()
    assert len(key) == 64
    state_marker.write(h.rtp.mamba_pool, slot, state_marker.marker_for(key[:-1]))
    with pytest.raises(invariants.PoolInvariantError, match="tree_states"):
        invariants.tree_states(h)


def test_lazy_request_holding_two_track_slots_fails_ping_pong(make):
    h = make("extra_buffer_lazy")
    run = _prefill(h, "A", [1] * 70)
    invariants.ping_pong(h)
    h.rtp.set_mamba_ping_pong_slot(run.req, 1, h.rtp.mamba_allocator.alloc(1)[0])
    with pytest.raises(invariants.PoolInvariantError, match="holds 2 track slots"):
        invariants.ping_pong(h)


def test_stale_cow_source_is_a_state_mismatch(make):
    h = make("no_buffer")
    h.finish(_prefill(h, "A", [1] * 70))
    run = h.admit("B", [1] * 80)
    run.req.kv.mamba_cow_src_index = None  # as if copy-on-write were skipped
    with pytest.raises(StateMismatch, match="start state"):
        h.prefill_chunk(run)


def test_missing_sglang_skips_with_the_cause(monkeypatch):
    monkeypatch.setattr(sglang_api, "_API", None)
    monkeypatch.setattr(sglang_api, "_ERROR", "sglang is not importable (ImportError: nope)")
    with pytest.raises(pytest.skip.Exception, match="pool tier needs sglang: sglang is not importable"):
        sglang_api.require()


def test_miscounted_pool_fails_counts_and_leak_fails_back_to_totals(make, monkeypatch):
    h = make("extra_buffer_lazy")
    run = _prefill(h, "A", [1] * 70)
    invariants.counts(h)
    real = h.tree.mamba_evictable_size
    monkeypatch.setattr(h.tree, "mamba_evictable_size", lambda: real() + 1)
    with pytest.raises(invariants.PoolInvariantError, match=r"counts.*\[mamba\]"):
        invariants.counts(h)
    monkeypatch.undo()
    h.finish(run)
    h.rtp.mamba_allocator.alloc(1)
    h.evict_all()
    with pytest.raises(invariants.PoolInvariantError, match="back_to_totals"):
        invariants.back_to_totals(h)


def test_pin_memory_guard_makes_pin_memory_a_noop_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present: the guard leaves pin_memory alone")
    t = torch.ones(3)
    with pytest.raises(RuntimeError):
        t.pin_memory()
    with cpu_pin_memory_guard():
        assert t.pin_memory() is t
