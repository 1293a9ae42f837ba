"""report.html: a one-file page (inline CSS) with the status table, reasons and the plots.

PNGs live in ``plots/`` next to the page and are referenced relatively, so the
report directory can be uploaded as a CI artifact and opened as it is.
"""

from __future__ import annotations

import json
import os
from html import escape
from pathlib import Path
from typing import Any, Mapping, Sequence

from conformance.report.markdown import reasons
from conformance.report.plots import Plot
from conformance.report.schema import check_names, key_numbers, not_applicable, status_counts

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.pass { background: #d9f2d9; } td.fail { background: #f8d0d0; font-weight: bold; } td.skip { background: #eee; color: #666; }
td small { font-weight: normal; color: #333; }
.plot { margin: 1em 0; } .plot img { max-width: 100%; border: 1px solid #ddd; }
.noplot { color: #777; font-style: italic; }
code { font-size: 0.95em; }
"""


def render_html(report: Mapping[str, Any], plots: Sequence[Plot], base_dir: Path) -> str:
    """The page for ``report``; plot paths are written relative to ``base_dir``."""
    counts = report.get("summary") or status_counts(list(report["cells"]) + list(report.get("disagg", [])))
    title = f"hybrid-conformance report: {report['target']}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f"<p>{len(report['cells'])} cells, {report['launches']} server launches, {report['wall_s']:.1f} s wall; "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("pass", "fail", "skip"))
        + (f"; generated {escape(str(report['generated_at']))}" if report.get("generated_at") else "")
        + "</p>",
        "<h2>Summary</h2>",
        _table(report["cells"]),
    ]
    if report.get("disagg"):
        parts += ["<h2>PD disaggregation</h2>", _table(report["disagg"])]
    if report.get("pool") is not None:
        parts += ["<h2>Pool tier</h2>", f"<pre>{escape(json.dumps(report['pool'], indent=2))}</pre>"]
    every = list(report["cells"]) + list(report.get("disagg", []))
    for status, heading in (("fail", "Failures"), ("skip", "Skipped")):
        rows = reasons(every, status)
        if rows:
            items = "".join(f"<li><code>{escape(c)}</code> {escape(k)}: {escape(r)}</li>" for c, k, r in rows)
            parts += [f"<h2>{heading}</h2>", f"<ul>{items}</ul>"]
    idle = [c for c in every if not_applicable(c)]
    if idle:
        items = "".join(f"<li><code>{escape(c['id'])}</code>: {escape(str(c['not_applicable']))}</li>" for c in idle)
        parts += ["<h2>Not applicable</h2>", f"<ul>{items}</ul>"]
    parts.append("<h2>Plots</h2>")
    parts += [_plot(p, base_dir) for p in plots] or ['<p class="noplot">no plots: the run recorded no checks</p>']
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _table(cells: Sequence[Mapping[str, Any]]) -> str:
    cells = [c for c in cells if not not_applicable(c)]
    checks = check_names(cells)
    head = "".join(f"<th>{escape(h)}</th>" for h in ("cell", "model", "strategy", "fault", *checks))
    rows = []
    for cell in cells:
        tds = [f"<td><code>{escape(cell['id'])}</code></td>"] + [f"<td>{escape(str(cell.get(k, '')))}</td>" for k in ("model", "strategy", "fault")]
        for name in checks:
            verdict = cell["checks"].get(name)
            if verdict is None:
                tds.append('<td title="not run"></td>')
                continue
            status = verdict["status"]
            nums = key_numbers(name, verdict)
            tip = f' title="{escape(verdict["reason"])}"' if verdict.get("reason") else ""
            tds.append(f'<td class="{status}"{tip}>{status}' + (f"<br><small>{escape(nums)}</small>" if nums else "") + "</td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _plot(plot: Plot, base_dir: Path) -> str:
    head = f"<h3>{escape(plot.title)}</h3>"
    if plot.path is None:
        return f'<div class="plot">{head}<p class="noplot">{escape(plot.note or "no data")}</p></div>'
    src = Path(os.path.relpath(plot.path, base_dir)).as_posix()
    return f'<div class="plot">{head}<img src="{escape(src)}" alt="{escape(plot.title)}"></div>'
