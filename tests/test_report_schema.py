"""report.json schema 1: build_report from verdicts, validation errors, loading from disk."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.records import Verdict
from conformance.report.schema import CHECK_METRICS, ReportError, build_report, dump_report, load_report, validate_report

DATA = Path(__file__).parent / "data" / "reports"


def _cells():
    matrix = load_matrix()
    cell = matrix.select(strategies=["extra_buffer_lazy"], faults=["none"])[0]
    checks = {
        "kl": Verdict("kl", "pass", {"tokens": 12, "k3_mean": 1e-4, "topk_kl_mean": float("nan")}).to_json(),
        "leaks": Verdict("leaks", "fail", {"mamba_used_at_idle": 3}, reason="3 slots leaked").to_json(),
        "gsm8k": Verdict("gsm8k", "skip"),  # a Verdict object is accepted too
    }
    return [dict(cell.describe(), checks=checks)]


def test_build_report_fills_contract_metrics_and_reasons():
    report = build_report("reference", 1, 12.5, _cells())
    assert report["schema"] == 1 and report["target"] == "reference" and report["launches"] == 1
    checks = report["cells"][0]["checks"]
    assert set(checks["kl"]["metrics"]) >= set(CHECK_METRICS["kl"])
    assert checks["kl"]["metrics"]["topk_kl_mean"] is None  # NaN became null: strict JSON
    assert checks["kl"]["metrics"]["noise_floor"] is None
    assert checks["leaks"]["reason"] == "3 slots leaked"
    assert checks["gsm8k"]["reason"] == "no reason recorded"
    assert report["summary"] == {"pass": 1, "fail": 1, "skip": 1, "error": 0}
    assert json.loads(dump_report(report)) == report
    for key in ("page_size", "track_interval", "cache_variant", "tier"):
        assert key in report["cells"][0]


def test_build_report_converts_tuples_and_numpy_scalars():
    np = pytest.importorskip("numpy")
    cells = _cells()
    cells[0]["checks"]["kl"]["details"] = {"per_position": [(0, np.float32(0.5)), (1, np.float64(0.25))]}
    cells[0]["checks"]["kl"]["metrics"]["tokens"] = np.int64(2)
    report = build_report("reference", 1, 1.0, cells)
    kl = report["cells"][0]["checks"]["kl"]
    assert kl["details"]["per_position"] == [[0, 0.5], [1, 0.25]]
    assert type(kl["metrics"]["tokens"]) is int


def test_recorded_fixtures_validate():
    for name in ("clean", "regressed"):
        report = load_report(DATA / name / "report.json")
        assert report["cells"], name


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.update(schema=2), "unsupported schema 2"),
        (lambda r: r.pop("wall_s"), "missing required key 'wall_s'"),
        (lambda r: r.update(launches=-1), "launches: must be a non-negative integer"),
        (lambda r: r["cells"][0]["checks"]["kl"].update(status="ok"), "status must be one of pass, fail, skip"),
        (lambda r: r["cells"][0]["checks"]["leaks"].pop("reason"), "a fail needs a 'reason'"),
        (lambda r: r["cells"][0]["checks"]["kl"]["metrics"].pop("k3_mean"), "missing metric 'k3_mean'"),
        (lambda r: r["cells"][0]["checks"]["kl"]["metrics"].update(k3_mean="low"), "metric 'k3_mean' must be a number"),
        (lambda r: r["cells"].append(copy.deepcopy(r["cells"][0])), "duplicate cell id"),
        (lambda r: r["cells"][0].update(family=3), "'family' must be a string"),
        (lambda r: r["cells"][0].pop("id"), "'id' must be a non-empty string"),
    ],
)
def test_validate_names_the_broken_field(mutate, message):
    report = build_report("reference", 1, 1.0, _cells())
    mutate(report)
    with pytest.raises(ReportError, match=message) as err:
        validate_report(report, "x.json")
    assert str(err.value).startswith("x.json: ") and "\n" not in str(err.value)


def test_load_report_missing_and_malformed_are_one_line(tmp_path):
    with pytest.raises(KitError, match="report file not found"):
        load_report(tmp_path / "nope" / "report.json")
    bad = tmp_path / "report.json"
    bad.write_text('{"schema": 1, "cells": [')
    with pytest.raises(KitError, match=r"not valid JSON \(line 1"):
        load_report(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(KitError, match="expected a JSON object"):
        load_report(tmp_path)  # a directory means its report.json


def test_unknown_checks_are_carried_not_rejected():
    cells = _cells()
    cells[0]["checks"]["disagg"] = {"status": "pass", "metrics": {"transfers": 4}}
    report = build_report("sglang", 2, 3.0, cells, disagg=[], pool=[{"name": "t", "status": "pass"}])
    assert report["cells"][0]["checks"]["disagg"]["metrics"] == {"transfers": 4}
    assert report["pool"] == [{"name": "t", "status": "pass"}] and report["disagg"] == []


def test_duplicate_ids_from_the_plugin_are_merged_and_not_applicable_cells_kept():
    cells = _cells()
    cid = cells[0]["id"]
    cells.append({"id": cid, "not_applicable": "hicache needs target sglang", "checks": {
        "prefix_branching": Verdict("prefix_branching", "pass", {"requests": 3}).to_json()}})
    cells.append({"id": "granite-4.0-h-tiny-extra_buffer-p64-t256-hicache", "not_applicable": "hicache needs target sglang", "checks": {}})
    report = build_report("reference", 1, 1.0, cells)
    assert [c["id"] for c in report["cells"]] == [cid, "granite-4.0-h-tiny-extra_buffer-p64-t256-hicache"]
    merged = report["cells"][0]
    assert set(merged["checks"]) == {"kl", "leaks", "gsm8k", "prefix_branching"} and merged["model"] == "qwen3-next-80b"
    assert report["cells"][1]["not_applicable"] == "hicache needs target sglang"
