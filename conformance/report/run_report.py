"""Turn the plugin's run state (outcomes, verdicts per cell, launches) into the report files.

Besides the cells, report.json records whether the run is ``complete`` (and if not,
why and which cells did not run), test counts as pytest and junit.xml count them, the
versions (kit, SGLang, torch, transformers), the twins' weight hashes, the machine,
and per cell a ``server`` block (``version`` from ``/server_info``, liveness at the end).
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Mapping

from conformance.records import Verdict, merge
from conformance.report.versions import versions
from conformance.targets.registry import target_for
from conformance.errors import KitError
from conformance.reference import twins
from conformance.report.files import write_report
from conformance.report.schema import build_report

#: Precedence when one check of a cell has several outcomes: a finding beats an error
#: (the check did not complete), which beats a pass, which beats a skip.
#: Where ``run`` tells the pytest it starts that its preflight's record lies (report.json's ``preflight``).
PREFLIGHT_FILE_ENV = "HYBRID_CONFORMANCE_PREFLIGHT_FILE"
RANK = {"fail": 3, "error": 2, "pass": 1, "skip": 0}
#: Detail keys that hold one curve per recording; merged as a list of series, not overwritten.
SERIES_KEYS = ("per_position",)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (list, dict, tuple, str)) and not value)


def merge_check(check: str, filed: list[Mapping[str, Any]], synthesized: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One verdict from the verdicts filed for a check and the outcomes pytest reported.

    Details are united without letting an empty value (a scenario that recorded no
    timeline) hide a recorded one; per-position curves are kept per recording in
    ``details["series"]`` so no scenario's curve is lost."""
    raw = [*filed, *synthesized]
    verdicts = [
        Verdict(check, v["status"] if v["status"] != "error" else "skip", v.get("metrics") or {}, v.get("reason", ""),
                {k: x for k, x in (v.get("details") or {}).items() if not _empty(x)})
        for v in raw
    ]
    out = merge(check, verdicts).to_json()
    status = max((v["status"] for v in raw), key=lambda s: RANK.get(s, 0)) if raw else "skip"
    out["status"] = status
    if status != "pass":
        reasons = [v.get("reason", "") for v in raw if v["status"] == status and v.get("reason")]
        out["reason"] = "; ".join(dict.fromkeys(reasons)) or out.get("reason") or "no reason recorded"
    else:
        out.pop("reason", None)
    series = [
        {"label": _series_label(v, i), "per_position": v["details"]["per_position"]}
        for i, v in enumerate(filed)
        if not _empty((v.get("details") or {}).get("per_position"))
    ]
    if len(series) > 1:
        out.setdefault("details", {})["series"] = series
    bounds = sorted({b for v in filed for b in (v.get("details") or {}).get("boundaries") or [] if isinstance(b, (int, float))})
    if bounds:
        out.setdefault("details", {})["boundaries"] = bounds
    return out


def _series_label(verdict: Mapping[str, Any], index: int) -> str:
    rows = (verdict.get("details") or {}).get("sequences") or []
    scenario = rows[0].get("scenario") if rows and isinstance(rows[0], Mapping) else None
    return str(scenario or f"recording {index + 1}")


