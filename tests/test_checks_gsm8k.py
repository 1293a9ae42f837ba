"""GSM8K check: accuracy rule, paired McNemar, agreement mode, the engine it names (the
extraction filters are lm-eval's; tests/test_gsm8k_lm_eval.py runs them)."""

from __future__ import annotations

import pytest

from conformance.checks.gsm8k import gsm8k_verdict
from conformance.recordings import GSM8KAnswer, GSM8KRecording
from conformance.errors import KitError


ENGINE = "lm-eval 0.4.13"


def answers(correct: list[bool], *, tail: str = "") -> GSM8KRecording:
    rows = [GSM8KAnswer(i, f"so {i + 10 if ok else i + 11}{tail}", strict=False, flexible=ok) for i, ok in enumerate(correct)]
    return GSM8KRecording(tuple(rows), 2, "x", ENGINE)


def test_primary_filter_decides_and_both_accuracies_are_reported():
    rec = GSM8KRecording(tuple(GSM8KAnswer(i, "x", strict=i < 3, flexible=i < 7) for i in range(10)), 2, "x", ENGINE)
    flex = gsm8k_verdict(rec, mode="accuracy")
    strict = gsm8k_verdict(rec, mode="accuracy", primary="strict")
    assert flex.metrics["accuracy"] == 0.7 and strict.metrics["accuracy"] == 0.3
    assert flex.metrics["strict_accuracy"] == 0.3 and flex.metrics["flexible_accuracy"] == 0.7


def test_accuracy_mode_pass_with_contract_metrics_and_rule():
    v = gsm8k_verdict(answers([True] * 180 + [False] * 20), mode="accuracy", min_accuracy=0.85, baseline=answers([True] * 180 + [False] * 20))
    assert v.status == "pass", v.reason
    assert {"n", "accuracy", "wilson_low", "agreement"} <= set(v.metrics) and v.metrics["engine"] == ENGINE
    assert v.metrics["accuracy"] == 0.9 and v.metrics["agreement"] == 1.0
    assert v.details["wilson_high"] > 0.9 > v.metrics["wilson_low"]
    assert "needs n=" in v.details["rule"] and v.details["required_n_for_margin"] > 200


def test_significantly_worse_than_baseline_fails_even_above_the_threshold():
    base = answers([True] * 200)
    worse = answers([True] * 188 + [False] * 12)
    v = gsm8k_verdict(worse, mode="accuracy", min_accuracy=0.5, baseline=base)
    assert v.status == "fail" and "McNemar" in v.reason and v.metrics["mcnemar_p"] < 0.05


def test_within_noise_of_the_baseline_passes():
    base = answers([True] * 190 + [False] * 10)
    close = answers([True] * 188 + [False] * 12)
    assert gsm8k_verdict(close, mode="accuracy", min_accuracy=0.9, baseline=base).status == "pass"


def test_accuracy_interval_below_threshold_fails():
    v = gsm8k_verdict(answers([True] * 50 + [False] * 50), mode="accuracy", min_accuracy=0.8)
    assert v.status == "fail" and "significantly below" in v.reason


def test_agreement_mode_fails_on_one_differing_completion_and_says_so():
    base = answers([True, False, True, True])
    same = gsm8k_verdict(answers([True, False, True, True]), mode="agreement", baseline=base)
    assert same.status == "pass" and same.metrics["agreement"] == 1.0 and "agreement mode" in same.details["rule"]
    diff = gsm8k_verdict(answers([True, False, True, True], tail=" ok"), mode="agreement", baseline=base)
    assert diff.status == "fail" and "4/4 completions differ" in diff.reason


def test_refuses_to_pass_vacuously():
    empty = gsm8k_verdict(GSM8KRecording((), engine=ENGINE), mode="accuracy")
    assert empty.status == "skip" and empty.metrics["engine"] == ENGINE
    v = gsm8k_verdict(answers([True]), mode="agreement", baseline=None)
    assert v.status == "skip" and "baseline" in v.reason
    with pytest.raises(KitError):
        gsm8k_verdict(answers([True]), mode="exactish")  # type: ignore[arg-type]


def test_a_recording_that_names_no_engine_is_refused():
    with pytest.raises(KitError, match="engine"):
        gsm8k_verdict(GSM8KRecording(answers([True]).answers, 2, "x", ""), mode="accuracy")


def test_a_missing_paired_baseline_is_named_in_the_verdict():
    rec = answers([True] * 30)
    v = gsm8k_verdict(rec, mode="accuracy", baseline_id="m-no_buffer-p1-t128")
    assert v.status == "pass" and v.metrics["paired_n"] == 0 and v.metrics["paired_baseline"] == "m-no_buffer-p1-t128"
    assert "paired test not run: baseline cell m-no_buffer-p1-t128 has no GSM8K answers" in v.reason
    v = gsm8k_verdict(rec, mode="agreement", baseline_id="m-no_buffer-p1-t256")
    assert v.status == "skip" and "m-no_buffer-p1-t256" in v.reason
    paired = gsm8k_verdict(rec, mode="accuracy", baseline=answers([True] * 30), baseline_id="m-no_buffer-p1-t256")
    assert paired.metrics["paired_n"] == 30 and paired.reason == "" and paired.metrics["mcnemar_p"] == 1.0


def test_a_baseline_that_answered_other_questions_is_said_to_pair_nothing():
    other = GSM8KRecording(tuple(GSM8KAnswer(i + 100, "x", strict=True, flexible=True) for i in range(5)), 2, "base", ENGINE)
    v = gsm8k_verdict(answers([True] * 5), mode="accuracy", baseline=other, baseline_id="base")
    assert v.metrics["paired_n"] == 0 and "answered none of these 5 questions" in v.reason
