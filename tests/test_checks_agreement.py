"""The agreement check on hand-built answers: agreement passes, each kind of disagreement
fails with its number, and nothing compared (or no cache hit) is refused."""

from __future__ import annotations

from conformance.checks.agreement import agreement_verdict
from conformance.recordings import AgreementStep, ServedStep, TokenLogprobs


def served(tokens, lps, cached=0, shift=0.0):
    top = tuple(((t, lp + shift), (t + 1, lp - 2.0 + shift)) for t, lp in zip(tokens, lps))
    return ServedStep(cached, TokenLogprobs(tuple(tokens), tuple(lp + shift for lp in lps), top))


def pair(name, cached_a=0, cached_b=0, tokens_b=None, shift=0.0):
    toks, lps = [5, 6, 7, 8], [-0.1, -0.5, -1.0, -0.2]
    return AgreementStep(name, served(toks, lps, cached_a), served(tokens_b or toks, lps, cached_b, shift))


def test_agreement_passes_with_numbers():
    v = agreement_verdict([pair("cold"), pair("repeat", 128, 128, shift=3e-6)])
    assert v.status == "pass", v.reason
    assert v.metrics["tokens"] == 8 and v.metrics["steps_with_hits"] == 1
    assert 2e-6 < v.metrics["max_logprob_gap"] < 4e-6


def test_cached_tokens_disagreement_fails():
    v = agreement_verdict([pair("cold"), pair("repeat", 128, 64)])
    assert v.status == "fail" and "cached_tokens sglang 128 vs reference 64" in v.reason
    assert v.metrics["cached_mismatches"] == 1


def test_token_and_logprob_disagreement_fail():
    v = agreement_verdict([pair("repeat", 128, 128, tokens_b=[5, 6, 9, 8])])
    assert v.status == "fail" and "differ from position 2" in v.reason and v.metrics["token_mismatches"] == 2
    v = agreement_verdict([pair("repeat", 128, 128, shift=1e-3)])
    assert v.status == "fail" and "logprobs differ by 0.001" in v.reason


def test_refuses_vacuous_runs():
    assert agreement_verdict([]).status == "fail"
    v = agreement_verdict([pair("cold"), pair("again")])
    assert v.status == "fail" and "no step hit the cache" in v.reason
