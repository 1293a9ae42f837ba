"""The seeded slowdown of real SGLang (``track_path_slowdown``): in the fault catalogue like
the others, hooked on the track path only (so the model's no_buffer cell is untouched),
planned by ``mutants`` with the perf suite first, and scored there by ``compare`` against
the clean run of the same cells (a slowdown fails no check)."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.mutants import catalogue, runs
from conformance.sglang_plugins.faults import catalogue as faults
from conformance.sglang_plugins.faults import track_path_slowdown as slowdown
from test_report_perf import run_report


def test_the_slowdown_is_a_catalogued_fault_on_the_track_path() -> None:
    fault = faults.get_fault("track_path_slowdown")
    assert fault is slowdown.FAULT and fault.suites == ("perf",) and fault.strategies == ("extra_buffer",)
    assert {h.target for h in fault.hooks} == {slowdown.PREFILL_TARGET, slowdown.DECODE_TARGET}
    assert all(h.how == "before" for h in fault.hooks)


def test_its_hooks_sleep_and_fire_and_change_no_argument(monkeypatch) -> None:
    slept: list[float] = []
    fired: list[dict] = []
    monkeypatch.setattr(slowdown.time, "sleep", slept.append)
    monkeypatch.setattr(slowdown, "fired", lambda name, **kw: fired.append({"name": name, **kw}))
    assert slowdown.slow_prefill_track(object(), object()) is None  # BEFORE hook: arguments unchanged
    assert slowdown.slow_decode_track(object()) is None
    assert slept == [slowdown.PREFILL_SLEEP_S, slowdown.DECODE_SLEEP_S]
    assert [f["where"] for f in fired] == ["prefill", "decode"] and {f["name"] for f in fired} == {"track_path_slowdown"}


def test_mutants_runs_perf_first_and_the_clean_run_of_its_cell_times_it_too() -> None:
    plans = catalogue.sglang_cpu_plans()
    plan = plans["track_path_slowdown"]
    assert plan.suites[0] == "perf" and plan.fault_env == "HYBRID_CONFORMANCE_SGLANG_FAULT"
    # the ratios compare flags (ttft_vs_no_buffer, decode_vs_no_buffer) need the no_buffer sibling in the run
    assert plan.strategies.split(",") == ["no_buffer", "extra_buffer"], plan.strategies
    same_cell = [p for p in plans.values() if p.key == plan.key]
    assert all("perf" in p.suites for p in same_cell)  # whichever plan runs the cell's clean run


def test_mutants_scores_a_slowdown_by_compare_against_the_clean_run(tmp_path: Path) -> None:
    clean, slow, same = tmp_path / "clean" / "k", tmp_path / "fault" / "k", tmp_path / "same" / "k"
    for folder, report in ((clean, run_report()), (slow, run_report(extra_slowdown=0.3)), (same, run_report())):
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(json.dumps(report))
    caught = runs.perf_regressions(clean, slow)
    assert caught and all(line.startswith("perf (compare): ") for line in caught)
    assert any("extra_buffer-p1-t256 ttft_vs_no_buffer" in line for line in caught)
    assert runs.perf_regressions(clean, same) == []
    assert runs.perf_regressions(tmp_path / "missing", slow) == []  # no clean run: nothing to compare with
