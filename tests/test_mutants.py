"""The mutation command: a caught fault is reported with its check and numbers, an
uncaught one fails the command, and the score line comes last."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Callable

import pytest
from rich.console import Console

from conformance.errors import KitError
from conformance.mutants import catalogue, command, runs, scoring
from conformance.mutants.catalogue import MutantPlan

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_caught_by_reads_failing_checks(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps({"cells": [{"checks": {"kl": {"status": "fail", "reason": "top-k KL 1e-3 > 1e-9"}, "leaks": {"status": "pass"}}}]}))
    assert runs._caught_by(tmp_path, "", 1) == ["kl: top-k KL 1e-3 > 1e-9"]
    empty = tmp_path / "none"
    empty.mkdir()
    assert runs._caught_by(empty, "", 0) == []
    assert runs._caught_by(empty, "", 3) == ["pytest exit 3"]


def test_unknown_fault_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(KitError, match=r"--only: unknown fault 'nope'; known: pingpong_leak_on_finish"):
        command.run_mutants(target="reference", only="nope", report_dir=tmp_path)


def test_every_reference_fault_has_a_plan_and_doc() -> None:
    from conformance.reference.faults import FAULTS

    from conformance.reference.pd import PD_FAULTS

    plans = catalogue.reference_plans()
    assert set(plans) == set(FAULTS) | set(PD_FAULTS) and len(FAULTS) >= 12
    assert all(plans[name].suites == ("disagg",) and plans[name].fault_env == "HYBRID_CONFORMANCE_PD_FAULT" for name in PD_FAULTS)
    assert all(len(spec.description) > 40 and spec.real_bug for spec in FAULTS.values())


@pytest.fixture
def gsm8k_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR"):
        monkeypatch.setenv("HYBRID_CONFORMANCE_GSM8K_DIR", str(GSM8K))


def test_fast_reference_subset_catches_and_scores(tmp_path: Path, gsm8k_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two faults on the smallest cell: both caught, by the check that should catch them."""
    small = MutantPlan("qwen3-next/extra_buffer:kl+prefix", suites=("kl", "prefix_branching"), models="qwen3-next", strategies="extra_buffer", stop_at_first=True)
    monkeypatch.setitem(catalogue.CATALOGUES, "reference", catalogue.Catalogue(lambda: {"cached_tokens_overreport": small, "track_boundary_late": small}, catalogue.FAST_REFERENCE))
    console = Console(width=300, record=True)
    code = command.run_mutants(target="reference", only=None, report_dir=tmp_path, console=console)
    text = console.export_text()
    assert code == 0, text
    assert text.rstrip().splitlines()[-1] == "mutation score: 2/2"
    assert "prefix_branching [" in text and "kl [" in text  # each finding with its kind


def test_uncaught_fault_fails_the_command(tmp_path: Path, gsm8k_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault run only on a suite that cannot see it must be reported NOT CAUGHT, exit 1."""
    blind = MutantPlan("qwen3-next/extra_buffer:gsm8k", suites=("gsm8k",), models="qwen3-next", strategies="extra_buffer", stop_at_first=True)
    monkeypatch.setitem(catalogue.CATALOGUES, "reference", catalogue.Catalogue(lambda: {"cached_tokens_underreport": blind}, catalogue.FAST_REFERENCE))
    console = Console(width=300, record=True)
    code = command.run_mutants(target="reference", only=None, report_dir=tmp_path, console=console)
    text = console.export_text()
    assert code == 1
    assert "NOT CAUGHT" in text and text.rstrip().splitlines()[-1] == "mutation score: 0/1"


def test_a_timed_out_run_is_not_caught_and_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutant run that hits its time limit proved nothing: NOT CAUGHT, and its whole
    process group (a grandchild here) is killed."""
    import sys
    import time

    import psutil

    pidfile = tmp_path / "grandchild.pid"
    sleeper = ["import subprocess, sys, time",
               f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); open({str(pidfile)!r}, 'w').write(str(p.pid))",
               "time.sleep(300)"]
    monkeypatch.setattr(runs, "_pytest_argv", lambda plan, report_dir: [sys.executable, "-c", "\n".join(sleeper)])
    plan = MutantPlan("slow", suites=("kl",), timeout_s=3.0)
    t0 = time.monotonic()
    caught = runs.run_plan(plan, "cached_tokens_overreport", tmp_path)
    assert time.monotonic() - t0 < 60
    assert caught.caught is False and caught.timed_out and "not caught" in caught.by[0]
    clean = runs.run_plan(plan, None, tmp_path)
    assert clean.caught is True and clean.timed_out  # a clean run that times out voids the score
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    monkeypatch.setitem(catalogue.CATALOGUES, "reference", catalogue.Catalogue(lambda: {"cached_tokens_overreport": plan}, catalogue.FAST_REFERENCE))
    console = Console(width=300, record=True)
    assert command.run_mutants(target="reference", only=None, report_dir=tmp_path / "all", console=console) == 1
    text = console.export_text()
    assert "NOT CAUGHT (timed out after 3s: not caught)" in text and text.rstrip().splitlines()[-1] == "mutation score: 0/1"


