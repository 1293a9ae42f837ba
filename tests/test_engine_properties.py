"""Property test of the reference engine (toy model): for random workloads of batched
requests sharing prefixes, under any strategy and pool size, the idle invariant holds,
every request finishes, and while nothing was evicted cached_tokens equals the prefix
oracle's prediction for sequential requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.reference.drive import make_req, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.toy_model import load_toy

torch.set_num_threads(1)
TOY = load_toy()

stems = st.lists(st.integers(3, TOY.vocab_size - 1), min_size=1, max_size=300)
request = st.tuples(st.integers(0, 2), st.integers(0, 300), st.lists(st.integers(3, 20), min_size=1, max_size=40),
                    st.integers(1, 40))
workload = st.lists(st.lists(request, min_size=1, max_size=4), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy=st.sampled_from(["no_buffer", "extra_buffer", "extra_buffer_lazy"]),
       slots=st.integers(4, 24), track=st.sampled_from([64, 128, 256]),
       stem_list=st.lists(stems, min_size=3, max_size=3), batches=workload)
def test_random_workloads_balance_and_match_oracle(strategy, slots, track, stem_list, batches):
    eng = Engine(TOY, EngineConfig(strategy=strategy, max_mamba_slots=slots, track_interval=track,
                                   max_running_requests=4))
    oracle = PrefixOracle(strategy, chunk=eng.chunk, page_size=1, track_interval=track)
    evicted = False
    for batch in batches:
        reqs = [make_req(stem_list[s][:cut] + tail, n, logprobs=False) for s, cut, tail, n in batch]
        done = run(eng, reqs)
        assert all(r.finish_reason is not None for r in done)
        assert eng.idle_check() is None, eng.dead
        if len(batch) == 1 and not evicted:
            assert done[0].reported_cached_tokens == oracle.expected_hit(done[0].input_ids)
        for r in done:
            oracle.record_prefill(r.input_ids)
            oracle.record_finished(r.input_ids, r.output_ids)
        evicted = evicted or eng.cache.evictions > 0 or len(batch) > 1
        assert eng.mamba_pool.available() + sum(eng.cache.mamba_counts()) == slots
    assert eng.flush()
    stats = eng.stats()
    assert (stats["mamba_used"], stats["kv_used"], stats["mamba_available"]) == (0, 0, slots)


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_eviction_counter_moves_under_pressure(strategy):
    eng = Engine(TOY, EngineConfig(strategy=strategy, max_mamba_slots=4, max_running_requests=1))
    run(eng, [make_req([5 + i] * 200, 3, logprobs=False) for i in range(6)])
    assert eng.cache.evictions > 0
    assert eng.idle_check() is None
