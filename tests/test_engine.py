"""Reference engine on the toy model: cache hits equal cold runs, cached_tokens equals the
prefix oracle, pools balance at idle, strategies account slots as SGLang does."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError
from conformance.reference.drive import make_req, output_logprobs, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.faults import FaultSwitch
from conformance.reference.toy_model import load_toy

torch.set_num_threads(1)
STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")


@pytest.fixture(scope="module")
def toy():
    return load_toy()


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine(toy, strategy, **kw) -> Engine:
    faults = kw.pop("faults", None)
    return Engine(toy, EngineConfig(strategy=strategy, **kw), faults)


def assert_idle_clean(eng: Engine) -> None:
    assert eng.idle_check() is None
    assert eng.flush()
    stats = eng.stats()
    assert (stats["mamba_used"], stats["kv_used"], stats["mamba_evictable"]) == (0, 0, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hit_matches_cold_run(toy, strategy):
    rng = random.Random(1)
    prompt = tokens(rng, 300, toy.vocab_size)
    eng = engine(toy, strategy)
    first = run(eng, [make_req(prompt, 8)])[0]
    follow = prompt + first.output_ids + tokens(rng, 20, toy.vocab_size)
    hit = run(eng, [make_req(follow, 8, logprob_start_len=len(follow) - 5)])[0]
    cold = run(engine(toy, strategy, disable_radix_cache=True), [make_req(follow, 8, logprob_start_len=len(follow) - 5)])[0]
    assert first.prefix_len == 0 and hit.reported_cached_tokens > 0
    assert hit.output_ids == cold.output_ids
    assert output_logprobs(hit) == pytest.approx(output_logprobs(cold), abs=1e-5)
    assert [e[0] for e in hit.input_entries] == pytest.approx([e[0] for e in cold.input_entries], abs=1e-5)
    assert_idle_clean(eng)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_cached_tokens_agree_with_prefix_oracle(toy, strategy, seed):
    rng = random.Random(seed)
    eng = engine(toy, strategy, track_interval=128)
    oracle = PrefixOracle(strategy, chunk=eng.chunk, page_size=1, track_interval=128)
    stems = [tokens(rng, rng.randrange(60, 400), toy.vocab_size) for _ in range(3)]
    history: list[list[int]] = []
    for _ in range(12):
        kind = rng.random()
        if history and kind < 0.4:  # continue an earlier sequence (multi-turn)
            prompt = rng.choice(history) + tokens(rng, rng.randrange(1, 150), toy.vocab_size)
        else:  # branch off a stem
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + tokens(rng, rng.randrange(1, 100), toy.vocab_size)
        req = run(eng, [make_req(prompt, rng.randrange(1, 200), logprobs=False)])[0]
        expected = oracle.record_request(prompt, req.output_ids)
        assert req.reported_cached_tokens == expected, (prompt[:5], len(prompt))
        history.append(prompt + req.output_ids)
    assert_idle_clean(eng)


def test_branching_scenario_like_sglang(toy):
    """SGLang's own prefix-branching scenario: "hi"*257 + three suffixes."""
    stem = toy.tokenizer.encode("hi" * 257)
    for strategy in STRATEGIES:
        eng = engine(toy, strategy)
        oracle = PrefixOracle(strategy, chunk=eng.chunk, page_size=1, track_interval=256)
        got, want = [], []
        for suffix in ("a", "b", "c"):
            req = run(eng, [make_req(stem + toy.tokenizer.encode(suffix), 4, logprobs=False)])[0]
            got.append(req.reported_cached_tokens)
            want.append(oracle.record_request(req.input_ids, req.output_ids))
        assert got == want
        assert got[2] == (len(stem) // 64 * 64 if strategy != "no_buffer" else 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_concurrent_shared_prefix_requests_match_cold_and_leave_no_leak(toy, strategy):
    rng = random.Random(7)
    stem = tokens(rng, 200, toy.vocab_size)
    prompts = [stem + tokens(rng, rng.randrange(10, 150), toy.vocab_size) for _ in range(32)]
    eng = engine(toy, strategy, max_mamba_slots=40, max_running_requests=12)
    run(eng, [make_req(stem, 3)])  # seed the cache: a checkpoint at the stem (its grid floor)
    hot = run(eng, [make_req(p, 6) for p in prompts])
    cold_eng = engine(toy, strategy, disable_radix_cache=True, max_mamba_slots=200)
    cold = run(cold_eng, [make_req(p, 6) for p in prompts])
    assert sum(r.prefix_len > 0 for r in hot) >= 16
    for h, c in zip(hot, cold):
        assert h.output_ids == c.output_ids
        assert output_logprobs(h) == pytest.approx(output_logprobs(c), abs=1e-5)
    assert eng.stats()["num_running_reqs"] == 0
    assert_idle_clean(eng)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eviction_under_mamba_pressure_keeps_pools_balanced(toy, strategy):
    rng = random.Random(3)
    eng = engine(toy, strategy, max_mamba_slots=8, max_running_requests=4)
    prompts = [tokens(rng, rng.randrange(100, 300), toy.vocab_size) for _ in range(10)]
    out = run(eng, [make_req(p, 5, logprobs=False) for p in prompts])
    assert all(r.finish_reason["type"] == "length" for r in out)
    assert eng.mamba_pool.available() + sum(eng.cache.mamba_counts()) == 8
    assert_idle_clean(eng)


def test_lazy_holds_about_half_the_pingpong_slots(toy):
    rng = random.Random(5)
    prompts = [tokens(rng, 240, toy.vocab_size) for _ in range(6)]
    peaks = {}
    for strategy in ("extra_buffer", "extra_buffer_lazy"):
        eng = engine(toy, strategy)
        run(eng, [make_req(p, 30, logprobs=False) for p in prompts])
        peaks[strategy] = eng.stats()["pingpong_peak"]
        assert_idle_clean(eng)
    assert peaks["extra_buffer"] == 12
    assert peaks["extra_buffer_lazy"] <= peaks["extra_buffer"] // 2 + len(prompts) // 2


def test_lazy_alloc_fail_keeps_outputs_and_hits_and_leaks_nothing(toy):
    rng = random.Random(9)
    prompt = tokens(rng, 250, toy.vocab_size)
    results = {}
    for fail in (False, True):
        eng = engine(toy, "extra_buffer_lazy", faults=FaultSwitch(None, lazy_alloc_fail=fail))
        first = run(eng, [make_req(prompt, 20)])[0]
        follow = run(eng, [make_req(prompt + first.output_ids + [7, 8, 9], 5)])[0]
        results[fail] = (first.output_ids, follow.output_ids, follow.prefix_len, output_logprobs(follow))
        assert_idle_clean(eng)
    assert results[True][:3] == results[False][:3] and results[False][2] == 256
    assert results[True][3] == pytest.approx(results[False][3], abs=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streaming_session_moves_state_and_frees_it_at_close(toy, strategy):
    rng = random.Random(11)
    eng = engine(toy, strategy)
    sid = eng.sessions.open(None, 10_000, True, None)
    turn1 = make_req(tokens(rng, 120, toy.vocab_size), 6)
    eng.sessions.prepare(turn1, {"id": sid})
    run(eng, [turn1])
    mamba = eng.pool_checks()[0]
    assert mamba.session_held == 1 + {"no_buffer": 0, "extra_buffer": 2, "extra_buffer_lazy": 1}[strategy]
    assert not mamba.leak
    turn2 = make_req(tokens(rng, 30, toy.vocab_size), 6)
    eng.sessions.prepare(turn2, {"id": sid})
    run(eng, [turn2])
    assert turn2.reported_cached_tokens == 120 + 6 - 1
    cold = run(engine(toy, strategy, disable_radix_cache=True), [make_req(turn2.input_ids, 6)])[0]
    assert output_logprobs(turn2) == pytest.approx(output_logprobs(cold), abs=1e-5)
    assert eng.sessions.close(eng, sid)
    assert eng.pool_checks()[0].session_held == 0
    assert_idle_clean(eng)


def test_session_timeout_releases_slots(toy):
    eng = engine(toy, "extra_buffer")
    sid = eng.sessions.open(None, 1000, True, 0.01)
    req = make_req([5] * 50, 3)
    eng.sessions.prepare(req, {"id": sid})
    run(eng, [req])
    import time

    time.sleep(0.05)
    eng.step()
    assert sid not in eng.sessions.sessions
    assert_idle_clean(eng)


def test_abort_mid_flight_releases_everything(toy):
    eng = engine(toy, "extra_buffer")
    req = make_req([4] * 300, 50)
    eng.submit(req)
    eng.step()
    assert eng.abort(req.rid)
    assert req.finish_reason["type"] == "abort"
    assert_idle_clean(eng)


def test_request_too_large_for_pools_is_aborted_not_stuck(toy):
    eng = engine(toy, "extra_buffer", kv_tokens=100)
    req = run(eng, [make_req([4] * 300, 5)])[0]
    assert req.finish_reason["type"] == "abort" and "does not fit" in req.error
    assert_idle_clean(eng)


@pytest.mark.parametrize("kw, message", [
    ({"strategy": "bogus"}, "unknown strategy"),
    ({"strategy": "no_buffer", "page_size": 16}, "no_buffer requires --page-size 1"),
    ({"strategy": "extra_buffer", "page_size": 64, "track_interval": 100}, "track_interval % page_size"),
    ({"strategy": "extra_buffer", "page_size": 48, "track_interval": 96}, "divide one another"),
])
def test_refused_configurations(toy, kw, message):
    with pytest.raises(KitError, match=message):
        Engine(toy, EngineConfig(**kw))


def test_large_page_hits_stay_on_the_grid(toy):
    rng = random.Random(2)
    eng = engine(toy, "extra_buffer", page_size=128, track_interval=256)
    oracle = PrefixOracle("extra_buffer", chunk=eng.chunk, page_size=128, track_interval=256)
    prompt = tokens(rng, 400, toy.vocab_size)
    for _ in range(2):
        req = run(eng, [make_req(prompt + tokens(rng, 30, toy.vocab_size), 10, logprobs=False)])[0]
        assert req.reported_cached_tokens == oracle.record_request(req.input_ids, req.output_ids)
    assert req.reported_cached_tokens == 384
    assert_idle_clean(eng)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_radix_cache_never_hits_and_balances(toy, strategy):
    eng = engine(toy, strategy, disable_radix_cache=True)
    prompt = [9] * 300
    reqs = run(eng, [make_req(prompt, 4) for _ in range(3)]) + run(eng, [make_req(prompt, 4)])
    assert [r.reported_cached_tokens for r in reqs] == [0, 0, 0, 0]
    assert eng.stats()["mamba_evictable"] == 0
    assert_idle_clean(eng)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_burst_wider_than_the_mamba_pool_stores_every_members_checkpoint(toy, strategy):
    """SGLang caps running requests by the Mamba pool (max_mamba_cache_size // (3 + tracking
    slots)), so a burst's prefill checkpoints always find a slot: every member's grid-aligned
    prompt is stored.  Without the cap, 26 members on 64 slots left some unstored with no
    eviction counted (lazy: 8 of 26; a lazy burst program the oracle rightly failed)."""
    rng = random.Random(3)
    eng = engine(toy, strategy, max_mamba_slots=64, max_running_requests=48, track_interval=128)
    members = [tokens(rng, eng.checkpoint_grid * 2, toy.vocab_size) for _ in range(26)]
    done = run(eng, [make_req(m, 6, logprobs=False) for m in members])
    assert len(done) == 26 and eng.req_pool.size < 26
    assert eng.cache.evictions == 0
    stored = [eng.cache.match(m, len(m)).hit_len for m in members]
    assert stored == [len(members[0])] * 26, stored
    assert_idle_clean(eng)
