"""compare: what got worse between two report.json files (old = baseline, new = candidate).

Regression kinds, one row each:

- ``status``   a check went pass -> skip, pass -> fail or skip -> fail, or a check the old
  run did not have fails (a ``teardown`` finding pools not idle);
- ``error``    a check of the new run errored (it did not complete: nothing was compared);
- ``missing``  a cell (or a check a cell ran) of the old run is absent from the new;
- ``incomplete`` the new run says it did not run everything it selected (``complete: false``);
- ``kl``       new top-k KL mean > max(old value, noise floor) * ``kl_factor``;
- ``accuracy`` new GSM8K accuracy < the old run's Wilson lower bound;
- ``launches`` more server launches for the same or fewer cells;
- ``wall``     wall time up by more than ``wall_factor`` and by more than ``wall_min_s``;
- ``perf``     a ratio of a cell's ``perf`` block got worse by more than ``perf_threshold``
  (relative; default per ratio kind, ``conformance.report.perf.DEFAULT_THRESHOLDS``) and
  outside the measured noise (old and new intervals do not overlap).

Pure: no I/O besides :func:`compare_files`, which loads both files first.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from conformance.report.perf import note_of, ratio_changes
from conformance.report.schema import load_report, validate_report

_RANK = {"fail": 0, "error": 1, "skip": 1, "pass": 2}
KL_METRIC = "topk_kl_mean"


# The name the CLI imports: load and validate one report.json (one ReportError line on failure).
load_report_file = load_report


@dataclass(frozen=True)
class CompareRow:
    """One thing that got worse: where (``cell``/``check``, ``-`` for run-wide), old and new."""

    kind: str
    cell: str
    check: str
    old: str
    new: str
    note: str


@dataclass(frozen=True)
class CompareResult:
    rows: tuple[CompareRow, ...]
    compared_cells: int
    added_cells: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def regressed(self) -> bool:
        return bool(self.rows)


def compare_reports(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    *,
    kl_factor: float = 2.0,
    wall_factor: float = 1.5,
    wall_min_s: float = 30.0,
    perf_threshold: float | None = None,
) -> CompareResult:
    """Rows for every regression of ``new`` against ``old`` (both validated schema-1 reports)."""
    validate_report(old, "old report")
    validate_report(new, "new report")
    rows: list[CompareRow] = []
    notes: list[str] = []
    if old["target"] != new["target"]:
        notes.append(f"targets differ (old {old['target']}, new {new['target']}): numbers may not be comparable")
    old_cells = _by_id(old)
    new_cells = _by_id(new)
    for cid, old_cell in old_cells.items():
        if not old_cell["checks"]:
            continue  # nothing ran there before (e.g. not applicable): nothing to lose
        new_cell = new_cells.get(cid)
        if new_cell is None:
            rows.append(CompareRow("missing", cid, "-", "present", "absent", "cell not run"))
            continue
        for check, old_v in old_cell["checks"].items():
            new_v = new_cell["checks"].get(check)
            if new_v is None:
                rows.append(CompareRow("missing", cid, check, old_v["status"], "absent", "check not run"))
                continue
            rows += _status_row(cid, check, old_v, new_v)
            if check == "kl":
                rows += _kl_rows(cid, old_v, new_v, kl_factor)
            elif check == "gsm8k":
                rows += _accuracy_rows(cid, old_v, new_v)
        for check, new_v in new_cell["checks"].items():  # e.g. a teardown that now finds pools not idle
            if check not in old_cell["checks"] and new_v["status"] == "fail":
                rows.append(CompareRow("status", cid, check, "absent", "fail", new_v.get("reason", "")))
    rows += _error_rows(new_cells)
    rows += _perf_rows(old_cells, new_cells, perf_threshold)
    rows += _run_rows(old, new, wall_factor, wall_min_s)
    added = tuple(cid for cid in new_cells if cid not in old_cells)
    compared = sum(1 for cid, cell in old_cells.items() if cid in new_cells and cell["checks"])
    return CompareResult(tuple(rows), compared, added, tuple(notes))


def _perf_rows(old_cells: Mapping[str, Mapping[str, Any]], new_cells: Mapping[str, Mapping[str, Any]], threshold: float | None) -> list[CompareRow]:
    return [
        CompareRow("perf", c.cell, c.name, f"{c.old:.3g}", f"{c.new:.3g}", note_of(c))
        for c in ratio_changes(old_cells, new_cells, threshold)
        if c.flagged
    ]


def compare_files(old_path: str | Path, new_path: str | Path, **thresholds: float | None) -> CompareResult:
    """Load both report.json files (a missing/malformed one is one ``ReportError`` line) and compare."""
    return compare_reports(load_report(old_path), load_report(new_path), **thresholds)


def _by_id(report: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    cells = list(report["cells"]) + [dict(c, id=f"disagg:{c['id']}") for c in report.get("disagg", [])]
    return {c["id"]: c for c in cells}


def _error_rows(new_cells: Mapping[str, Mapping[str, Any]]) -> list[CompareRow]:
    """Every errored check of the new run: it compared nothing, so it cannot count as unchanged."""
    return [
        CompareRow("error", cid, check, "-", "error", v.get("reason", ""))
        for cid, cell in new_cells.items()
        for check, v in cell["checks"].items()
        if v["status"] == "error"
    ]


def _status_row(cid: str, check: str, old_v: Mapping[str, Any], new_v: Mapping[str, Any]) -> list[CompareRow]:
    before, after = old_v["status"], new_v["status"]
    if after == "error" or _RANK[after] >= _RANK[before]:  # errors get their own row
        return []
    return [CompareRow("status", cid, check, before, after, new_v.get("reason", ""))]


def _number(verdict: Mapping[str, Any], key: str) -> float | None:
    value = (verdict.get("metrics") or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _kl_rows(cid: str, old_v: Mapping[str, Any], new_v: Mapping[str, Any], factor: float) -> list[CompareRow]:
    before, after = _number(old_v, KL_METRIC), _number(new_v, KL_METRIC)
    if before is None or after is None or "skip" in (old_v["status"], new_v["status"]):
        return []
    floors = [f for f in (_number(old_v, "noise_floor"), _number(new_v, "noise_floor")) if f is not None]
    limit = max([before, *floors]) * factor
    if after <= limit:
        return []
    note = f"> max(old, noise floor) x {factor:g} = {limit:.3g}"
    return [CompareRow("kl", cid, "kl", f"{before:.3g}", f"{after:.3g}", note)]


def _accuracy_rows(cid: str, old_v: Mapping[str, Any], new_v: Mapping[str, Any]) -> list[CompareRow]:
    low, after = _number(old_v, "wilson_low"), _number(new_v, "accuracy")
    if low is None or after is None or "skip" in (old_v["status"], new_v["status"]):
        return []
    if after >= low:
        return []
    before = _number(old_v, "accuracy")
    old_text = f"{before:.3f}" if before is not None else "-"
    return [CompareRow("accuracy", cid, "gsm8k", old_text, f"{after:.3f}", f"< old Wilson lower bound {low:.3f}")]


def _run_rows(old: Mapping[str, Any], new: Mapping[str, Any], wall_factor: float, wall_min_s: float) -> list[CompareRow]:
    rows = []
    if new.get("complete") is False:
        why = "; ".join(new.get("incomplete_reasons") or []) or "not every selected test ran"
        missing = list(new.get("cells_not_run") or []) + list(new.get("cells_partly_run") or [])
        note = why + (f"; cells not (fully) run: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "") if missing else "")
        rows.append(CompareRow("incomplete", "-", "-", "complete" if old.get("complete", True) else "incomplete", "incomplete", note))
    if new["launches"] > old["launches"] and len(new["cells"]) <= len(old["cells"]):
        rows.append(
            CompareRow("launches", "-", "-", str(old["launches"]), str(new["launches"]), f"more server launches for {len(new['cells'])} cells")
        )
    before, after = float(old["wall_s"]), float(new["wall_s"])
    if after > before * wall_factor and after - before > wall_min_s:
        rows.append(CompareRow("wall", "-", "-", f"{before:.0f} s", f"{after:.0f} s", f"> {wall_factor:g}x and > {wall_min_s:g} s slower"))
    return rows


def render_compare(result: CompareResult, *, width: int = 120) -> str:
    """A plain-text table of the regressions (rich, no colour), with a verdict line."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    for note in result.notes:
        console.print(f"note: {note}")
    if result.rows:
        table = Table(title="regressions", title_justify="left")
        for col in ("kind", "cell", "check", "old", "new", "why"):
            table.add_column(col, overflow="fold")
        for r in result.rows:
            table.add_row(r.kind, r.cell, r.check, r.old, r.new, r.note)
        console.print(table)
    if result.added_cells:
        console.print(f"new cells (not compared): {', '.join(result.added_cells)}")
    verdict = f"REGRESSED: {len(result.rows)} regression(s)" if result.regressed else "no regression"
    console.print(f"{verdict} across {result.compared_cells} compared cells")
    return buf.getvalue().rstrip("\n")
