"""report.md: the run's summary table (cell x check -> status and key numbers) and reasons."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from conformance.report.schema import check_names, key_numbers, not_applicable, status_counts

_BADGE = {"pass": "pass", "fail": "**FAIL**", "skip": "skip"}


def render_markdown(report: Mapping[str, Any]) -> str:
    """The whole report.md text for a validated schema-1 report."""
    counts = report.get("summary") or status_counts(list(report["cells"]) + list(report.get("disagg", [])))
    lines = [
        f"# hybrid-conformance report: target `{report['target']}`",
        "",
        f"{len(report['cells'])} cells, {report['launches']} server launches, {report['wall_s']:.1f} s wall; "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in ("pass", "fail", "skip")),
        "",
        *summary_table(report["cells"]),
    ]
    if report.get("disagg"):
        lines += ["", "## PD disaggregation", "", *summary_table(report["disagg"])]
    if report.get("pool") is not None:
        lines += ["", "## Pool tier", "", *_pool_section(report["pool"])]
    every = list(report["cells"]) + list(report.get("disagg", []))
    for status, heading in (("fail", "Failures"), ("skip", "Skipped")):
        rows = reasons(every, status)
        if rows:
            lines += ["", f"## {heading}", ""] + [f"- `{cid}` {check}: {_inline(reason)}" for cid, check, reason in rows]
    idle = [c for c in every if not_applicable(c)]
    if idle:
        lines += ["", "## Not applicable", ""] + [f"- `{c['id']}`: {_inline(str(c['not_applicable']))}" for c in idle]
    return "\n".join(lines) + "\n"


def summary_table(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown table lines: one row per cell, one column per check present in the run."""
    cells = [c for c in cells if not not_applicable(c)]
    checks = check_names(cells)
    head = ["cell", "model", "strategy", "fault", *checks]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        row = [f"`{cell['id']}`", *(str(cell.get(k, "")) for k in ("model", "strategy", "fault"))]
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