# ------------------------------------------------------------------ real SGLang (sglang-cpu)
def test_every_sglang_fault_has_a_plan_on_few_cells() -> None:
    from conformance.sglang_plugins.faults.catalogue import faults

    plans = catalogue.sglang_cpu_plans()
    assert set(plans) == set(faults()) and len(plans) >= 12
    assert all(p.target == "sglang-cpu" and p.fault_env == "HYBRID_CONFORMANCE_SGLANG_FAULT" and p.stop_at_first for p in plans.values())
    assert all(plans[n].suites[: len(f.suites)] == f.suites for n, f in faults().items())  # its catching suite runs first
    # one clean run per cell vouches for its faults; stop_finish_key_short breaks no_buffer's
    # finish path only, hence a fifth cell; the perf fault's run adds the no_buffer sibling, a sixth;
    # a fault that needs a server option runs on that option's standard-tier cell (one cell per axis fault,
    # nine: mixed chunk, grid, off-grid and sub-chunk chunked prefill, small mamba and KV pools, strip-thinking reasoning,
    # the priority eviction policy, the per-path cap; overlap=on is the plain cell's own);
    # the PD faults on the PD cell, the decode-side one on its transfer-fail cell (SGLang's
    # SGLANG_TEST_DISAGG_FAILURE_PROB, standard tier); the HiCache faults on the hicache variant's nightly cell;
    # the fault only the paired A/B sees (step_slowdown) its own pair of servers; the tree-structure
    # fault (child_under_wrong_key) the standard tier's tree_core=python cell; the retraction fault
    # (retract_leaks_mamba_slot) the nightly forced_retract cell (SGLang's SGLANG_TEST_RETRACT)
    assert len({p.key for p in plans.values()}) <= 20
    decode = plans["pd_decode_failed_transfer_slot_kept"]
    assert decode.faults == "disagg_transfer_fail" and decode.tier == "standard" and "--tier=standard" in runs._pytest_argv(decode, Path("r"))
    hicache = plans["hicache_mamba_state_not_loaded"]
    assert hicache.tier == "nightly" and hicache.suites == ("hicache",) and hicache.keyword == "p1-t256-hicache" and hicache.page_sizes == "1"
    assert plans["hicache_mamba_backup_slot_off"].key == hicache.key
    argv = runs._pytest_argv(hicache, Path("r"))
    assert argv[argv.index("-k") + 1] == "p1-t256-hicache" and "--tier=nightly" in argv
    mixed = plans["mixed_chunk_track_dropped"]
    assert mixed.server_options == "mixed_chunk=on" and mixed.tier == "standard" and "--server-options=mixed_chunk=on" in runs._pytest_argv(mixed, Path("r"))
    cut = plans["chunk_cut_key_past_checkpoint"]
    assert cut.server_options == "chunked_prefill=off-grid" and cut.suites[0] == "prefix_branching"
    assert "--server-options=chunked_prefill=off-grid" in runs._pytest_argv(cut, Path("r"))
    assert plans["stop_finish_key_short"].strategies == "no_buffer"
    assert plans["lazy_alloc_fail_still_inserts"].faults == "lazy_alloc_fail"
    assert plans["mamba2_track_index_global"].models == "nemotron-h"


