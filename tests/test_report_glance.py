"""report.html / report.md / the terminal summary read at a glance: KL on a log axis with
the limit drawn and gaps left as gaps, occupancy timelines that survive a later empty
one, GSM8K labelled with its mode, twin names, the verdict matrix, completeness and
versions, and a summary that fits the terminal with details on failures only."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
from rich.console import Console

from conformance.report.files import write_report
from conformance.report.markdown import render_markdown
from conformance.report.plots import kl_figure, segments
from conformance.report.schema import build_report, key_numbers, load_report
from conformance.report.run_report import merge_check
from conformance.report.summary import print_summary

DATA = Path(__file__).parent / "data" / "reports"


def _kl_verdict(points, limit=1e-9, floor=1e-12):
    return {"status": "pass", "metrics": {"topk_limit": limit, "noise_floor": floor}, "details": {"per_position": points, "boundaries": [256]}}


def test_segments_break_at_gaps_and_keep_runs():
    pts = [[265, 1e-13], [266, 2e-13], [267, 1e-13], [527, 3e-13], [528, 1e-13], [900, 0.0]]
    runs = segments(pts)
    assert [xs for xs, _ in runs] == [[265, 266, 267], [527, 528], [900]]
    assert segments([]) == []


def test_kl_figure_log_axis_limit_line_and_one_line_per_run():
    fig = kl_figure({"id": "c"}, "kl", _kl_verdict([[10, 1e-13], [11, 2e-13], [300, 1e-13], [301, 0.0]]))
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    curves = [ln for ln in ax.lines if str(ln.get_gid()).startswith("kl:")]
    assert len(curves) == 2  # 10-11 and 300-301: the 289-token gap is not joined
    assert all(max(ln.get_xdata()) - min(ln.get_xdata()) <= 1 for ln in curves)
    limit = [ln for ln in ax.lines if ln.get_gid() == "topk_limit"]
    assert len(limit) == 1 and set(limit[0].get_ydata()) == {1e-9}
    assert min(y for ln in curves for y in ln.get_ydata()) > 0  # a KL of exactly 0 is drawn at the floor, not lost
    assert "0 drawn at" in ax.get_ylabel()


def test_kl_figure_draws_each_recording_as_its_own_series():
    v = _kl_verdict([[1, 1e-13]])
    v["details"]["series"] = [{"label": "prefill_hit", "per_position": [[1, 1e-13], [2, 1e-13]]},
                              {"label": "decode_hit", "per_position": [[400, 1e-13]]}]
    ax = kl_figure({"id": "c"}, "kl", v).axes[0]
    assert {ln.get_gid() for ln in ax.lines if str(ln.get_gid()).startswith("kl:")} == {"kl:prefill_hit", "kl:decode_hit"}
    assert kl_figure({"id": "c"}, "kl", {"status": "skip", "details": {}}) is None


def test_merged_leaks_verdicts_keep_the_recorded_timeline():
    """The second and third leaks tests record no timeline; the first one's must survive."""
    rows = [[0.1, 20, 200, 2], [0.5, 0, 0, 0]]
    merged = merge_check("leaks", [
        {"status": "pass", "metrics": {}, "details": {"timeline": rows}},
        {"status": "pass", "metrics": {}, "details": {"timeline": [], "probes": [1]}},
    ], [])
    assert merged["details"]["timeline"] == rows and merged["details"]["probes"] == [1]


def test_merge_check_status_precedence_and_reasons():
    filed = [{"status": "pass", "metrics": {"n": 1}}]
    assert merge_check("kl", filed, [{"status": "error", "metrics": {}, "reason": "test raised: boom"}])["status"] == "error"
    both = merge_check("kl", [{"status": "fail", "metrics": {}, "reason": "KL too high"}], [{"status": "error", "metrics": {}, "reason": "x"}])
    assert both["status"] == "fail" and both["reason"] == "KL too high"
    assert merge_check("kl", [], [{"status": "skip", "metrics": {}, "reason": "why"}]) == {"status": "skip", "metrics": {}, "reason": "why"}
    assert "reason" not in merge_check("kl", filed, [{"status": "skip", "metrics": {}, "reason": "vacuous"}])


