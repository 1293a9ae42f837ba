"""Every seeded fault of the reference engine has its observable effect in a small
workload, and the clean engine shows none of those effects in the same workload."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError
from conformance.reference.drive import make_req, output_logprobs, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.faults import FAULT_ENV, FAULTS, LAZY_ALLOC_FAIL_ENV, FaultSwitch
from conformance.reference.program_faults import PROGRAM_FAULTS
from conformance.reference.toy_model import load_toy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def toy():
    return load_toy()


def _tokens(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


# ------------------------------------------------------------------ workloads
def hit_divergence(toy, strategy: str, faults: FaultSwitch) -> float:
    """Max |logprob(hit) - logprob(cold)| over follow-ups of a batched prefill of 3 prompts."""
    rng = random.Random(21)
    eng = Engine(toy, EngineConfig(strategy=strategy), faults)
    firsts = run(eng, [make_req(_tokens(rng, n, toy.vocab_size), 20) for n in (300, 320, 250)])
    follow_ups = []
    for r in firsts:
        follow_ups.append(r.input_ids + r.output_ids + _tokens(rng, 30, toy.vocab_size))
        follow_ups.append(r.input_ids + _tokens(rng, 40, toy.vocab_size))
    hot = [run(eng, [make_req(p, 6)])[0] for p in follow_ups]
    assert sum(r.prefix_len > 0 for r in hot) >= 4
    cold_eng = Engine(toy, EngineConfig(strategy=strategy, disable_radix_cache=True))
    cold = [run(cold_eng, [make_req(p, 6)])[0] for p in follow_ups]
    return max(max(abs(a - b) for a, b in zip(output_logprobs(h), output_logprobs(c))) for h, c in zip(hot, cold))


def leak_after_flush(eng: Engine, workload: str) -> tuple[str | None, float]:
    """(idle check message, mamba slots used at idle BEFORE the flush) after a workload.

    The flush then rebuilds the free lists as SGLang's does, hiding the leak: checked here
    so the engine can never see what SGLang would hide."""
    try:
        _leak_workload(eng, workload)
    except KitError:  # the idle check already killed the scheduler mid-workload
        assert eng.dead
    msg = eng.idle_check()
    used = eng.stats()["mamba_used"]
    if eng.is_idle():
        assert eng.flush()
        assert eng.stats()["mamba_used"] == 0 and eng.stats()["mamba_evictable"] == 0
    return msg, used


def _leak_workload(eng: Engine, workload: str) -> None:
    toy = eng.model
    rng = random.Random(5)
    if workload == "basic":
        firsts = run(eng, [make_req(_tokens(rng, n, toy.vocab_size), 20) for n in (300, 320, 250)])
        run(eng, [make_req(firsts[0].input_ids + firsts[0].output_ids + [4, 5, 6], 4)])
    elif workload == "abort":
        req = make_req(_tokens(rng, 300, toy.vocab_size), 40)
        eng.submit(req)
        eng.step()
        eng.abort(req.rid)
        eng.step()
    elif workload == "pressure":  # 8 slots, 3 per request: the third matched request cannot be scheduled
        a = _tokens(rng, 300, toy.vocab_size)
        run(eng, [make_req(a, 5)])
        run(eng, [make_req(a + _tokens(rng, 20, toy.vocab_size), 5) for _ in range(3)])


def reported_vs_oracle(toy, faults: FaultSwitch) -> list[tuple[int, int]]:
    rng = random.Random(8)
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), faults)
    oracle = PrefixOracle("extra_buffer", chunk=eng.chunk, page_size=1, track_interval=256)
    stem = _tokens(rng, 300, toy.vocab_size)
    pairs = []
    for extra in (10, 20, 30):
        req = run(eng, [make_req(stem + _tokens(rng, extra, toy.vocab_size), 5)])[0]
        pairs.append((req.reported_cached_tokens, oracle.record_request(req.input_ids, req.output_ids)))
    return pairs


# ------------------------------------------------------------------ the table
STATE_FAULTS = {
    "lazy_fail_still_inserts": ("extra_buffer_lazy", True),
    "track_boundary_early": ("extra_buffer", False),
    "track_boundary_late": ("extra_buffer", False),
    "mamba2_index_misalignment": ("extra_buffer", False),
    "cow_skipped_zero_state": ("no_buffer", False),
    "state_scaled_1pct": ("extra_buffer_lazy", False),
}
LEAK_FAULTS = {
    "pingpong_leak_on_finish": ("extra_buffer", "basic", {}),
    "lazy_slot_not_returned": ("extra_buffer_lazy", "basic", {}),
    "double_free": ("extra_buffer", "basic", {}),
    "abort_path_leak": ("no_buffer", "abort", {}),
    "sched_fail_leak": ("extra_buffer", "pressure", {"max_mamba_slots": 8, "mamba_running_cap": False}),
    "evict_running_slot": ("extra_buffer", "pressure", {"max_mamba_slots": 8, "mamba_running_cap": False}),
}
COUNT_FAULTS = ("cached_tokens_overreport", "cached_tokens_underreport")
SILENT_LEAK = "idle_check_disabled_with_leak"


def test_every_registered_fault_is_tested_and_documented():
    covered = set(STATE_FAULTS) | set(LEAK_FAULTS) | set(COUNT_FAULTS) | {SILENT_LEAK}
    assert covered == set(FAULTS) - set(PROGRAM_FAULTS)  # those are probed in test_program_faults.py
    for spec in FAULTS.values():
        assert spec.description and spec.real_bug and spec.injected_at and spec.observable


@pytest.mark.parametrize("fault", sorted(STATE_FAULTS))
def test_state_fault_makes_hits_diverge_from_cold(toy, fault):
    strategy, lazy_fail = STATE_FAULTS[fault]
    assert hit_divergence(toy, strategy, FaultSwitch(fault, lazy_alloc_fail=lazy_fail)) > 1e-4


@pytest.mark.parametrize("strategy, lazy_fail", sorted(set(STATE_FAULTS.values())))
def test_clean_engine_hits_equal_cold(toy, strategy, lazy_fail):
    assert hit_divergence(toy, strategy, FaultSwitch(None, lazy_alloc_fail=lazy_fail)) <= 1e-5


@pytest.mark.parametrize("fault", sorted(LEAK_FAULTS))
def test_leak_fault_is_caught_by_idle_check(toy, fault):
    strategy, workload, kw = LEAK_FAULTS[fault]
    eng = Engine(toy, EngineConfig(strategy=strategy, **kw), FaultSwitch(fault))
    msg, _used = leak_after_flush(eng, workload)
    assert msg is not None and msg.startswith("pool memory leak detected!")
    assert "[mamba] total=" in msg
    assert eng.dead  # strict idle check: the scheduler is dead


@pytest.mark.parametrize("strategy, workload, kw", sorted({(s, w, tuple(k.items())) for s, w, k in LEAK_FAULTS.values()}))
def test_clean_engine_has_no_leak_in_the_same_workloads(toy, strategy, workload, kw):
    eng = Engine(toy, EngineConfig(strategy=strategy, **dict(kw)))
    assert leak_after_flush(eng, workload) == (None, 0)
    assert not eng.dead


def test_silent_leak_shows_only_in_metrics(toy):
    eng = Engine(toy, EngineConfig(strategy="no_buffer"), FaultSwitch(SILENT_LEAK))
    msg, used = leak_after_flush(eng, "basic")
    assert msg is None and not eng.dead
    assert used > 0
    assert leak_after_flush(Engine(toy, EngineConfig(strategy="no_buffer")), "basic") == (None, 0)


@pytest.mark.parametrize("fault", COUNT_FAULTS)
def test_cached_tokens_faults_disagree_with_oracle(toy, fault):
    pairs = reported_vs_oracle(toy, FaultSwitch(fault))
    assert any(reported != expected for reported, expected in pairs)


def test_clean_cached_tokens_agree_with_oracle(toy):
    pairs = reported_vs_oracle(toy, FaultSwitch())
    assert all(reported == expected for reported, expected in pairs)
    assert pairs[-1][1] == 256


def test_fault_switch_reads_env_and_rejects_unknown_names():
    sw = FaultSwitch.from_env({FAULT_ENV: "double_free", LAZY_ALLOC_FAIL_ENV: "1"})
    assert sw.active("double_free") and not sw.active("abort_path_leak") and sw.lazy_alloc_fail
    assert FaultSwitch.from_env({}).name is None
    with pytest.raises(KitError, match="unknown fault"):
        FaultSwitch.from_env({FAULT_ENV: "nope"})


@pytest.mark.parametrize("fault", [None, "pingpong_leak_on_finish"])
def test_streaming_session_close_path_pr26941(toy, fault):
    """The PR 26941 path: ping-pong slots moved to a streaming session and on to the next
    turn must all come back at close."""
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), FaultSwitch(fault))
    sid = eng.sessions.open(None, 10_000, True, None)
    for n in (120, 20):
        req = make_req([5 + n % 7] * n, 6)
        eng.sessions.prepare(req, {"id": sid})
        try:
            run(eng, [req])
        except KitError:
            break
    eng.sessions.close(eng, sid)
    eng.step()  # the idle check after the close
    if fault:
        assert eng.dead and "[mamba]" in eng.dead
    else:
        assert not eng.dead and eng.flush() and eng.stats()["mamba_used"] == 0