def collect_cells(outcomes: Any, not_applicable: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """One dict per cell: its description plus {"checks": {name: verdict json}}."""
    out = []
    for cid in dict.fromkeys([*outcomes.verdicts, *outcomes.synthesized]):
        cell = dict(outcomes.cells.get(cid) or {"id": cid})
        filed = outcomes.verdicts.get(cid, {})
        synth = outcomes.synthesized.get(cid, {})
        cell["checks"] = {check: merge_check(check, filed.get(check, []), synth.get(check, [])) for check in dict.fromkeys([*filed, *synth])}
        if cid in outcomes.servers:
            cell["server"] = dict(outcomes.servers[cid])
        reason = _skipped_as_not_applicable(cell["checks"])
        if reason:  # every test of the cell skipped as not applicable (e.g. under xdist)
            cell.update(not_applicable=reason, checks={})
        out.append(cell)
    for cid, reason in (not_applicable or {}).items():
        known = next((c for c in out if c["id"] == cid), None)
        if known is None:
            out.append({"id": cid, "not_applicable": reason, "checks": {}})
        else:  # its tests were skipped as not applicable: the cell is n/a, not a set of skips
            known.update(not_applicable=reason, checks={})
    return out


#: The skip reason of a test whose cell is not applicable (``conformance.plugin``).
NOT_APPLICABLE_SKIP = "not applicable: "


def _skipped_as_not_applicable(checks: Mapping[str, Any]) -> str | None:
    """The reason when every check of a cell was skipped as not applicable (else None)."""
    reasons = [str(v.get("reason", "")) for v in checks.values()]
    if not reasons or any(v.get("status") != "skip" for v in checks.values()):
        return None
    found = [r.split(NOT_APPLICABLE_SKIP, 1)[1] for r in reasons if NOT_APPLICABLE_SKIP in r]
    return found[0] if len(found) == len(reasons) else None


def known_bugs_seen(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every failing check a known SGLang bug explains (``fixtures/known_bugs.toml``): the
    run reports it as "known SGLang bug, still present", not as a new finding."""
    out = []
    for cell in cells:
        for check, v in (cell.get("checks") or {}).items():
            bug = (v.get("details") or {}).get("known_bug")
            if v.get("status") == "fail" and bug:
                out.append({"cell": cell["id"], "check": check, **bug})
    return out


def run_facts(*, target: str, cells: Iterable[Any], twins: bool = False) -> dict[str, Any]:
    """``versions``, ``machine`` and ``twins`` (name -> spec hash and weight sha256) of a run."""

    facts: dict[str, Any] = {"versions": versions(), "machine": machine()}
    if target_for(target).serves_twins(twins):
        facts["twins"] = twin_hashes(sorted({c.model.twin for c in cells}))
    return facts


def machine() -> dict[str, Any]:
    """Where the run happened: host, OS, CPU, cores, memory, the GPUs CUDA exposes."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:  # pragma: no cover - psutil is a dependency
        pass
    return info


def twin_hashes(names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per twin: its spec hash and the sha256 of its weights (null until generated)."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            spec = twins.load_spec(name)
        except KitError as e:
            out[name] = {"error": str(e)}
            continue
        folder = twins.twin_folder(spec)
        weights = sorted(folder.glob("*.safetensors"))
        out[name] = {
            "spec_hash": spec.spec_hash,
            "weights_sha256": _sha256(weights) if weights else None,
            "path": str(folder),
        }
    return out


def _sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


#: The incomplete reasons of a run that tested nothing (every check skipped, or every
#: selected cell not applicable): it is red, never green.  Both start with NOTHING_JUDGED_PREFIX.
NOTHING_JUDGED_PREFIX = "nothing was judged"
NOTHING_JUDGED = f"{NOTHING_JUDGED_PREFIX}: every check of every cell skipped"
NOTHING_APPLIES = f"{NOTHING_JUDGED_PREFIX}: every selected cell is not applicable"


def nothing_judged(cells: list[dict[str, Any]]) -> str | None:
    """Why no verdict was reached, when cells were selected and none has a pass, fail or
    error (not-applicable cells have no checks); None when something was judged."""
    if not cells:
        return None  # no cell at all: "no test was selected" / "no matrix cell matches" say so
    statuses = [v.get("status") for c in cells for v in (c.get("checks") or {}).values()]
    if any(s != "skip" for s in statuses):
        return None
    return NOTHING_JUDGED if statuses else NOTHING_APPLIES


def completeness(state: Any, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """``complete`` and, when false, why and which cells did not (fully) run."""
    outcomes = state.outcomes
    reasons: list[str] = []
    if state.exitstatus == 2:
        reasons.append("interrupted")
    elif state.exitstatus == 3:
        reasons.append("pytest internal error")
    if not outcomes.collected and not outcomes.reported:
        reasons.append("no test was selected")
    missing = outcomes.not_run()
    if missing:
        reasons.append(f"{len(missing)} of {len(outcomes.collected)} selected tests did not run")
    if outcomes.collection_errors:
        reasons.append(f"{len(outcomes.collection_errors)} collection error(s)")
    if outcomes.collected and not any(outcomes.collected.values()):
        reasons.append("no matrix cell matches the selection")
    idle = nothing_judged(cells)
    if idle:
        reasons.append(idle)
    none_ran, partly = outcomes.cells_not_run()
    out: dict[str, Any] = {"complete": not reasons, "cells_not_run": none_ran, "cells_partly_run": partly}
    if reasons:
        out["incomplete_reasons"] = reasons
    return out


def write_run_report(state: Any, *, wall_s: float) -> dict[str, Any]:
    outcomes = state.outcomes
    order = {c.id: i for i, c in enumerate(_matrix_cells(state))}
    cells = sorted(collect_cells(outcomes, state.not_applicable), key=lambda c: order.get(c["id"], len(order)))
    launches = list(outcomes.launches.values())
    report = build_report(target=state.options.target, launches=len(launches), wall_s=wall_s, cells=cells)
    report["launches_by_kind"] = {k: sum(1 for x in launches if x["kind"] == k) for k in sorted({x["kind"] for x in launches})}
    report["distinct_cells_launched"] = len({x["cell"] for x in launches})
    report.update(completeness(state, report["cells"]))
    report["tests"] = outcomes.test_counts()
    report["known_bugs"] = known_bugs_seen(report["cells"])
    if outcomes.unbound:
        report["unbound_failures"] = outcomes.unbound[:50]
    if outcomes.collection_errors:
        report["collection_errors"] = outcomes.collection_errors[:50]
    selected = _selected_cells(state)
    report.update(run_facts(target=state.options.target, cells=selected, twins=state.options.twins))
    report["preflight"] = _preflight(state)
    collected = getattr(state, "collected_at", None)
    report["phases"] = state.phases.to_json(wall_s=wall_s, collection_s=None if collected is None else collected - state.started)
    state.options.report_dir.mkdir(parents=True, exist_ok=True)
    write_report(report, state.options.report_dir)
    return report


def _matrix_cells(state: Any) -> list[Any]:
    try:
        return list(state.get_matrix().cells)
    except Exception:  # a broken matrix was reported at configure time
        return []


def _selected_cells(state: Any) -> list[Any]:
    ids = {c for c in state.outcomes.collected.values() if c} | set(state.outcomes.cells)
    return [c for c in _matrix_cells(state) if c.id in ids]


def _preflight(state: Any) -> list[dict[str, Any]]:
    import json


    path = os.environ.get(PREFLIGHT_FILE_ENV)
    if path and Path(path).is_file():
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            pass
    return [{"name": "tests", "ok": not state.preflight_failures, "text": reason, "hint": ""} for reason in sorted(set(state.preflight_failures.values()))]
