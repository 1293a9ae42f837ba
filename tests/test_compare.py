"""compare: one seeded regression per kind is flagged; equal or better runs are not."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from conformance.errors import KitError
from conformance.report.compare import compare_files, compare_reports, render_compare
from conformance.report.schema import load_report

DATA = Path(__file__).parent / "data" / "reports"
LAZY = "qwen3-next-80b-extra_buffer_lazy-p1-t256"
EXTRA = "qwen3-next-80b-extra_buffer-p1-t256"
NOBUF = "qwen3-next-80b-no_buffer-p1-t256"


@pytest.fixture
def clean() -> dict:
    return load_report(DATA / "clean" / "report.json")


def _cell(report: dict, cid: str) -> dict:
    return next(c for c in report["cells"] if c["id"] == cid)


def _kinds(result) -> list[tuple[str, str, str]]:
    return [(r.kind, r.cell, r.check) for r in result.rows]


def test_equal_reports_do_not_regress(clean):
    result = compare_reports(clean, copy.deepcopy(clean))
    assert not result.regressed and result.rows == ()
    assert result.compared_cells == len(clean["cells"])
    assert "no regression across 5 compared cells" in render_compare(result)


def test_recorded_seeded_regression_is_flagged_by_file():
    result = compare_files(DATA / "clean" / "report.json", DATA / "regressed")
    assert result.regressed
    assert sorted(_kinds(result)) == sorted([
        ("accuracy", NOBUF, "gsm8k"),
        ("kl", EXTRA, "kl"),
        ("status", LAZY, "leaks"),
        ("missing", "nemotron-nano-9b-v2-extra_buffer-p64-t256", "-"),
        ("launches", "-", "-"),
        ("wall", "-", "-"),
    ])
    text = render_compare(result, width=200)
    assert "REGRESSED: 6 regression(s)" in text
    assert "3 mamba slots still used at idle" in text


def test_the_reverse_direction_is_an_improvement_not_a_regression():
    result = compare_files(DATA / "regressed" / "report.json", DATA / "clean" / "report.json")
    assert not result.regressed, render_compare(result)
    assert result.added_cells == ("nemotron-nano-9b-v2-extra_buffer-p64-t256",)


@pytest.mark.parametrize("before, after, flagged", [("pass", "fail", True), ("pass", "skip", True), ("skip", "fail", True),
                                                    ("fail", "pass", False), ("skip", "pass", False), ("fail", "skip", False)])
def test_status_change(clean, before, after, flagged):
    old, new = copy.deepcopy(clean), copy.deepcopy(clean)
    for report, status in ((old, before), (new, after)):
        _cell(report, LAZY)["checks"]["prefix_branching"].update(status=status, reason=f"seeded {status}")
    result = compare_reports(old, new)
    assert _kinds(result) == ([("status", LAZY, "prefix_branching")] if flagged else [])


def test_kl_up_beyond_the_noise_floor(clean):
    new = copy.deepcopy(clean)
    kl = _cell(new, EXTRA)["checks"]["kl"]["metrics"]
    kl["topk_kl_mean"] = 6e-5 * 2.5
    assert _kinds(compare_reports(clean, new)) == [("kl", EXTRA, "kl")]
    kl["topk_kl_mean"] = 6e-5 * 1.9  # within factor 2: noise
    assert not compare_reports(clean, new).regressed


def test_kl_limit_uses_the_noise_floor_when_the_old_value_is_below_it(clean):
    old, new = copy.deepcopy(clean), copy.deepcopy(clean)
    _cell(old, EXTRA)["checks"]["kl"]["metrics"].update(topk_kl_mean=1e-7, noise_floor=1e-4)
    _cell(new, EXTRA)["checks"]["kl"]["metrics"].update(topk_kl_mean=1.5e-4, noise_floor=1e-4)
    assert not compare_reports(old, new).regressed  # 1000x the old value, but under 2x the floor
    _cell(new, EXTRA)["checks"]["kl"]["metrics"]["topk_kl_mean"] = 2.5e-4
    assert _kinds(compare_reports(old, new)) == [("kl", EXTRA, "kl")]


def test_accuracy_below_the_old_wilson_low(clean):
    new = copy.deepcopy(clean)
    gsm = _cell(new, NOBUF)["checks"]["gsm8k"]["metrics"]
    low = _cell(clean, NOBUF)["checks"]["gsm8k"]["metrics"]["wilson_low"]
    gsm["accuracy"] = low + 0.005  # lower than before, but inside the interval
    assert not compare_reports(clean, new).regressed
    gsm["accuracy"] = low - 0.005
    assert _kinds(compare_reports(clean, new)) == [("accuracy", NOBUF, "gsm8k")]


def test_more_launches(clean):
    new = copy.deepcopy(clean)
    new["launches"] = clean["launches"] + 1
    assert _kinds(compare_reports(clean, new)) == [("launches", "-", "-")]
    more_cells = copy.deepcopy(new)
    more_cells["cells"].append(dict(copy.deepcopy(clean["cells"][0]), id="extra-cell"))
    assert not compare_reports(clean, more_cells).regressed  # more cells legitimately need more launches


def test_slower_by_factor_and_seconds(clean):
    new = copy.deepcopy(clean)
    new["wall_s"] = clean["wall_s"] * 1.6
    assert _kinds(compare_reports(clean, new)) == [("wall", "-", "-")]
    assert not compare_reports(clean, new, wall_factor=2.0).regressed
    small_old, small_new = copy.deepcopy(clean), copy.deepcopy(clean)
    small_old["wall_s"], small_new["wall_s"] = 20.0, 45.0  # 2.25x but only 25 s slower
    assert not compare_reports(small_old, small_new).regressed


def test_missing_cell_and_missing_check(clean):
    new = copy.deepcopy(clean)
    new["cells"] = [c for c in new["cells"] if c["id"] != NOBUF]
    del _cell(new, LAZY)["checks"]["gsm8k"]
    assert sorted(_kinds(compare_reports(clean, new))) == [("missing", LAZY, "gsm8k"), ("missing", NOBUF, "-")]


def test_different_targets_are_noted(clean):
    new = copy.deepcopy(clean)
    new["target"] = "reference"
    result = compare_reports(clean, new)
    assert not result.regressed and "targets differ" in render_compare(result)


def test_missing_or_malformed_file_is_one_kit_error_line(tmp_path, clean):
    with pytest.raises(KitError, match="report file not found") as err:
        compare_files(tmp_path / "old.json", DATA / "clean" / "report.json")
    assert "\n" not in str(err.value)
    (tmp_path / "new.json").write_text("{not json")
    with pytest.raises(KitError, match="new.json: not valid JSON"):
        compare_files(DATA / "clean" / "report.json", tmp_path / "new.json")
    broken = copy.deepcopy(clean)
    broken["cells"][0]["checks"]["kl"]["status"] = "weird"
    with pytest.raises(KitError, match="new report: cell .* check kl: status must be one of"):
        compare_reports(clean, broken)


def test_a_not_applicable_cell_disappearing_is_not_a_regression(clean):
    old = copy.deepcopy(clean)
    old["cells"].append({"id": "x-hicache", "not_applicable": "needs target sglang", "checks": {}})
    result = compare_reports(old, clean)
    assert not result.regressed and result.compared_cells == len(clean["cells"])


def test_cli_name_for_loading_is_exported():
    from conformance.report.compare import load_report_file

    assert load_report_file(DATA / "clean")["schema"] == 1


def test_an_errored_check_is_a_regression_even_if_it_errored_before(clean):
    new = copy.deepcopy(clean)
    kl = _cell(new, LAZY)["checks"]["kl"]
    kl.update(status="error", reason="test test_kl: RuntimeError: boom", metrics=dict.fromkeys(kl["metrics"]))
    result = compare_reports(clean, new)
    assert ("error", LAZY, "kl") in _kinds(result) and ("status", LAZY, "kl") not in _kinds(result)
    assert compare_reports(new, copy.deepcopy(new)).regressed  # still errored: still nothing compared
    assert not compare_reports(new, clean).regressed  # error -> pass is an improvement


def test_an_incomplete_run_is_a_regression_naming_the_cells(clean):
    new = copy.deepcopy(clean)
    new["cells"] = [c for c in new["cells"] if c["id"] != NOBUF]
    new.update({"complete": False, "incomplete_reasons": ["interrupted"], "cells_not_run": [NOBUF]})
    result = compare_reports(clean, new)
    kinds = _kinds(result)
    assert ("missing", NOBUF, "-") in kinds and ("incomplete", "-", "-") in kinds
    row = next(r for r in result.rows if r.kind == "incomplete")
    assert "interrupted" in row.note and NOBUF in row.note


def test_a_new_failing_teardown_check_is_a_regression(clean):
    new = copy.deepcopy(clean)
    _cell(new, EXTRA)["checks"]["teardown"] = {"status": "fail", "metrics": {}, "reason": "pools not idle after cell teardown (mamba=3)"}
    assert ("status", EXTRA, "teardown") in _kinds(compare_reports(clean, new))
