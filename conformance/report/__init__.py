"""The run report: report.json (schema 1), report.md, report.html with PNG plots, and compare.

``build_report`` assembles and validates the JSON; ``write_report`` puts every
file in one directory (junit.xml comes from pytest's ``--junitxml``);
``compare_reports`` lists what got worse between two runs.
"""

from __future__ import annotations

from pathlib import Path

from conformance.report.compare import CompareResult, CompareRow, compare_files, compare_reports, render_compare
from conformance.report.html import render_html
from conformance.report.markdown import render_markdown
from conformance.report.plots import draw_all
from conformance.report.schema import ReportError, build_report, dump_report, load_report, validate_report

PLOT_DIR = "plots"

__all__ = [
    "CompareResult",
    "CompareRow",
    "ReportError",
    "build_report",
    "compare_files",
    "compare_reports",
    "load_report",
    "render_compare",
    "render_markdown",
    "validate_report",
    "write_report",
]


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    """Write report.json, report.md, report.html and plots/*.png into ``out_dir``.

    Returns ``{relative name: path}`` for every file written.  PNGs left in
    ``plots/`` by an earlier run into the same directory are removed first.
    """
    validate_report(report)
    out_dir = Path(out_dir)
    plot_dir = out_dir / PLOT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot_dir.is_dir():
        for old in plot_dir.glob("*.png"):
            old.unlink()
    written: dict[str, Path] = {}
    for name, text in (("report.json", dump_report(report)), ("report.md", render_markdown(report))):
        (out_dir / name).write_text(text)
        written[name] = out_dir / name
    plots = draw_all(report, plot_dir)
    for plot in plots:
        if plot.path is not None:
            written[f"{PLOT_DIR}/{plot.path.name}"] = plot.path
    (out_dir / "report.html").write_text(render_html(report, plots, out_dir))
    written["report.html"] = out_dir / "report.html"
    return written
