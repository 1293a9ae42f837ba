"""report.md, report.html and the PNG plots rendered from recorded runs."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matplotlib import image as mpimg

from conformance.report.files import write_report
from conformance.report.markdown import render_markdown
from conformance.report.plots import wilson_interval
from conformance.report.schema import build_report, load_report

DATA = Path(__file__).parent / "data" / "reports"


@pytest.fixture(scope="module")
def clean() -> dict:
    return load_report(DATA / "clean" / "report.json")


@pytest.fixture(scope="module")
def regressed() -> dict:
    return load_report(DATA / "regressed" / "report.json")


def _section(html: str, heading: str) -> str:
    """The HTML between ``<h2>heading</h2>`` and the next ``<h2>``."""
    return html.split(f"<h2>{heading}</h2>", 1)[1].split("<h2>", 1)[0]


def _assert_not_blank(path: Path) -> None:
    pixels = mpimg.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 50, path
    assert float(np.var(pixels)) > 0, f"{path} is one flat colour"
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 10, f"{path} has only {len(colours)} distinct colours"


def test_html_and_pngs_from_a_recorded_run(clean, tmp_path):
    written = write_report(clean, tmp_path)
    assert {"report.json", "report.md", "report.html"} <= set(written)
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    # 4 KL curves (the nemotron cell has no per-position KL), 3 strategies, 1 GSM8K chart
    assert len(pngs) == 8
    html = (tmp_path / "report.html").read_text()
    srcs = set(re.findall(r'<img src="([^"]+)"', html))
    for png in pngs:
        _assert_not_blank(png)
        assert f"plots/{png.name}" in srcs, f"report.html does not reference {png.name}"
        assert written[f"plots/{png.name}"] == png
    assert srcs == {f"plots/{p.name}" for p in pngs}
    assert "no per-position KL recorded" in html  # the cell without details says so as text
    table = _section(html, "Cells")
    assert table.count('class="pass"') == clean["summary"]["pass"]
    assert table.count('class="skip"') == clean["summary"]["skip"]


def test_failing_run_marks_failures_in_html_and_markdown(regressed, tmp_path):
    write_report(regressed, tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert _section(html, "Cells").count('class="fail"') == 1
    assert _section(html, "Verdict matrix").count('class="fail"') == 1  # the square holding the failing cell
    assert "3 mamba slots still used at idle" in html
    md = (tmp_path / "report.md").read_text()
    assert "## Failures" in md
    assert re.search(r"^- `qwen3-next-80b-extra_buffer_lazy-p1-t256` leaks: 3 mamba slots", md, re.M)
    assert "**FAIL**" in md


def test_markdown_table_has_a_row_per_cell_and_key_numbers(clean):
    md = render_markdown(clean)
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == len(clean["cells"])
    header = next(line for line in md.splitlines() if line.startswith("| cell"))
    assert header.split("|")[5:9] == [" kl ", " prefix_branching ", " leaks ", " gsm8k "]
    assert "acc 0.94 [0.898, 0.965] n=200" in md
    assert "## Failures" not in md and "## Skipped" in md


def test_missing_details_never_crash_and_say_so(tmp_path):
    cells = [
        {
            "id": "c1", "model": "m", "family": "qwen3-next", "strategy": "extra_buffer", "fault": "none",
            "checks": {
                "kl": {"status": "skip", "metrics": {}, "reason": "no cache hit"},
                "leaks": {"status": "pass", "metrics": {}, "details": {"timeline": [[0, "x"], None]}},
                "gsm8k": {"status": "pass", "metrics": {"n": 0, "accuracy": None}},
            },
        },
        {"id": "c2", "model": "m", "family": "qwen3-next", "strategy": "no_buffer", "fault": "none", "checks": {}},
    ]
    report = build_report("reference", 0, 0.0, cells)
    written = write_report(report, tmp_path)
    assert not [k for k in written if k.startswith("plots/")]
    html = (tmp_path / "report.html").read_text()
    assert "no per-position KL recorded (check skip: no cache hit)" in html
    assert "no leaks timeline recorded for any extra_buffer cell" in html
    assert "no GSM8K accuracy recorded" in html
    assert "<img" not in html


def test_rewrite_removes_stale_plots(clean, tmp_path):
    write_report(clean, tmp_path)
    fewer = copy.deepcopy(clean)
    fewer["cells"] = fewer["cells"][:1]
    write_report(fewer, tmp_path)
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3  # one KL, one pool, one GSM8K


def test_html_escapes_reasons(tmp_path):
    cells = [{"id": "c<1>", "model": "m", "family": "f", "strategy": "s", "fault": "none",
              "checks": {"leaks": {"status": "fail", "metrics": {}, "reason": "<script>x</script>"}}}]
    write_report(build_report("pool", 1, 1.0, cells), tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html


@pytest.mark.parametrize("acc, n, low, high", [(0.5, 100, 0.4038, 0.5962), (0.95, 200, 0.9104, 0.9726), (0.0, 10, 0.0, 0.2775)])
def test_wilson_interval_fallback(acc, n, low, high):
    assert wilson_interval(acc, n) == pytest.approx((low, high), abs=1e-4)
    assert wilson_interval(acc, 0) == (0.0, 1.0)


def test_wilson_interval_clamps_out_of_range_accuracy():
    assert wilson_interval(2.0, 10) == wilson_interval(1.0, 10)
    assert wilson_interval(-1.0, 10) == wilson_interval(0.0, 10)
    assert wilson_interval(float("nan"), 10) == (0.0, 1.0)


def test_disagg_cells_and_pool_results_get_their_own_sections(clean, tmp_path):
    report = copy.deepcopy(clean)
    report["disagg"] = [{"id": "pd-qwen3-next-80b-extra_buffer", "checks": {
        "disagg": {"status": "fail", "metrics": {"transfers": 8}, "reason": "decode side state differs"}}}]
    report["pool"] = [{"name": "test_pool_machine", "status": "pass"}]
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## PD disaggregation" in md and "## Pool tier" in md
    assert "`pd-qwen3-next-80b-extra_buffer` disagg: decode side state differs" in md
    assert "| `test_pool_machine` | pass |" in md
    html = (tmp_path / "report.html").read_text()
    assert "<h2>PD disaggregation</h2>" in html and "test_pool_machine" in html


def test_not_applicable_cells_are_listed_not_tabled(clean, tmp_path):
    report = copy.deepcopy(clean)
    report["cells"].append({"id": "granite-4.0-h-tiny-extra_buffer-p64-t256-hicache", "not_applicable": "hicache needs target sglang", "checks": {}})
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert len([line for line in md.splitlines() if line.startswith("| `")]) == len(clean["cells"])
    assert "## Not applicable" in md and "`granite-4.0-h-tiny-extra_buffer-p64-t256-hicache`: hicache needs target sglang" in md
    assert "<h2>Not applicable</h2>" in (tmp_path / "report.html").read_text()


_junk = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3))
_rows = st.one_of(_junk, st.lists(st.one_of(_junk, st.lists(_junk, max_size=5)), max_size=6))


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(per_position=_rows, boundaries=_rows, timeline=_rows, accuracy=_junk, wilson_high=_junk)
def test_arbitrary_details_never_crash_the_writer(tmp_path, per_position, boundaries, timeline, accuracy, wilson_high):
    acc = accuracy if isinstance(accuracy, float) else None
    cells = [{"id": "c", "model": "m", "family": "f", "strategy": "extra_buffer", "fault": "none", "checks": {
        "kl": {"status": "pass", "metrics": {}, "details": {"per_position": per_position, "boundaries": boundaries}},
        "leaks": {"status": "pass", "metrics": {}, "details": {"timeline": timeline}},
        "gsm8k": {"status": "pass", "metrics": {"n": 10, "accuracy": acc}, "details": {"wilson_high": wilson_high}},
    }}]
    written = write_report(build_report("reference", 1, 1.0, cells), tmp_path)
    html = (tmp_path / "report.html").read_text()
    for name in written:
        if name.startswith("plots/"):
            assert f'src="{name}"' in html
    assert html.count('<div class="plot">') == 3  # KL, pool, GSM8K: each a PNG or a note
