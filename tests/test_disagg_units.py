"""Pure pieces of the PD mode: the router's metric labelling, batch shape and result merge;
the threshold-history report; the folding of parts into one ``disagg`` verdict."""

from __future__ import annotations

import pytest

from conformance.checks.disagg import SGLANG_PD_HISTORY, disagg_verdict, threshold_history
from conformance.client import parse_metrics
from conformance.errors import KitError
from conformance.records import Verdict
from conformance.reference.router import batch_shape, label_metrics, merge_results


def test_router_metrics_sum_to_both_servers_and_keep_help_once():
    seen: set[str] = set()
    pre = "# HELP g x\n# TYPE g gauge\ng{model_name=\"m\"} 2.0\nplain 1\n"
    dec = "# HELP g x\n# TYPE g gauge\ng{model_name=\"m\"} 3.0\n"
    lines = label_metrics(pre, "prefill", seen) + label_metrics(dec, "decode", seen)
    assert lines.count("# HELP g x") == 1
    assert 'g{role="decode",model_name="m"} 3.0' in lines and 'plain{role="prefill"} 1' in lines
    assert parse_metrics("\n".join(lines))["g"] == 5.0


def test_batch_shape_follows_sglangs_rules():
    assert batch_shape({"text": ["a", "b"]}) == (2, True)
    assert batch_shape({"input_ids": [[1], [2], [3]]}) == (3, True)
    assert batch_shape({"input_ids": [1, 2]}) == (1, False)
    assert batch_shape({"text": "a"}) == (1, False)


def test_merge_takes_cache_hits_and_input_logprobs_from_the_prefill():
    pre = [{"meta_info": {"cached_tokens": 64, "input_token_logprobs": [[None, 1, None]]}}]
    dec = [{"output_ids": [5], "meta_info": {"cached_tokens": 0, "output_token_logprobs": [[-0.1, 5, None]]}}]
    out = merge_results(pre, dec)
    assert out[0]["meta_info"]["cached_tokens"] == 64 and out[0]["meta_info"]["input_token_logprobs"] == [[None, 1, None]]
    assert out[0]["output_ids"] == [5]


def test_threshold_history_reports_intervals_not_a_bare_threshold():
    rows = threshold_history(94, 100)
    assert [r["threshold"] for r in rows] == [h.threshold for h in SGLANG_PD_HISTORY] == [0.93, 0.90, 0.87]
    assert all(r["wilson_low"] < 0.94 < r["wilson_high"] for r in rows)
    assert rows[0]["position"] == "undecided" and rows[0]["items_to_resolve"] > 100
    assert rows[2]["sglang_observed"] == 0.63
    assert threshold_history(990, 1000)[0]["position"] == "above"
    assert threshold_history(63, 100)[2]["position"] == "below"
    with pytest.raises(KitError):
        threshold_history(0, 0)


def test_disagg_verdict_fails_on_any_part_and_names_it():
    ok = Verdict("kl", "pass", {"topk_kl_mean": 0.0})
    bad = Verdict("leaks", "fail", {"mamba_used_at_idle": 3.0}, "decode after load: idle gauges not 0")
    v = disagg_verdict([ok, bad])
    assert v.check == "disagg" and v.status == "fail" and v.reason.startswith("leaks: ")
    assert v.metrics["topk_kl_mean"] == 0.0 and v.metrics["mamba_used_at_idle"] == 3.0
    assert v.details["parts"] == {"kl": "pass", "leaks": "fail"}
    assert disagg_verdict([]).status == "skip"
    hist = disagg_verdict([ok], history=threshold_history(90, 100))
    assert hist.status == "pass" and hist.metrics["pd_history_undecided"] >= 1 and "sglang_pd_threshold_history" in hist.details
