"""The end-of-run summary ``run`` prints: one row per cell (a status column per check),
then the reasons of failures and errors only, then the same counts, completeness and
versions lines as report.md and report.html. Sized to the terminal, not a fixed width."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.report.known_bugs import bug_hits
from conformance.report.schema import check_names, completeness_line, count_line, model_label, not_applicable, variant_label, versions_line

STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "error": "bold dark_orange"}
WORD = {"pass": "pass", "fail": "FAIL", "skip": "skip", "error": "ERROR"}
SHORT = {"prefix_branching": "prefix", "disagg": "pd", "teardown": "tdown"}


def summary_table(report: Mapping[str, Any]) -> Table:
    """Rows: cells; columns: model (the twin where twins ran), strategy, variant, one per check."""
    cells = [c for c in report.get("cells", []) if not not_applicable(c)]
    checks = check_names(cells)
    title = f"target={report.get('target')} launches={report.get('launches')} wall={report.get('wall_s', 0):.0f}s"
    table = Table(title=title, title_justify="left", pad_edge=False, padding=(0, 1))
    table.add_column("model", overflow="fold")
    table.add_column("strategy", overflow="fold")
    table.add_column("cell", overflow="fold")
    for check in checks:
        table.add_column(SHORT.get(check, check), no_wrap=True)
    for cell in cells:
        row = [escape(model_label(cell)), escape(str(cell.get("strategy", "-"))), escape(variant_label(cell))]
        for check in checks:
            v = cell["checks"].get(check)
            row.append(f"[{STYLE.get(v['status'], '')}]{WORD.get(v['status'], v['status'])}[/]" if v else "")
        table.add_row(*row)
    return table


def problem_lines(report: Mapping[str, Any], limit: int = 40) -> list[str]:
    """``cell check STATUS: reason`` for every fail and error (and not-applicable cells, once)."""
    out = []
    for cell in report.get("cells", []):
        if not_applicable(cell):
            out.append(f"{cell['id']}: n/a: {cell['not_applicable']}")
            continue
        for check, v in cell.get("checks", {}).items():
            if v.get("status") in ("fail", "error"):
                out.append(f"{cell['id']} {check} {WORD[v['status']]}: {v.get('reason', '')}")
    for row in report.get("unbound_failures") or []:
        out.append(f"{row['nodeid']} ({row['when']}): {row['reason']}")
    return out[:limit] + ([f"... and {len(out) - limit} more in report.md"] if len(out) > limit else [])


def print_summary(report: Mapping[str, Any], report_dir: Path, console: Console | None = None) -> None:
    console = console or Console(width=shutil.get_terminal_size((120, 40)).columns, highlight=False)
    console.print(summary_table(report))
    for line in problem_lines(report):
        console.print(f"[bold red]-[/] {escape(line)}", overflow="fold")
    for hit in bug_hits(report):
        console.print(f"[bold magenta]-[/] {escape(hit.line())}; folder {escape(str(report_dir / hit.folder))}", overflow="fold")
    incomplete = completeness_line(report)
    if incomplete:
        console.print(f"[bold dark_orange]{escape(incomplete)}[/]", overflow="fold")
    console.print(f"{count_line(report)}; launches={report.get('launches')}")
    versions = versions_line(report)
    if versions:
        console.print(escape(versions), overflow="fold", style="dim")
    console.print(f"report: {report_dir / 'report.json'} (and report.md, report.html, junit.xml)")