def test_sglang_fault_that_never_fired_is_not_caught(tmp_path: Path) -> None:
    plan = catalogue.sglang_cpu_plans()["double_free"]
    (tmp_path / "logs").mkdir()
    out = runs._judge_sglang(plan, "double_free", ["leaks: something failed"], 1, tmp_path, 1.0)
    assert not out.caught and out.by[0] == f"never reached: double_free did not fire on {plan.key}"
    (tmp_path / "logs" / "cell.plugins.jsonl").write_text(json.dumps({"plugin": "hybrid_conformance_faults", "status": "fired", "fault": "double_free", "count": 3}) + "\n")
    out = runs._judge_sglang(plan, "double_free", ["leaks: something failed"], 1, tmp_path, 1.0)
    assert out.caught and out.fired == 3


def test_sglang_run_that_times_out_is_not_caught(tmp_path: Path) -> None:
    plan = catalogue.sglang_cpu_plans()["cow_skipped"]
    out = runs._judge_sglang(plan, "cow_skipped", ["pytest exit -1"], -1, tmp_path, 1500.0)
    assert not out.caught and out.by == [f"timed out after 1500s on {plan.key}"]
    assert runs._judge_sglang(plan, None, [], -1, tmp_path, 1500.0).caught  # a clean run that timed out voids the score


def test_a_server_killed_by_its_leak_check_is_named_in_one_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cell.log").write_text(
        "ok\nScheduler hit an exception: Traceback ...\n"
        "ValueError: pool memory leak detected! [full] total=8192, available=8192, evictable=0, protected=0, session_held=0, uncached=0\n"
        "[mamba] total=48, available=46, evictable=0, protected=0, session_held=0, uncached=0, leaked_full_pages=None, leaked_mamba_pages={3, 4}\n"
        "[2026-11-23 01:05:41] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n"
    )
    output = "ERROR conformance/suites/leaks/test_leaks.py::test_load_returns_to_idle[cell] - Failed: cell c: server is not serving: server process exited with code -9; log tail: x"
    assert runs._caught_by(tmp_path, output, 1) == [
        "server died (exit -9): SGLang's idle check: memory leak detected: "
        "[mamba] total=48, available=46, evictable=0, protected=0, session_held=0, uncached=0, leaked_full_pages=None, leaked_mamba_pages={3, 4}"
    ]


