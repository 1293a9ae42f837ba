"""report.md: completeness, counts and versions, the verdict matrix (model x strategy), the
per-cell table (cell x check -> status and key numbers) and every non-pass reason."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from conformance.report.known_bugs import bug_hits
from conformance.report.perf import engines, perf_rows
from conformance.report.reuse import NOTE as REUSE_NOTE, reuse_rows
from conformance.report.schema import (
    STATUSES,
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
from conformance.matrix.strategy import NAMES as STRATEGY_ORDER

_BADGE = {"pass": "pass", "fail": "**FAIL**", "skip": "skip", "error": "**ERROR**"}
_MARK = {"pass": "✓", "fail": "✗", "skip": "–", "error": "!"}


def render_markdown(report: Mapping[str, Any]) -> str:
    """The whole report.md text for a validated schema-1 report."""
    lines = [f"# hybrid-conformance report: target `{report['target']}`", ""]
    incomplete = completeness_line(report)
    if incomplete:
        lines += [f"**{_inline(incomplete)}**", ""]
    lines += [
        f"{len(report['cells'])} cells, {report['launches']} server launches, {report['wall_s']:.1f} s wall; {count_line(report)}",
        "",
    ]
    versions = versions_line(report)
    if versions:
        lines += [f"Versions: {_inline(versions)}", ""]
    grid = verdict_matrix(report["cells"])
    if grid:
        lines += ["## Verdict matrix", "", *grid, "", "## Cells", ""]
    lines += summary_table(report["cells"])
    lines += perf_section(report["cells"])
    lines += reuse_section(report["cells"])
    if report.get("disagg"):
        lines += ["", "## PD disaggregation", "", *summary_table(report["disagg"])]
    if report.get("pool") is not None:
        lines += ["", "## Pool tier", "", *_pool_section(report["pool"])]
    every = list(report["cells"]) + list(report.get("disagg", []))
    for status, heading in (("fail", "Failures"), ("error", "Errors"), ("skip", "Skipped")):
        rows = reasons(every, status)
        if rows:
            lines += ["", f"## {heading}", ""] + [f"- `{cid}` {check}: {_inline(reason)}" for cid, check, reason in rows]
    hits = bug_hits(report)
    if hits:
        lines += ["", "## Known SGLang bugs hit", ""] + [
            f"- [`{h.id}`]({h.folder}): {_inline(h.summary)} ({h.bracket}); explained: {', '.join(f'`{w}`' for w in h.where)}; "
            f"replay `{h.replay}`; reproduce: `{h.reproduce}`" for h in hits]
    idle = [c for c in every if not_applicable(c)]
    if idle:
        lines += ["", "## Not applicable", ""] + [f"- `{c['id']}`: {_inline(str(c['not_applicable']))}" for c in idle]
    unbound = list(report.get("unbound_failures") or [])
    if unbound:
        lines += ["", "## Failures outside any cell", ""] + [f"- `{r['nodeid']}` ({r['when']}): {_inline(r['reason'])}" for r in unbound]
    return "\n".join(lines) + "\n"


def perf_section(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The cells' perf blocks as one table (medians; ratios inside this run), engines named."""
    rows = perf_rows(cells)
    if not rows:
        return []
    return ["", "## Performance", "", f"Engine: {_inline('; '.join(engines(cells)))}. Ratios are taken inside this run; `compare` judges them.", "",
            *_rows_table(rows)]


def reuse_section(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """The cells' reuse efficiency as one table (``conformance/report/reuse.py``)."""
    rows = reuse_rows(cells)
    if not rows:
        return []
    return ["", "## Reuse efficiency", "", REUSE_NOTE, "", *_rows_table(rows)]


def _rows_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Markdown table lines; the first row is the head."""
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]), *("| " + " | ".join(_inline(c) for c in r) + " |" for r in rows[1:])]


def matrix_groups(cells: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], list[Mapping[str, Any]]]]:
    """(model labels, strategies, {(model, strategy): cells}) in first-seen order."""
    models: list[str] = []
    strategies: list[str] = []
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for cell in cells:
        if not_applicable(cell) or not cell.get("strategy"):
            continue
        m, s = model_label(cell), str(cell["strategy"])
        models += [m] if m not in models else []
        strategies += [s] if s not in strategies else []
        groups.setdefault((m, s), []).append(cell)
    strategies.sort(key=lambda x: STRATEGY_ORDER.index(x) if x in STRATEGY_ORDER else len(STRATEGY_ORDER))
    return models, strategies, groups


def verdict_matrix(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown: one row per model, one column per strategy; each square lists its cells
    (page, interval, fault, variant) with one mark per check (✓ pass, ✗ fail, ! error, – skip)."""
    models, strategies, groups = matrix_groups(cells)
    if not models:
        return []
    out = ["| model | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
    for m in models:
        row = [m]
        for s in strategies:
            entries = []
            for cell in groups.get((m, s), []):
                marks = " ".join(f"{_MARK.get(v['status'], '?')}{name}" for name, v in cell["checks"].items())
                entries.append(f"{_BADGE[cell_status(cell)]} {variant_label(cell)}: {marks}")
            row.append("<br>".join(entries))
        out.append("| " + " | ".join(_inline(c) for c in row) + " |")
    out.append("")
    out.append("Marks: " + ", ".join(f"{_MARK[s]} {s}" for s in STATUSES))
    return out


def summary_table(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown table lines: one row per cell, one column per check present in the run."""
    cells = [c for c in cells if not not_applicable(c)]
    checks = check_names(cells)
    head = ["cell", "model", "strategy", "fault", *checks]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        row = [f"`{cell['id']}`", model_label(cell), *(str(cell.get(k, "")) for k in ("strategy", "fault"))]
        for name in checks:
            verdict = cell["checks"].get(name)
            if verdict is None:
                row.append("")
                continue
            nums = key_numbers(name, verdict)
            row.append(_BADGE[verdict["status"]] + (f" {nums}" if nums else ""))
        out.append("| " + " | ".join(_inline(c) for c in row) + " |")
    return out


def reasons(cells: Sequence[Mapping[str, Any]], status: str) -> list[tuple[str, str, str]]:
    """(cell id, check, reason) for every verdict with ``status``, in table order."""
    return [
        (cell["id"], name, verdict.get("reason", ""))
        for cell in cells
        for name, verdict in cell["checks"].items()
        if verdict["status"] == status
    ]


def _pool_section(pool: Any) -> list[str]:
    if isinstance(pool, list) and all(isinstance(r, Mapping) and "status" in r for r in pool):
        out = ["| test | status | reason |", "|---|---|---|"]
        for r in pool:
            name = r.get("name") or r.get("id") or "?"
            out.append(f"| `{_inline(str(name))}` | {_BADGE.get(r['status'], r['status'])} | {_inline(str(r.get('reason', '')))} |")
        return out
    return ["```json", json.dumps(pool, indent=2), "```"]


def _inline(text: str) -> str:
    """Text safe inside one Markdown table cell or list item."""
    return text.replace("|", "\\|").replace("\n", " ")
