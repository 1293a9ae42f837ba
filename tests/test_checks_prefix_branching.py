"""Prefix-branching check on hand-built tree recordings (SGLang's own scenario and more)."""

from __future__ import annotations

import pytest

from conformance.checks.prefix_branching import prefix_branching_verdict
from conformance.recordings import TreeRecording, TreeRequestRecord
from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError

CHUNK, TRACK = 64, 256
PREFIX = tuple([7] * 257)
OUT = (1, 2, 3)


def req(path: str, suffix_tok: int, cached: int, group: int, **kw) -> TreeRequestRecord:
    kw.setdefault("cold_output", OUT)
    return TreeRequestRecord(path, PREFIX + (suffix_tok,) * 80, kw.pop("output", OUT), cached, group, **kw)


def oracle() -> PrefixOracle:
    return PrefixOracle("extra_buffer", CHUNK, 1, TRACK)


def sglang_scenario(third: int, **kw) -> TreeRecording:
    return TreeRecording((req("b257/0", 11, 0, 0, flushed_before=True), req("b257/1", 12, 0, 1), req("b257/2", 13, third, 2, **kw)))


def test_sglangs_three_request_scenario_passes_with_contract_metrics():
    v = prefix_branching_verdict(sglang_scenario(256), oracle())
    assert v.status == "pass", v.reason
    assert {"requests", "hits_expected", "hits_observed", "mismatches"} <= set(v.metrics)
    assert (v.metrics["requests"], v.metrics["hits_expected"], v.metrics["mismatches"]) == (3, 1, 0)
    assert [r["expected"] for r in v.details["requests"]] == [0, 0, 256]


@pytest.mark.parametrize("observed", [0, 192, 257])
def test_wrong_hit_fails_with_the_request_path(observed):
    v = prefix_branching_verdict(sglang_scenario(observed), oracle())
    assert v.status == "fail"
    assert v.reason.startswith("b257/2: cached_tokens") and "expected 256" in v.reason


def test_output_on_a_hit_must_equal_the_cold_output():
    v = prefix_branching_verdict(sglang_scenario(256, output=(1, 2, 9)), oracle())
    assert v.status == "fail" and "b257/2: output differs from the cold output at token 2" in v.reason


def test_exact_mode_sees_a_wrong_state_that_leaves_the_argmax_alone():
    """Same tokens, but the hit's logprobs drifted: a state taken at the wrong position
    (force_track_h_dropped on real SGLang) moves logprobs long before it flips a token."""
    cold = (-0.5, -1.25, -0.75)
    same = prefix_branching_verdict(sglang_scenario(256, output_logprobs=cold, cold_output_logprobs=cold), oracle())
    noise = prefix_branching_verdict(sglang_scenario(256, output_logprobs=(-0.5, -1.25 + 5e-5, -0.75), cold_output_logprobs=cold), oracle())
    drift = prefix_branching_verdict(sglang_scenario(256, output_logprobs=(-0.5, -1.25, -0.74), cold_output_logprobs=cold), oracle())
    assert same.status == "pass" and noise.status == "pass", (same.reason, noise.reason)
    assert drift.status == "fail" and "b257/2: output token 2 logprob -0.740000 vs cold -0.750000" in drift.reason
    assert drift.metrics["output_mismatches"] == 1


def test_non_exact_mode_bounds_first_token_kl():
    a = ((1, -0.1), (2, -2.5))
    b = ((2, -0.1), (1, -2.5))
    ok = prefix_branching_verdict(sglang_scenario(256, first_top=a, cold_first_top=a), oracle(), exact=False)
    bad = prefix_branching_verdict(sglang_scenario(256, first_top=b, cold_first_top=a), oracle(), exact=False)
    assert ok.status == "pass" and bad.status == "fail" and "top-k KL" in bad.reason


def test_concurrent_siblings_accept_either_admission_order():
    for third, status in ((0, "skip"), (256, "pass")):  # admitted together: nothing to hit yet
        rec = TreeRecording((req("b/0", 11, 0, 0, flushed_before=True), req("b/1", 12, 0, 1), req("b/2", 13, third, 1)))
        v = prefix_branching_verdict(rec, oracle())
        assert (v.status, v.metrics["mismatches"]) == (status, 0), (third, v.reason)
        assert v.details["requests"][2]["accepted"] == [0, 256]


def test_after_eviction_pressure_a_shorter_hit_is_accepted():
    v = prefix_branching_verdict(sglang_scenario(0, after_pressure=True), oracle())
    assert v.status == "skip"  # nothing hit and the oracle's hit may be evicted: no evidence, no pass
    v = prefix_branching_verdict(sglang_scenario(128, after_pressure=True), oracle())
    assert v.status == "fail"  # 128 was never stored


def test_refuses_to_pass_vacuously():
    off = prefix_branching_verdict(sglang_scenario(0), oracle()).status
    assert off == "fail"
    disabled = prefix_branching_verdict(TreeRecording(sglang_scenario(0).requests, cache_enabled=False), oracle())
    assert disabled.status == "skip" and "disabled" in disabled.reason
    single = prefix_branching_verdict(TreeRecording((req("only", 11, 0, 0),)), oracle())
    assert single.status == "skip" and "vacuous" in single.reason


def test_missing_cold_output_is_a_one_line_error():
    with pytest.raises(KitError, match="no cold output"):
        prefix_branching_verdict(sglang_scenario(256, cold_output=()), oracle())


def test_the_oracle_passed_in_is_not_mutated():
    o = oracle()
    prefix_branching_verdict(sglang_scenario(256), o)
    assert o.expected_hit(PREFIX + (13,) * 80) == 0


def _chain(hits: list[int]) -> TreeRecording:
    """A chain of multi_turn_tree's shape: each turn the previous turn's prompt + output + 65 tokens."""
    from conformance.workloads.trees import multi_turn_tree

    tree = multi_turn_tree(chunk=CHUNK, track_interval=TRACK, vocab_size=500)
    chain = [r for r in tree.requests if r.path.startswith("chunks/")]
    rows, sent = [], {}
    for r, hit in zip(chain, hits):
        prompt = r.prompt(sent)
        sent[r.path] = (prompt, OUT)
        rows.append(TreeRequestRecord(r.path, prompt, OUT, hit, r.group, cold_output=OUT, flushed_before=r.flush_before))
    return TreeRecording(tuple(rows))


def test_multi_turn_reuse_judges_each_turns_hit():
    """Issue 43: a stored prefix not reused across turns (answers right, hits lower) showed in
    no scripted suite; each turn of a chain now hits what the tree kept of the turn before."""
    from conformance.checks.findings import findings_of

    ok = prefix_branching_verdict(_chain([0, 64, 128, 192]), oracle())
    assert ok.status == "pass" and ok.metrics["hits_expected"] == 3, ok.reason
    lost = prefix_branching_verdict(_chain([0, 64, 64, 192]), oracle())  # turn 2 fell back to turn 0's state
    assert lost.status == "fail" and lost.reason.startswith("chunks/2: cached_tokens 64, expected 128")
    assert [f.kind for f in findings_of(lost)] == ["hit_below_certain"]
