"""The reference faults written for the request programs (``program_faults.py``): each is
shown harmful by a direct probe on the engine (no HTTP), and the clean engine shows no
harm in the same probe."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.reference.drive import make_req, output_logprobs, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.faults import FAULTS, FaultSwitch
from conformance.reference.program_faults import PROGRAM_FAULTS
from conformance.reference.toy_model import load_toy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def toy():
    return load_toy()


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _cold(toy, req_ids: list[int], n: int, **kw):
    return run(Engine(toy, EngineConfig(disable_radix_cache=True)), [make_req(req_ids, n, **kw)])[0]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(output_logprobs(a), output_logprobs(b)))


# ------------------------------------------------------------------ probes: (fault on?) -> harm
def dup_insert(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), FaultSwitch(fault))
    p = _tokens(1, 130, toy.vocab_size)
    run(eng, [make_req(p, 2), make_req(p, 2)])  # one prefill batch: both checkpoint 128
    return eng.idle_check() or ""


def split(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), FaultSwitch(fault))
    p = _tokens(2, 200, toy.vocab_size)
    run(eng, [make_req(p, 2)])  # stores P[:192]
    run(eng, [make_req(p[:100] + _tokens(3, 50, toy.vocab_size), 2)])  # splits that edge at 100
    c = p[:100] + _tokens(4, 20, toy.vocab_size)
    hot = run(eng, [make_req(c, 6)])[0]
    return hot.prefix_len, _max_diff(hot, _cold(toy, c, 6))


def logprob_start(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), FaultSwitch(fault))
    p = _tokens(5, 200, toy.vocab_size)
    run(eng, [make_req(p, 2)])
    b = p + _tokens(6, 10, toy.vocab_size)
    hot = run(eng, [make_req(b, 2, logprob_start_len=50)])[0]
    cold = _cold(toy, b, 2, logprob_start_len=50)
    diff = max(abs(x[0] - y[0]) for x, y in zip(hot.input_entries, cold.input_entries) if x[0] is not None)
    return hot.prefix_len, diff


def older_pingpong(toy, fault):
    cfg = EngineConfig(strategy="extra_buffer", track_interval=64)
    eng = Engine(toy, cfg, FaultSwitch(fault))
    a = run(eng, [make_req(_tokens(7, 10, toy.vocab_size), 2 * 64 + 3)])[0]  # crosses 64 and 128
    follow = (a.input_ids + a.output_ids)[:128] + _tokens(8, 5, toy.vocab_size)
    hot = run(eng, [make_req(follow, 6)])[0]
    return hot.prefix_len, _max_diff(hot, _cold(toy, follow, 6))


def lazy_finish_at_boundary(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="extra_buffer_lazy", track_interval=64), FaultSwitch(fault))
    run(eng, [make_req(_tokens(10, 50, toy.vocab_size), 20)])  # crosses 64 mid-decode: never leaks
    assert eng.idle_check() is None
    run(eng, [make_req(_tokens(9, 60, toy.vocab_size), 5)])  # 60 + 5 - 1 = 64: the last step crosses 64
    return eng.idle_check() or ""


def stop_finish(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="no_buffer"), FaultSwitch(fault))
    p = _tokens(11, 80, toy.vocab_size)
    free = run(eng, [make_req(p, 12)])[0]
    stop_tok = next(t for j, t in enumerate(free.output_ids) if j >= 3 and t not in free.output_ids[:j])  # stops after >= 4 tokens
    eng = Engine(toy, EngineConfig(strategy="no_buffer"), FaultSwitch(fault))
    stopped = make_req(p, 12, ignore_eos=False)
    stopped.sampling.stop_token_ids = [stop_tok]
    stopped = run(eng, [stopped])[0]
    assert stopped.finish_reason["type"] == "stop"
    follow = stopped.input_ids + stopped.output_ids + _tokens(12, 5, toy.vocab_size)
    hot = run(eng, [make_req(follow, 6)])[0]
    return hot.prefix_len, _max_diff(hot, _cold(toy, follow, 6))


def session_abort(toy, fault):
    eng = Engine(toy, EngineConfig(strategy="extra_buffer"), FaultSwitch(fault))
    sid = eng.sessions.open(None, 100_000, True, None)
    t1 = make_req(_tokens(13, 40, toy.vocab_size), 4)
    eng.sessions.prepare(t1, {"id": sid})
    run(eng, [t1])
    t2 = make_req(_tokens(14, 10, toy.vocab_size), 50)
    eng.sessions.prepare(t2, {"id": sid})
    eng.submit(t2)
    for _ in range(4):
        eng.step()
    eng.abort(t2.rid)
    t3 = make_req(_tokens(15, 5, toy.vocab_size), 2)
    eng.sessions.prepare(t3, {"id": sid})
    run(eng, [t3])
    eng.sessions.close(eng, sid)
    return len(t3.input_ids) - (len(t1.input_ids) + len(t1.output_ids) + 5)


def test_every_program_fault_is_registered_and_probed() -> None:
    assert set(PROGRAM_FAULTS) <= set(FAULTS)
    assert set(PROGRAM_FAULTS) == {"dup_insert_leak", "split_moves_snapshot", "logprob_start_ignored", "older_pingpong_inserted",
                                   "lazy_finish_at_boundary_leak", "stop_finish_key_short", "session_abort_continues"}
    assert all(len(f.description) > 60 and f.real_bug and f.observable for f in PROGRAM_FAULTS.values())


@pytest.mark.parametrize("probe, fault", [(dup_insert, "dup_insert_leak"), (lazy_finish_at_boundary, "lazy_finish_at_boundary_leak")])
def test_leak_faults_leak_and_clean_does_not(toy, probe, fault) -> None:
    assert probe(toy, fault).startswith("pool memory leak detected!")
    assert probe(toy, None) == ""


@pytest.mark.parametrize("probe, fault", [(split, "split_moves_snapshot"), (older_pingpong, "older_pingpong_inserted"),
                                          (stop_finish, "stop_finish_key_short"), (logprob_start, "logprob_start_ignored")])
def test_state_faults_diverge_from_cold_and_clean_does_not(toy, probe, fault) -> None:
    hit, diff = probe(toy, fault)
    assert hit > 0 and diff > 1e-4
    clean_hit, clean_diff = probe(toy, None)
    assert clean_diff <= 1e-5


def test_session_abort_fault_continues_the_aborted_turn(toy) -> None:
    assert session_abort(toy, "session_abort_continues") > 0  # the aborted turn's tokens are in the next prompt
    assert session_abort(toy, None) == 0  # SGLang: the last finished turn + the new input
