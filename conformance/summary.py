"""The end-of-run summary table (cell, check, status, key numbers) printed by ``run``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

KEY_METRICS = {
    "kl": ("topk_kl_mean", "max_token_kl", "k3_mean", "noise_floor", "hit_fraction"),
    "prefix_branching": ("requests", "hits_expected", "hits_observed", "mismatches"),
    "leaks": ("mamba_used_at_idle", "kv_used_at_idle", "leak_log_lines", "lazy_resident_ratio"),
    "gsm8k": ("n", "accuracy", "wilson_low", "agreement"),
    "disagg": ("agreement", "topk_kl_mean", "mamba_used_at_idle"),
    "programs": ("examples", "seconds", "requests", "hits", "examples_to_failure"),
}
STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "-" if v is None else str(v)


def summary_table(report: dict[str, Any]) -> Table:
    table = Table(title=f"hybrid-conformance: target={report.get('target')} launches={report.get('launches')} wall={report.get('wall_s', 0):.1f}s")
    for col in ("cell", "check", "status", "numbers"):
        table.add_column(col)
    for cell in report.get("cells", []):
        if cell.get("not_applicable"):
            table.add_row(cell["id"], "-", "[yellow]n/a[/]", cell["not_applicable"])
            continue
        for check, v in sorted(cell.get("checks", {}).items()):
            nums = ", ".join(f"{k}={_fmt(v['metrics'].get(k))}" for k in KEY_METRICS.get(check, ()) if k in v.get("metrics", {}))
            if v.get("reason"):
                nums = f"{nums}; {v['reason']}" if nums else v["reason"]
            st = v["status"]
            table.add_row(cell["id"], check, f"[{STYLE.get(st, '')}]{st}[/]", nums)
    return table


def print_summary(report: dict[str, Any], report_dir: Path, console: Console | None = None) -> None:
    console = console or Console(width=200)
    console.print(summary_table(report))
    counts: dict[str, int] = {}
    for cell in report.get("cells", []):
        for v in cell.get("checks", {}).values():
            counts[v["status"]] = counts.get(v["status"], 0) + 1
    console.print(
        f"checks: {counts.get('pass', 0)} pass, {counts.get('fail', 0)} fail, {counts.get('skip', 0)} skip; "
        f"launches={report.get('launches')}; report: {report_dir / 'report.json'}"
    )
