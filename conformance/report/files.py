"""report.json, report.md, report.html and plots/*.png written into one directory."""

from __future__ import annotations

from pathlib import Path

from conformance.report.html import render_html
from conformance.report.markdown import render_markdown
from conformance.report.plots import draw_all
from conformance.report.schema import dump_report, validate_report

PLOT_DIR = "plots"


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
