"""Runners on responses recorded from real SGLang on CPU (tests/data/checks/, replayed
through the real runner code; recorded by ``python tests/data/record_checks.py``) and live
against the in-process fake server.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from conformance.checks.kl import kl_verdict
from conformance.checks.leaks import leak_verdict
from conformance.recordings import OccupancySample
from conformance.checks.prefix_branching import prefix_branching_verdict
from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError
from conformance.workloads.prompts import decode_cross_lengths, prefill_hit_lengths, token_prompts
from conformance.workloads.idle import idle_probe
from conformance.workloads.runners import record_kl, record_sessions, record_tree, sample_occupancy
from conformance.workloads.sessions import first_turn_abort_script, leak_session_scripts
from conformance.workloads.trees import branching_tree
from test_workloads_fake_server import DATA, FakeSGLang, Replayer

sys.path.insert(0, str(Path(__file__).parent / "data"))
import record_checks as rc  # noqa: E402  (tests/data/record_checks.py: the recorded workloads)

CHUNK, TRACK, VOCAB = 16, 32, 48


def kl_prompts():
    return token_prompts(prefill_hit_lengths(CHUNK, TRACK, n=4, min_len=20, max_len=70), vocab_size=VOCAB)


def small_tree():
    return branching_tree(chunk=CHUNK, track_interval=TRACK, vocab_size=VOCAB, max_new_tokens=3)


def _kl(client):
    return record_kl(client, kl_prompts(), vocab_size=VOCAB, new_tokens=6, top_k=4)


# ------------------------------------------------------------------ recorded on real SGLang
# tests/data/record_checks.py recorded these from the sglang-cpu target (SGLang's own server,
# scheduler, radix cache and pools; MANIFEST.json names the version); they replay through
# the same runner code, so cached_tokens and logprobs are SGLang's, judged by the kit.
def _replay(name: str) -> Replayer:
    return Replayer(rc.load(name))


def _hit_sequences_shifted(rec, delta: float):
    """A seeded hit fault on real data: on every sequence that hit the cache, move
    probability between the served top-k alternatives (not the chosen token), so the chosen
    token's logprob -- all SGLang's k3 estimator sees -- stays as SGLang served it."""
    seqs = []
    for s in rec.sequences:
        if s.cached_tokens > 0:
            tops = tuple(((t[0][0], t[0][1]), (t[1][0], t[1][1] + delta), (t[2][0], t[2][1] - 4 * delta), *t[3:]) for t in s.served.top)
            s = dataclasses.replace(s, served=dataclasses.replace(s.served, top=tops))
        seqs.append(s)
    return dataclasses.replace(rec, sequences=tuple(seqs))


def test_recordings_name_the_sglang_that_recorded_them():
    m = rc.manifest()
    assert m["target"] == "sglang-cpu" and m["cell"] == rc.CELL_ID and m["sglang_version"]
    assert set(m["recordings"]) == set(rc.RECORDINGS) and all((DATA / n).exists() for n in rc.RECORDINGS)
    assert {s["dtype"] for s in m["servers"].values()} == {"float32", "bfloat16"}


def test_real_sglang_fp32_prefill_hits_pass_exact_mode_at_the_chunk_floor():
    rec = rc.record_kl(_replay("kl_prefill_hit_fp32.json.gz"), "prefill_hit")
    v = kl_verdict(rec, chunk=rc.CHUNK, track_interval=rc.TRACK, exact=True)
    assert v.status == "pass", v.reason
    assert v.metrics["hit_fraction"] == 1.0 and v.metrics["tokens"] == rc.KL["n"] * rc.KL["new_tokens"]
    # SGLang's hit on the warmed prompt: its length floored to the 64-token chunk
    assert [s.cached_tokens for s in rec.sequences] == [len(p) // rc.CHUNK * rc.CHUNK for p in rc.kl_prompts("prefill_hit")]


def test_a_seeded_hit_fault_on_real_sglang_data_fails_and_k3_alone_misses_it():
    rec = _hit_sequences_shifted(rc.record_kl(_replay("kl_prefill_hit_fp32.json.gz"), "prefill_hit"), 0.05)
    v = kl_verdict(rec, chunk=rc.CHUNK, track_interval=rc.TRACK, exact=True)
    assert v.status == "fail" and "top-k KL" in v.reason
    assert v.metrics["k3_mean"] < 0.002  # SGLang's estimator at its own threshold passes this


@pytest.mark.parametrize("name,scenario", [("kl_prefill_hit_bf16.json.gz", "prefill_hit"), ("kl_decode_hit_bf16.json.gz", "decode_hit")])
def test_real_sglang_bf16_passes_against_the_cold_path_floor_not_against_a_rerun(name, scenario):
    from conformance.checks.kl import MIN_LIMIT

    rec = rc.record_kl(_replay(name), scenario)
    v = kl_verdict(rec, chunk=rc.CHUNK, track_interval=rc.TRACK, exact=False)
    assert v.status == "pass", v.reason
    assert v.metrics["topk_kl_seq_max"] > 1e-5  # bfloat16: the served tokens do wobble
    assert v.metrics["noise_floor"] > 0 and v.metrics["topk_limit"] >= MIN_LIMIT
    # the old floor, a rerun of the deterministic reference, is exactly 0: the same healthy
    # server would fail under it with its old 1e-6 minimum
    rerun = dataclasses.replace(rec, sequences=tuple(dataclasses.replace(s, floor=s.reference, floor_prefill=None) for s in rec.sequences))
    old = kl_verdict(rerun, chunk=rc.CHUNK, track_interval=rc.TRACK, exact=False, min_limit=1e-6)
    assert old.status == "fail" and old.metrics["noise_floor"] == 0.0
    # a hit fault that moves the distribution well past the bf16 noise still fails
    bad = kl_verdict(_hit_sequences_shifted(rec, 0.5), chunk=rc.CHUNK, track_interval=rc.TRACK, exact=False)
    assert bad.status == "fail" and "top-k KL" in bad.reason


def _tree_oracle(strategy: str) -> tuple[PrefixOracle, dict]:
    server = rc.manifest()["servers"]["float32"]
    kw = dict(lookahead=0 if server["disable_overlap_schedule"] else 1, chunked_prefill_size=server["chunked_prefill_size"], exact=True)
    return PrefixOracle(strategy, rc.CHUNK, 1, rc.TRACK), kw


def test_real_sglang_tree_matches_the_oracle_and_a_wrong_oracle_or_output_fails():
    oracle, kw = _tree_oracle("extra_buffer")
    rec = rc.record_tree(_replay("tree_fp32.json.gz"))
    v = prefix_branching_verdict(rec, oracle, **kw)
    assert v.status == "pass", v.reason
    assert v.metrics["hits_expected"] == v.metrics["hits_observed"] > 0
    wrong, kw = _tree_oracle("no_buffer")
    v = prefix_branching_verdict(rec, wrong, **kw)
    assert v.status == "fail" and v.metrics["hit_mismatches"] > 0
    # a seeded output fault: the first request served on a hit answers another token
    calls = rc.load("tree_fp32.json.gz")
    hit = next(c for c in calls if c["method"] == "generate" and c["response"][0]["meta_info"]["cached_tokens"] > 0)
    hit["response"][0]["output_ids"][0] += 1
    bad = rc.record_tree(Replayer(calls))
    v = prefix_branching_verdict(bad, oracle, **kw)
    assert v.status == "fail" and "differs from the cold output" in v.reason


# ------------------------------------------------------------------ live against the fake
def test_record_kl_decode_hit_hits_the_decode_track():
    prompts = token_prompts(decode_cross_lengths(TRACK, 6, n=3, min_len=20, max_len=70), vocab_size=VOCAB, seed=1)
    rec = record_kl(FakeSGLang(), prompts, scenario="decode_hit", new_tokens=6, turn1_tokens=6, vocab_size=VOCAB, top_k=4)
    assert all(s.cached_tokens > len(p) // CHUNK * CHUNK for s, p in zip(rec.sequences, prompts) if len(p) % TRACK > TRACK - 6)
    assert kl_verdict(rec, chunk=CHUNK, track_interval=TRACK, exact=True).status == "pass"


def test_record_kl_asks_for_reasoning_only_in_decode_hit_turn_one():
    """A strip-thinking cell (``reasoning=True``): only turn one of ``decode_hit`` carries
    SGLang's ``require_reasoning`` (the request whose output is thinking); the served turn,
    the cold half and every request of a cell without reasoning never do."""

    class Recording(FakeSGLang):
        def __init__(self) -> None:
            super().__init__()
            self.bodies: list[dict] = []

        def generate(self, payload, *, timeout=None):
            self.bodies.append(payload)
            return super().generate(payload, timeout=timeout)

    prompts = token_prompts(decode_cross_lengths(TRACK, 6, n=3, min_len=20, max_len=70), vocab_size=VOCAB, seed=1)
    asked = []
    for reasoning in (True, False):
        client = Recording()
        record_kl(client, prompts, scenario="decode_hit", new_tokens=6, turn1_tokens=6, vocab_size=VOCAB, top_k=4, reasoning=reasoning)
        asked.append([bool(b.get("require_reasoning")) for b in client.bodies])
    assert asked[0][0] and not any(asked[0][1:]) and len(asked[0]) > 2, asked[0]
    assert not any(asked[1]), asked[1]


def test_record_kl_on_a_cache_less_server_skips_never_passes():
    rec = _kl(FakeSGLang(cache=False))
    v = kl_verdict(rec, chunk=CHUNK, track_interval=TRACK)
    assert v.status == "skip" and "disabled" in v.reason


def test_record_kl_rejects_unknown_scenario():
    with pytest.raises(KitError, match="unknown scenario"):
        record_kl(FakeSGLang(), kl_prompts(), vocab_size=VOCAB, scenario="warm")


def test_record_tree_against_wrong_strategy_oracle_reports_hit_mismatches():
    rec = record_tree(FakeSGLang(strategy="no_buffer"), small_tree())
    v = prefix_branching_verdict(rec, PrefixOracle("extra_buffer", CHUNK, 1, TRACK), exact=True)
    assert v.status == "fail" and v.metrics["hit_mismatches"] > 0 and "expected" in v.reason


def test_sessions_and_idle_probe_clean_then_leaking():
    streaming, plain = leak_session_scripts(vocab_size=VOCAB, track_interval=TRACK, new_tokens=4, abort_new_tokens=400, abort_after_s=0.05)
    first = first_turn_abort_script(vocab_size=VOCAB, track_interval=TRACK, new_tokens=4, abort_new_tokens=400, abort_after_s=0.05)
    for leak, want in ((0, "pass"), (3, "fail")):
        fake = FakeSGLang(step_s=0.001, leak_per_session=leak)
        timeline, rec = sample_occupancy(fake, lambda: record_sessions(fake, [streaming, plain, first], timeout=10), interval_s=0.002)
        assert [(t.finish, t.decoding_seen) for t in rec.turns].count(("abort", True)) == 3
        assert not rec.errors
        probe = idle_probe(fake, "sessions", requests=rec.requests, deadline_s=0.05)
        v = leak_verdict([probe], timeline=timeline)
        assert v.status == want, v.reason
    assert v.metrics["mamba_used_at_idle"] == 9  # 3 per session, three sessions
    # the leak was read before the flush; the flush (SGLang's semantics) hid it afterwards
    assert probe.after_flush["sglang:mamba_used_tokens"] == 0 and "leaked" in v.reason


def test_sample_occupancy_sees_load_and_returns_the_result():
    fake = FakeSGLang(step_s=0.002)
    timeline, out = sample_occupancy(fake, lambda: fake.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40}}), interval_s=0.002)
    assert len(out["output_ids"]) == 40
    assert max(s.values["sglang:mamba_used_tokens"] for s in timeline) > 0
    assert isinstance(timeline[0], OccupancySample)


class _SleepingScheduler:
    """A server whose idle publish sequence advances only when something reaches its scheduler
    (SGLang's --sleep-on-idle: metrics scrapes do not wake it, /server_info does)."""

    def __init__(self) -> None:
        self.seq, self.woken = 0.0, 0

    def metrics(self) -> dict[str, float]:
        return {"hybrid_conformance:idle_publish_seq": self.seq, "sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0}

    def server_info(self) -> dict:
        self.woken += 1
        self.seq += 1
        return {}


def test_an_idle_probe_wakes_a_sleeping_scheduler_for_a_fresh_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.workloads import idle

    server = _SleepingScheduler()
    values, fresh, waited = idle._fresh_idle_sample(server, 2.0, lambda v: [])
    assert fresh and server.woken >= 1 and waited < 1.0
    monkeypatch.setattr(idle, "WAKE", False)
    asleep = _SleepingScheduler()
    values, fresh, waited = idle._fresh_idle_sample(asleep, 0.3, lambda v: [])
    assert not fresh and asleep.woken == 0 and waited >= 0.3


def test_a_client_that_takes_no_batch_gets_one_request_per_prompt_in_order():
    """``sglang_router`` (PD) answers a batched /generate with HTTP 422: such a client gets
    each prompt as its own request, all in flight together, answers in prompt order."""
    from conformance.workloads.runners import generate_tokens

    class OneAtATime:
        batches = False

        def __init__(self) -> None:
            self.bodies = []

        def generate(self, payload, timeout=None):
            assert isinstance(payload["sampling_params"], dict), "a batched body reached a client that takes none"
            self.bodies.append(payload)
            ids = payload["input_ids"]
            return {"output_ids": [ids[-1]] * payload["sampling_params"]["max_new_tokens"], "meta_info": {"prompt": len(ids)}}

    client = OneAtATime()
    out = generate_tokens(client, [[5, 6, 7], [8], [9, 10]], [2, 1, 3])
    assert [r["meta_info"]["prompt"] for r in out] == [3, 1, 2] and [r["output_ids"] for r in out] == [[7, 7], [8], [10, 10, 10]]
    assert len(client.bodies) == 3
    client.batches = True  # a client that takes batches still gets one batched body
    with pytest.raises(AssertionError, match="batched body"):
        generate_tokens(client, [[5, 6, 7], [8]], 1)