def _cpu_cells():
    base = {"model": "qwen3-next-80b", "family": "qwen3-next", "served_model": "tiny-qwen3-next", "page_size": 1, "track_interval": 256, "cache_variant": "radix"}
    gsm = {"status": "pass", "metrics": {"n": 6, "accuracy": 0.0, "wilson_low": 0.0, "agreement": 1.0, "mode": "agreement"}, "details": {"wilson_high": 0.39}}
    return [
        dict(base, id="q-nb", strategy="no_buffer", fault="none", checks={"gsm8k": gsm, "leaks": {"status": "pass", "metrics": {}}}),
        dict(base, id="q-lazy", strategy="extra_buffer_lazy", fault="none", checks={"gsm8k": gsm, "leaks": {"status": "pass", "metrics": {}}}),
        dict(base, id="q-lazy-fail", strategy="extra_buffer_lazy", fault="lazy_alloc_fail", checks={
            "gsm8k": gsm, "leaks": {"status": "fail", "metrics": {}, "reason": "3 mamba slots used at idle"},
            "teardown": {"status": "error", "metrics": {}, "reason": "server is gone"}}),
    ]


def test_gsm8k_agreement_mode_is_labelled_everywhere(tmp_path):
    report = build_report("reference", 3, 1.0, _cpu_cells())
    assert "agreement mode: 100% identical to baseline" in key_numbers("gsm8k", report["cells"][0]["checks"]["gsm8k"])
    written = write_report(report, tmp_path)
    assert "plots/gsm8k_agreement.png" in written
    html = (tmp_path / "report.html").read_text()
    assert "agreement mode on the CPU twins" in html and "acc 0 [0, 0.39]" not in html
    assert "acc 0" not in render_markdown(report)


def test_verdict_matrix_names_twins_and_holds_fault_cells(tmp_path):
    report = build_report("reference", 3, 1.0, _cpu_cells())
    md = render_markdown(report)
    grid = md.split("## Verdict matrix", 1)[1].split("## Cells", 1)[0]
    assert "| tiny-qwen3-next (for qwen3-next-80b) |" in grid
    assert grid.splitlines()[2].startswith("| model | no_buffer | extra_buffer_lazy |")
    lazy_square = grid.split("|")[-2]
    assert "p1 t256 lazy_alloc_fail" in lazy_square and "✗leaks" in lazy_square and "!teardown" in lazy_square
    write_report(report, tmp_path)
    html = (tmp_path / "report.html").read_text()
    square = html.split("<h2>Verdict matrix</h2>", 1)[1].split("<h2>", 1)[0]
    assert square.count("<tr>") == 1 + 1  # header + one model row
    assert 'class="chip fail"' in square and 'class="chip error"' in square


def test_incomplete_runs_and_versions_are_the_first_thing_read(tmp_path):
    report = build_report("reference", 1, 1.0, _cpu_cells()[:1])
    report.update({"complete": False, "incomplete_reasons": ["interrupted"], "cells_not_run": ["q-lazy"], "cells_partly_run": [],
                   "versions": {"kit": "0.1.0", "sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0"},
                   "twins": {"tiny-qwen3-next": {"weights_sha256": "1eeffe6934fa57758c"}},
                   "tests": {"passed": 2, "failed": 0, "skipped": 1, "errors": 0}})
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[2] == "**INCOMPLETE: interrupted; cells not run: q-lazy**"
    assert "tests: 2 passed, 0 failed, 1 skipped, 0 errors" in md[4]
    assert md[6] == "Versions: kit 0.1.0; sglang 0.5.23; torch 2.14.1; transformers 5.19.0; twins tiny-qwen3-next 1eeffe6934fa"
    html = (tmp_path / "report.html").read_text()
    assert html.index('class="banner"') < html.index("<h2>Verdict matrix</h2>")


@pytest.mark.parametrize("width", [80, 120])
def test_terminal_summary_fits_and_details_only_failures(width):
    clean = load_report(DATA / "clean" / "report.json")
    report = copy.deepcopy(clean)
    report["cells"] += build_report("reference", 3, 1.0, _cpu_cells())["cells"]
    out = io.StringIO()
    print_summary(report, Path("reports/x"), Console(file=out, width=width, color_system=None))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    cells = [c for c in report["cells"] if c["checks"]]
    body = [ln for ln in lines if ln.startswith("│")]
    assert len(body) >= len(cells)  # at least one row per cell (a row may fold on a narrow terminal)
    details = [ln for ln in lines if ln.startswith("- ")]
    assert len(details) == 2 and "q-lazy-fail leaks FAIL: 3 mamba slots" in details[0] and "teardown ERROR" in details[1]
