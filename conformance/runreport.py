"""Turn the plugin's run state (verdicts per cell, launches) into the report files."""

from __future__ import annotations

from typing import Any

from conformance.records import Verdict, merge


def collect_cells(state: Any) -> list[dict[str, Any]]:
    """One dict per cell: Cell.describe() plus {"checks": {name: verdict json}} (merged per check)."""
    out = []
    for cid, by_check in state.verdicts.items():
        cell = dict(state.cells[cid])
        checks = {}
        for check, raw in by_check.items():
            verdicts = [Verdict(check, v["status"], v.get("metrics", {}), v.get("reason", ""), v.get("details", {})) for v in raw]
            checks[check] = merge(check, verdicts).to_json()
        cell["checks"] = checks
        out.append(cell)
    for cid, reason in state.not_applicable.items():
        out.append({"id": cid, "not_applicable": reason, "checks": {}})
    return out


def write_run_report(state: Any, *, wall_s: float) -> dict[str, Any]:
    from conformance.report import build_report, write_report

    report = build_report(
        target=state.options.target,
        launches=len(state.launches),
        wall_s=wall_s,
        cells=collect_cells(state),
    )
    report["distinct_cells_launched"] = len(set(state.launches.values()))
    state.options.report_dir.mkdir(parents=True, exist_ok=True)
    write_report(report, state.options.report_dir)
    return report
