"""The reference engine on every real tiny twin (in process): hits equal cold runs,
cached_tokens equals the prefix oracle, and the subtle state fault is visible.  About a
minute on two cores."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.reference.drive import make_req, output_logprobs, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.faults import FaultSwitch
from conformance.reference.model import known_twins, load_twin

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=known_twins())
def twin(request):
    return load_twin(request.param)


def _workload(twin, strategy: str, faults: FaultSwitch | None = None):
    rng = random.Random(3)
    eng = Engine(twin, EngineConfig(strategy=strategy, track_interval=128), faults)
    oracle = PrefixOracle(strategy, chunk=eng.chunk, page_size=1, track_interval=128)
    stem = [rng.randrange(3, twin.vocab_size) for _ in range(260)]
    pairs, prompts, hot = [], [], []
    for i in range(4):
        prompt = stem + [rng.randrange(3, twin.vocab_size) for _ in range(10 + 7 * i)]
        if hot:
            prompt = hot[-1].input_ids + hot[-1].output_ids + prompt[-5:]
        req = run(eng, [make_req(prompt, 12)])[0]
        pairs.append((req.reported_cached_tokens, oracle.record_request(prompt, req.output_ids)))
        prompts.append(prompt)
        hot.append(req)
    cold_eng = Engine(twin, EngineConfig(strategy=strategy, disable_radix_cache=True))
    cold = run(cold_eng, [make_req(p, 12) for p in prompts])
    divergence = max(max(abs(a - b) for a, b in zip(output_logprobs(h), output_logprobs(c))) for h, c in zip(hot, cold))
    assert eng.idle_check() is None or faults is not None
    return pairs, divergence, hot, cold


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer_lazy"])
def test_twin_hits_equal_cold_and_oracle(twin, strategy):
    pairs, divergence, hot, cold = _workload(twin, strategy)
    assert all(got == want for got, want in pairs), pairs
    assert sum(got > 0 for got, _ in pairs) >= 3
    assert divergence <= 1e-5
    assert [h.output_ids for h in hot] == [c.output_ids for c in cold]


def test_twin_scaled_state_fault_is_visible(twin):
    _pairs, divergence, _hot, _cold = _workload(twin, "extra_buffer", FaultSwitch("state_scaled_1pct"))
    assert divergence > 1e-4
