"""report.html: a one-file page (inline CSS) read at a glance: completeness and versions
first, a verdict matrix (model x strategy, every cell of a square with one chip per
check), the per-cell table, every non-pass reason, then the plots.

PNGs live in ``plots/`` next to the page and are referenced relatively, so the
report directory can be uploaded as a CI artifact and opened as it is.
"""

from __future__ import annotations

import json
import os
from html import escape
from pathlib import Path
from typing import Any, Mapping, Sequence

from conformance.report.known_bugs import bug_hits
from conformance.report.markdown import matrix_groups, reasons
from conformance.report.perf import engines, perf_rows
from conformance.report.reuse import NOTE as REUSE_NOTE, reuse_rows
from conformance.report.plots import Plot
from conformance.report.schema import (
    cell_status,
    check_names,
    completeness_line,
    count_line,
    key_numbers,
    model_label,
    not_applicable,
    variant_label,
    versions_line,
)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.pass { background: #d9f2d9; } td.fail { background: #f8d0d0; font-weight: bold; } td.skip { background: #eee; color: #666; }
td.error { background: #fbe3b0; font-weight: bold; }
.banner { padding: 0.5em 0.8em; background: #fbe3b0; border: 2px solid #c77800; font-weight: bold; }
.meta { color: #444; font-size: 0.9em; }
table.grid td { min-width: 12em; } .sq { margin: 0.1em 0; white-space: nowrap; }
.chip { display: inline-block; padding: 0 0.35em; margin-right: 0.15em; border-radius: 3px; font-size: 0.85em; }
.chip.pass { background: #9fd89f; } .chip.fail { background: #e66; color: #fff; } .chip.skip { background: #ddd; color: #555; }
.chip.error { background: #f0a030; }
td small { font-weight: normal; color: #333; }
.plot { margin: 1em 0; } .plot img { max-width: 100%; border: 1px solid #ddd; }
.noplot { color: #777; font-style: italic; }
code { font-size: 0.95em; }
"""


def render_html(report: Mapping[str, Any], plots: Sequence[Plot], base_dir: Path) -> str:
    """The page for ``report``; plot paths are written relative to ``base_dir``."""
    title = f"hybrid-conformance report: {report['target']}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]
    incomplete = completeness_line(report)
    if incomplete:
        parts.append(f'<p class="banner">{escape(incomplete)}</p>')
    parts.append(
        f"<p>{len(report['cells'])} cells, {report['launches']} server launches, {report['wall_s']:.1f} s wall; {escape(count_line(report))}"
        + (f"; generated {escape(str(report['generated_at']))}" if report.get("generated_at") else "")
        + "</p>"
    )
    versions = versions_line(report)
    if versions:
        parts.append(f'<p class="meta">Versions: {escape(versions)}</p>')
    machine = report.get("machine")
    if isinstance(machine, Mapping):
        parts.append('<p class="meta">Machine: ' + escape(", ".join(f"{k} {v}" for k, v in machine.items() if v is not None)) + "</p>")
    grid = _grid(report["cells"])
    if grid:
        parts += ["<h2>Verdict matrix</h2>", grid]
    parts += ["<h2>Cells</h2>", _table(report["cells"])]
    parts += _perf(report["cells"])
    parts += _reuse(report["cells"])
    if report.get("disagg"):
        parts += ["<h2>PD disaggregation</h2>", _table(report["disagg"])]
    if report.get("pool") is not None:
        parts += ["<h2>Pool tier</h2>", f"<pre>{escape(json.dumps(report['pool'], indent=2))}</pre>"]
    every = list(report["cells"]) + list(report.get("disagg", []))
    for status, heading in (("fail", "Failures"), ("error", "Errors"), ("skip", "Skipped")):
        rows = reasons(every, status)
        if rows:
            items = "".join(f"<li><code>{escape(c)}</code> {escape(k)}: {escape(r)}</li>" for c, k, r in rows)
            parts += [f"<h2>{heading}</h2>", f"<ul>{items}</ul>"]
    hits = bug_hits(report)
    if hits:
        items = "".join(f'<li><a href="{escape(h.folder)}"><code>{escape(h.id)}</code></a>: {escape(h.summary)} ({escape(h.bracket)}); '
                        f"explained: {escape(', '.join(h.where))}; replay <code>{escape(h.replay)}</code>; "
                        f"reproduce: <code>{escape(h.reproduce)}</code></li>" for h in hits)
        parts += ["<h2>Known SGLang bugs hit</h2>", f"<ul>{items}</ul>"]
    idle = [c for c in every if not_applicable(c)]
    if idle:
        items = "".join(f"<li><code>{escape(c['id'])}</code>: {escape(str(c['not_applicable']))}</li>" for c in idle)
        parts += ["<h2>Not applicable</h2>", f"<ul>{items}</ul>"]
    unbound = list(report.get("unbound_failures") or [])
    if unbound:
        items = "".join(f"<li><code>{escape(r['nodeid'])}</code> ({escape(r['when'])}): {escape(r['reason'])}</li>" for r in unbound)
        parts += ["<h2>Failures outside any cell</h2>", f"<ul>{items}</ul>"]
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
        tds = [f"<td><code>{escape(cell['id'])}</code></td>", f"<td>{escape(model_label(cell))}</td>"]
        tds += [f"<td>{escape(str(cell.get(k, '')))}</td>" for k in ("strategy", "fault")]
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


def _perf(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = perf_rows(cells)
    if not rows:
        return []
    note = f'<p class="meta">Engine: {escape("; ".join(engines(cells)))}. Ratios are taken inside this run (plot below); compare judges them.</p>'
    return ["<h2>Performance</h2>", note, _rows_table(rows)]


def _reuse(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    rows = reuse_rows(cells)
    if not rows:
        return []
    return ["<h2>Reuse efficiency</h2>", f'<p class="meta">{escape(REUSE_NOTE)}</p>', _rows_table(rows)]


def _rows_table(rows: Sequence[Sequence[str]]) -> str:
    """A table whose first row is its head."""
    head = "".join(f"<th>{escape(h)}</th>" for h in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _grid(cells: Sequence[Mapping[str, Any]]) -> str:
    """Model x strategy; each square lists its cells with a chip per check (title: numbers/reason)."""
    models, strategies, groups = matrix_groups(cells)
    if not models:
        return ""
    head = "".join(f"<th>{escape(h)}</th>" for h in ("model", *strategies))
    rows = []
    for m in models:
        tds = [f"<th>{escape(m)}</th>"]
        for s in strategies:
            members = groups.get((m, s), [])
            if not members:
                tds.append('<td title="not in this run"></td>')
                continue
            worst = max((cell_status(c) for c in members), key=lambda st: {"fail": 3, "error": 2, "pass": 1, "skip": 0}.get(st, 0))
            lines = []
            for cell in members:
                chips = "".join(
                    f'<span class="chip {v["status"]}" title="{escape(name)}: {escape(v["status"])}'
                    f'{escape(": " + (v.get("reason") or key_numbers(name, v)))}">{escape(name)}</span>'
                    for name, v in cell["checks"].items()
                )
                lines.append(f'<div class="sq"><code>{escape(variant_label(cell))}</code> {chips}</div>')
            tds.append(f'<td class="{worst}">' + "".join(lines) + "</td>")
        rows.append("<tr>" + "".join(tds) + "</tr>")
    return f'<table class="grid"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _plot(plot: Plot, base_dir: Path) -> str:
    head = f"<h3>{escape(plot.title)}</h3>"
    if plot.path is None:
        return f'<div class="plot">{head}<p class="noplot">{escape(plot.note or "no data")}</p></div>'
    src = Path(os.path.relpath(plot.path, base_dir)).as_posix()
    return f'<div class="plot">{head}<img src="{escape(src)}" alt="{escape(plot.title)}"></div>'