@pytest.mark.fault_probe
@pytest.mark.scheduled(reason="two seeded faults and a clean run, each a real SGLang server: CI keeps the single probes (test_sglang_fault_probes.py)")
@pytest.mark.timeout(3600)
def test_fast_sglang_cpu_subset_as_typed(tmp_path: Path) -> None:
    """``hybrid-conformance mutants --target sglang-cpu --fast``: a leak and a state fault on
    real SGLang, each caught by the check that should catch it, after a clean run."""
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    import subprocess

    out = subprocess.run(["hybrid-conformance", "mutants", "--target", "sglang-cpu", "--fast", "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=3500, env={**os.environ, "COLUMNS": "300"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert text.rstrip().splitlines()[-1] == "mutation score: 2/2", text[-3000:]
    assert "clean [sglang-cpu/qwen3-next/extra_buffer:kl+leaks]" in text and "passes" in text
    assert "pingpong_leak_on_finish (fired" in text and "cow_skipped (fired" in text


# ------------------------------------------------------------------ honest scoring (issue 26, finding 7)
@pytest.mark.parametrize("lines,kind,checks", [
    (["kl: top-k KL 1e-3 > 1e-9"], "caught", ["kl"]),
    (["cell teardown: mamba 2 used at idle"], "caught", ["teardown (pools not idle)"]),
    (["server died (exit -9): SGLang's idle check: memory leak detected: [mamba] total=48"], "caught", ["SGLang's idle check (strict, in the server)"]),
    (["server died at start-up (exit 1): RuntimeError: boom"], "start-up death", []),
    (["server died (exit -9): no error in its log"], "server death", []),
    (["programs: step 3: server died: /health answers 503; no error in its log"], "server death", []),
    (["teardown: cell c: server is not serving: exited"], "server death", []),
    (["kl error: test test_kl: KitError: no answer within 300s"], "crash", []),
    (["pytest exit 1"], "crash", []),
    (["error: test_x: boom"], "crash", []),
    ([], "missed", []),
])
def test_only_a_named_check_catches_a_fault(lines: list[str], kind: str, checks: list[str]) -> None:
    from conformance.mutants.scoring import category

    assert category(lines) == (kind, checks)


def test_timeouts_and_faults_never_reached_are_their_own_categories() -> None:
    from conformance.mutants.scoring import category

    assert category(["timed out after 3s: not caught"], timed_out=True) == ("timeout", [])
    assert category(["never reached: x did not fire", "leaks: failed"], fired=0) == ("not reached", [])


def test_a_check_error_from_a_server_its_leak_check_killed_is_scored_by_that_check(tmp_path: Path) -> None:
    """A server killed mid-test (the check's own request hit a dead server: ServerDiedError)
    is judged by its log, as a death reported by pytest is: SGLang's idle check is a catch,
    a death the log does not explain is not."""
    reason = ("test test_pd_transfer_failures: conformance.errors.ServerDiedError: GET http://127.0.0.1:1/metrics: "
              "ReadError: [Errno 104] Connection reset by peer")
    (tmp_path / "report.json").write_text(json.dumps({"cells": [{"checks": {"disagg": {"status": "error", "reason": reason}}}]}))
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cell-pd-decode.log").write_text("ok\n")
    unexplained = runs._caught_by(tmp_path, "", 1)
    assert unexplained[0].startswith("server died: ") and scoring.category(unexplained) == ("server death", [])
    (logs / "cell-pd-decode.log").write_text(
        "ValueError: pool memory leak detected! [full] total=8192, available=8192, evictable=0, protected=0, session_held=0, uncached=0\n"
        "[mamba] total=48, available=32, evictable=0, protected=0, session_held=0, uncached=0, leaked_full_pages=None, leaked_mamba_pages={4, 5}\n")
    found = runs._caught_by(tmp_path, "", 1)
    assert found == ["server died: SGLang's idle check: memory leak detected: [mamba] total=48, available=32, evictable=0, protected=0, "
                     "session_held=0, uncached=0, leaked_full_pages=None, leaked_mamba_pages={4, 5}"]
    assert scoring.category(found) == (scoring.CAUGHT, ["SGLang's idle check (strict, in the server)"])


def test_a_start_up_death_is_reported_not_scored_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: caught = 'the run was not green', so a server that died at start-up scored."""
    import sys

    died = "ERROR conformance/suites/kl/test_kl.py::test_kl[c] - Failed: cell c: server exited during start-up with code 1; log tail: x"
    monkeypatch.setattr(runs, "_pytest_argv", lambda plan, report_dir: [sys.executable, "-c", f"print({died!r}); raise SystemExit(1)"])
    plan = MutantPlan("cell", suites=("kl",))
    out = runs.run_plan(plan, "cached_tokens_overreport", tmp_path)
    assert out.by[0].startswith("server died at start-up (exit 1): ") and out.exit_code == 1
    assert not out.caught and out.category == "start-up death"
    assert runs.run_plan(plan, None, tmp_path).caught  # the clean run: any failure voids the score
    monkeypatch.setitem(catalogue.CATALOGUES, "reference", catalogue.Catalogue(lambda: {"cached_tokens_overreport": plan}, catalogue.FAST_REFERENCE))
    console = Console(width=300, record=True)
    assert command.run_mutants(target="reference", only=None, report_dir=tmp_path / "all", console=console) == 1
    text = console.export_text()
    assert "NOT CAUGHT [start-up death]" in text and "not scored as caught: 1 start-up death" in text
    assert text.rstrip().splitlines()[-1] == "mutation score: 0/1"
    scores = json.loads((tmp_path / "all" / "mutants.json").read_text())
    assert scores["faults"]["cached_tokens_overreport"]["category"] == "start-up death" and scores["faults"]["cached_tokens_overreport"]["caught_by"] == []


def test_a_caught_fault_names_its_check_in_mutants_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    def argv(plan: MutantPlan, report_dir: Path) -> list[str]:
        fault = "HYBRID_CONFORMANCE_FAULT"
        body = {"cells": [{"checks": {"prefix_branching": {"status": "fail", "reason": "hit 64, oracle 128"}}}]}
        script = (f"import os, json, pathlib\nif os.environ.get({fault!r}):\n"
                  f"    pathlib.Path({str(report_dir / 'report.json')!r}).write_text({json.dumps(body)!r}); raise SystemExit(1)")
        return [sys.executable, "-c", script]

    monkeypatch.setattr(runs, "_pytest_argv", argv)
    plan = MutantPlan("cell", suites=("prefix_branching",))
    monkeypatch.setitem(catalogue.CATALOGUES, "reference", catalogue.Catalogue(lambda: {"cached_tokens_overreport": plan}, catalogue.FAST_REFERENCE))
    console = Console(width=300, record=True)
    assert command.run_mutants(target="reference", only=None, report_dir=tmp_path, console=console) == 0
    assert console.export_text().rstrip().splitlines()[-1] == "mutation score: 1/1"
    row = json.loads((tmp_path / "mutants.json").read_text())["faults"]["cached_tokens_overreport"]
    assert row["category"] == "caught" and row["caught_by"] == ["prefix_branching"]


def test_programs_power_scores_no_death_and_no_start_up_a_re_run_missed(tmp_path: Path) -> None:
    from conformance.mutants import power

    (tmp_path / "report.json").write_text(json.dumps({"cells": [{"checks": {"programs": {
        "status": "fail", "reason": "step 2: server died: /health answers 503; no error in its log",
        "metrics": {"examples_to_failure": 3, "seconds_to_failure": 9.0}}}}]}))
    examples, _, reason = power.programs_finding(tmp_path)
    assert examples is None and reason.startswith("server death, not scored caught")  # before: caught after 3 programs
    dummy = runs.Outcome("f", False)
    idle = "server died (exit -9): SGLang's idle check: memory leak detected: [mamba] total=48"
    assert power.Power("f", None, dummy, died_at_start=idle).startup_caught
    assert not power.Power("f", None, dummy, died_at_start=idle, strict_off=True).startup_caught  # its re-run missed
    assert not power.Power("f", None, dummy, died_at_start="server died at start-up (exit 1): boom").startup_caught


def test_an_interrupted_mutants_run_stops_its_pytest_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM to ``mutants`` (unwinding as KeyboardInterrupt) while a selection runs kills
    that child's process group: the run's pytest once outlived a killed ``mutants``; a
    finished child is not touched (not vacuous: the sleeper is alive until then)."""
    import subprocess
    import sys

    from conformance.mutants import runs

    started: list[subprocess.Popen] = []

    class Interrupted(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

        def communicate(self, input=None, timeout=None):  # noqa: A002 - Popen's own signature
            if timeout and timeout > 100:  # the run's own wait: interrupted as a SIGTERM would
                assert self.poll() is None  # the child is alive when the interrupt comes
                raise KeyboardInterrupt("SIGTERM")
            return super().communicate(input, timeout)

    monkeypatch.setattr(runs.subprocess, "Popen", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        runs.run_bounded([sys.executable, "-c", "import time; time.sleep(60)"], env=dict(os.environ), timeout_s=600)
    assert started and started[0].poll() is not None
    code, out, timed_out = runs.run_bounded([sys.executable, "-c", "print('ok')"], env=dict(os.environ), timeout_s=30)
    assert (code, out.strip(), timed_out) == (0, "ok", False)


# ------------------------------------------------------------------ perf faults through the paired A/B (issue 26)
_REAL_AB_ARGV = runs._paired_ab_argv


def _fake_perf_ab(flag_when: str) -> Callable:
    """A stand-in for ``perf-ab --fault F --json J --log-dir L``: writes the verb's rows and the
    fault plugin's fired record, flagged per ``flag_when`` ('fault': only with a fault on;
    'never'; 'crash': no verdict at all)."""
    import sys

    def argv(plan: MutantPlan, fault: str | None, report_dir: Path) -> list[str]:
        real = _REAL_AB_ARGV(plan, fault, report_dir)
        on = real[real.index("--fault") + 1] != "none"
        flagged = on and flag_when == "fault"
        line = ("SLOWER" if flagged else "no change") + ": ttft B/A 1.080 (p 0.0001), decode_per_token B/A 1.090 (p 2e-05); false-flag rate 0.05"
        row = {"repeat": 0, "grade": 0.0, "fault": real[real.index("--fault") + 1] if on else "", "slowed": "b", "flagged": flagged, "line": line}
        logs = Path(real[real.index("--log-dir") + 1]) / "r0" / "b"
        fired = {"plugin": "hybrid_conformance_faults", "status": "fired", "fault": fault, "count": 5}
        script = "\n".join([
            "import json, pathlib, sys",
            f"logs = pathlib.Path({str(logs)!r}); logs.mkdir(parents=True, exist_ok=True)",
            f"(logs / 'cell.plugins.jsonl').write_text({json.dumps(fired)!r} + '\\n')" if on else "",
            "print('perf-ab: 1 paired runs'); sys.exit(3)" if flag_when == "crash" else
            f"pathlib.Path({real[real.index('--json') + 1]!r}).write_text(json.dumps({{'runs': [{row!r}]}})); sys.exit({int(flagged != on)})",
        ])
        return [sys.executable, "-c", script]

    return argv


def test_a_perf_fault_only_the_paired_ab_sees_is_scored_through_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``step_slowdown`` was planned on the perf suite and scored by ``compare``'s
    thresholds, which cannot see +10% ("missed"). Its record now says the paired A/B sees it:
    its plan is ``perf-ab --fault`` on one pair (clean run: ``--fault none``), caught only when
    the paired test flags the side with the fault, and named so."""
    from conformance.matrix.faults import PAIRED_AB
    from conformance.mutants import power

    plan = catalogue.sglang_cpu_plans(("step_slowdown", "track_path_slowdown"))["step_slowdown"]
    assert plan.paired_ab and plan.suites == () and plan.keyword == "qwen3-next-80b-extra_buffer-p1-t256"
    real = runs._paired_ab_argv(plan, "step_slowdown", tmp_path)
    assert real[real.index("perf-ab") + 1:][:2] == ["--target", "sglang-cpu"] and real[real.index("--fault") + 1] == "step_slowdown"
    assert real[real.index("--cell") + 1] == plan.keyword and real[real.index("--repeats") + 1] == "1"
    assert runs._paired_ab_argv(plan, None, tmp_path)[real.index("--fault") + 1] == "none"
    assert catalogue.sglang_cpu_plans(("track_path_slowdown",))["track_path_slowdown"].suites[0] == "perf"  # compare still scores that one

    monkeypatch.setattr(runs, "_paired_ab_argv", _fake_perf_ab("fault"))
    caught = runs.run_plan(plan, "step_slowdown", tmp_path / "seen")
    assert caught.caught and caught.category == "caught" and caught.checks == [PAIRED_AB] and caught.fired == 5
    assert caught.by[0].startswith(f"{PAIRED_AB}: step_slowdown on side b: SLOWER")
    assert not runs.run_plan(plan, None, tmp_path / "seen").caught  # a clean pair not flagged: the score stands

    monkeypatch.setattr(runs, "_paired_ab_argv", _fake_perf_ab("never"))
    blind = runs.run_plan(plan, "step_slowdown", tmp_path / "blind")
    assert not blind.caught and blind.category == "missed" and blind.fired == 5
    monkeypatch.setattr(runs, "_paired_ab_argv", _fake_perf_ab("crash"))
    crashed = runs.run_plan(plan, "step_slowdown", tmp_path / "crash")
    assert not crashed.caught and crashed.category == "crash" and "perf-ab exited 3 with no verdict" in crashed.by[0]
    assert runs.run_plan(plan, None, tmp_path / "crash").caught  # a clean A/B that gave no verdict voids the score

    buf = io.StringIO()
    assert "step_slowdown" not in power.programs_reach({"step_slowdown": plan}, Console(file=buf, width=300))
    assert "scored by the paired A/B" in buf.getvalue()


def test_programs_mode_writes_who_caught_each_fault_as_data(tmp_path: Path) -> None:
    """``mutants --programs`` printed its table only: ``mutants.json`` now holds, per fault,
    the scripted outcome (category, named checks) beside the programs' (its finding's catcher,
    examples and seconds to failure), and the clean runs."""
    from conformance.mutants import power

    scripted = runs.Outcome("f", True, ["kl: top-k KL 0.3"], 40.0, 1, fired=3, category="caught", checks=["kl"])
    caught = power.Power("f", scripted, runs.Outcome("f", True), examples=2, seconds=5.0,
                         programs_reason="request r2: cached_tokens 128, the prefix oracle allows [192]")
    missed = power.Power("g", runs.Outcome("g", False, category="missed"), runs.Outcome("g", False), programs_reason="16 programs, 25.1s: nothing found")
    power.write_json(tmp_path / "mutants.json", "sglang-cpu", "premerge", 0, [("plan", runs.Outcome("clean", False))], [caught, missed])
    data = json.loads((tmp_path / "mutants.json").read_text())
    assert data["clean"][0]["passed"] is True and data["programs_budget"] == "premerge"
    f, g = data["faults"]["f"], data["faults"]["g"]
    assert f["caught_by"] == "both" and f["scripted"]["caught"] and f["scripted"]["caught_by"] == ["kl"]
    assert f["programs"]["caught"] and f["programs"]["examples_to_failure"] == 2 and f["programs"]["by"]
    assert g["caught_by"] == "neither" and not g["programs"]["caught"] and g["programs"]["examples_to_failure"] is None


# ------------------------------------------------------------------ scoring that names the catcher (issue 43)
_TYPE_ERROR_LOG = ('Scheduler hit an exception: Traceback (most recent call last):\n'
                   '  File "/x/site-packages/sglang/srt/managers/scheduler.py", line 12, in event_loop\n'
                   "    n = len(batch.extra)\n"
                   "TypeError: object of type 'NoneType' has no len()\n")
_LEAK_LOG = ("ValueError: pool memory leak detected! [full] total=8192, available=8192, evictable=0, protected=0, session_held=0, uncached=0\n"
             "[mamba] total=48, available=45, evictable=0, protected=0, session_held=0, uncached=0\n")


def _leaks_report(tmp_path: Path, log: str) -> list[str]:
    from conformance.checks.leaks import leak_verdict
    from conformance.recordings import IdleProbe

    v = leak_verdict([IdleProbe("s", reached=True, values={}, waited_s=0.0)], log_text=log, alive=False, exit_code=1,
                     require_load_evidence=False, gauges=(), scenario_errors=["ServerDiedError: GET /metrics: connection refused"])
    (tmp_path / "report.json").write_text(json.dumps({"cells": [{"checks": {"leaks": v.to_json()}}]}))
    return runs._caught_by(tmp_path, "", 1)


def test_a_leaks_suite_death_from_a_plain_type_error_is_not_caught(tmp_path: Path) -> None:
    """Before: any death in the leaks suite scored "caught by leaks" (its line "server process
    is not alive ..." named the check).  A plain TypeError is a death, not a leak found."""
    lines = _leaks_report(tmp_path, _TYPE_ERROR_LOG)
    assert all(line.startswith("leaks [server_died:exception]: ") for line in lines), lines
    assert scoring.category(lines) == ("server death", [])
    (tmp_path / "leak").mkdir()  # not vacuous: SGLang's own leak report in the log of the same death is its invariant firing
    kind, checks = scoring.category(_leaks_report(tmp_path / "leak", _LEAK_LOG))
    assert kind == scoring.CAUGHT and "SGLang's idle check (strict, in the server)" in checks


@pytest.mark.parametrize("verdict,column", [
    ({"status": "fail", "reason": "only 0/4 prompts hit", "details": {"findings": [{"kind": "vacuous", "line": "only 0/4 prompts hit the cache"}]}}, "vacuous"),
    ({"status": "fail", "reason": "no program ran", "details": {"findings": [{"kind": "vacuous", "line": "no program ran within the budget"}]}}, "vacuous"),
    ({"status": "fail", "reason": "r1", "details": {"findings": [{"kind": "hung", "line": "request r1 did not answer within 330s"}]}}, "hang"),
    ({"status": "fail", "reason": "known SGLang bug, still present (x): ...", "details": {"known_bug": {"id": "x"},
      "findings": [{"kind": "answer_differs_on_hit", "line": "request r3 differs"}]}}, "known bug"),
    ({"status": "fail", "reason": "gauge", "details": {"findings": [{"kind": "kit_error", "line": "s: gauge(s) x missing from /metrics"}]}}, "crash"),
])
def test_vacuity_hangs_and_known_bugs_are_their_own_columns(verdict: dict, column: str) -> None:
    lines = scoring.verdict_lines("kl", verdict)
    assert scoring.category(lines) == (column, [])
    caught = scoring.verdict_lines("prefix_branching", {"status": "fail", "reason": "x", "details": {"findings": [
        {"kind": "hit_below_held", "line": "request r2: cached_tokens 0: SGLang held a state of 256 tokens"}]}})
    assert scoring.category(lines + caught) == (scoring.CAUGHT, ["prefix_branching"])  # a named effect beside them is the catch
