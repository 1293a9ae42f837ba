"""docs/fuzzing.md's commands, run as typed through the console script (reference target;
the sglang-cpu one starts real SGLang), and the suite's refusal to pass vacuously."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conformance.programs.explore import Exploration, Found
from conformance.programs.program import Program
from conformance.checks.leaks import pool_finding
from conformance.programs.runner import RunStats, program_failure
from conformance.suites.programs.test_programs import programs_verdict

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "fuzzing.md"
FILE = "tests/data/programs/underreport.json"

FUZZ_REF = "hybrid-conformance fuzz --models qwen3-next --strategies extra_buffer --tier premerge --budget 4 --seed 0"
PYTEST = "pytest conformance/suites/programs -m programs --models qwen3-next --strategies no_buffer --tier premerge --budget 4 --seed 7"
REPLAY = f"hybrid-conformance replay {FILE} --target reference"
REPLAY_CLEAN = f"hybrid-conformance replay {FILE} --target reference --no-recorded-env"
REPLAY_TWICE = f"hybrid-conformance replay {FILE} --target reference --repeat 2"
MUTANTS = "hybrid-conformance mutants --programs 8 --programs-only --only cached_tokens_underreport"
FUZZ_SGLANG_CPU = "hybrid-conformance fuzz --target sglang-cpu --models qwen3-next --strategies extra_buffer_lazy --tier premerge --budget 4 --seed 0"
FUZZ_ROTATE = "hybrid-conformance fuzz --tier premerge --rotate 0ed07d0 --budget 4 --seed 0"
TESTED = {FUZZ_REF, PYTEST, REPLAY, REPLAY_CLEAN, REPLAY_TWICE, MUTANTS, FUZZ_SGLANG_CPU, FUZZ_ROTATE}


def doc_commands() -> set[str]:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return {line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")}


def sh(command: str, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as typed (console scripts from PATH; this checkout first on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    for k in ("HYBRID_CONFORMANCE_FAULT", "HYBRID_CONFORMANCE_SGLANG_FAULT"):
        env.pop(k, None)
    argv = command.split()
    assert shutil.which(argv[0]), f"{argv[0]} is not on PATH"
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_documented_command_is_tested() -> None:
    assert doc_commands() == TESTED


def _programs_check(report: Path) -> dict:
    data = json.loads(report.read_text())
    (cell,) = data["cells"]
    return cell["checks"]["programs"]


def test_fuzz_as_typed(tmp_path: Path) -> None:
    out = sh(FUZZ_REF, tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    check = _programs_check(tmp_path / "reports" / "fuzz" / "report.json")
    assert check["status"] == "pass" and check["metrics"]["examples"] == 4 and check["metrics"]["seed"] == 0
    assert "programs" in out.stdout


def test_pytest_suite_as_typed() -> None:
    out = sh(PYTEST, ROOT)
    assert out.returncode == 0, out.stdout[-2000:]
    assert "1 passed" in out.stdout


def test_replay_reproduces_a_finding_and_passes_without_its_fault() -> None:
    out = sh(REPLAY, ROOT, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "applied the recorded env: HYBRID_CONFORMANCE_FAULT=cached_tokens_underreport" in out.stdout
    assert "run 1: FAIL at step 3: request r2: cached_tokens 0, the prefix oracle allows [128]" in out.stdout
    clean = sh(REPLAY_CLEAN, ROOT, timeout=600)
    assert clean.returncode == 0 and "run 1: PASS" in clean.stdout and "0/1 runs failed" in clean.stdout
    twice = sh(REPLAY_TWICE, ROOT, timeout=600)
    assert twice.returncode == 1 and "2/2 runs failed" in twice.stdout


def test_replay_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "steps": [{"op": "warp"}]}')
    out = sh(f"hybrid-conformance replay {bad} --target reference", tmp_path, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "unknown step" in out.stderr
    out = sh("hybrid-conformance fuzz --budget soon", tmp_path, timeout=120)
    assert out.returncode == 2 and "--budget: expected premerge" in out.stderr


def test_mutants_programs_as_typed(tmp_path: Path) -> None:
    out = sh(MUTANTS, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "programs caught 1/1" in out.stdout and "cached_tokens_underreport" in out.stdout
    # the clean run and the fault's run were judged by one cache-off twin, the command's own
    twins = [c["checks"]["programs"]["details"].get("cold_twin") for r in tmp_path.rglob("report.json")
             for c in json.loads(r.read_text())["cells"] if "programs" in c["checks"]]
    assert len(twins) >= 2 and len(set(twins)) == 1 and twins[0], twins


def test_fuzz_rotate_as_typed(tmp_path: Path) -> None:
    """``--rotate KEY`` fuzzes the one premerge cell the key picks (premerge: the PR's commit)."""
    out = sh(FUZZ_ROTATE, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "rotation: cell qwen3-next-80b-extra_buffer-p1-t256 (2 of 8, key '0ed07d0')" in out.stdout, out.stdout[:2000]
    (cell,) = json.loads((tmp_path / "reports" / "fuzz" / "report.json").read_text())["cells"]
    assert cell["id"] == "qwen3-next-80b-extra_buffer-p1-t256" and cell["checks"]["programs"]["status"] == "pass"


@pytest.mark.scheduled(reason="minutes of fuzzing on real SGLang: the nightly's scheduled-tests job")
def test_fuzz_sglang_cpu_as_typed(tmp_path: Path) -> None:
    out = sh(FUZZ_SGLANG_CPU, tmp_path, timeout=2400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    # extra_buffer_lazy selects two premerge cells: clean and the lazy allocation-failure fault
    data = json.loads((tmp_path / "reports" / "fuzz" / "report.json").read_text())
    cells = {c["id"]: c["checks"]["programs"] for c in data["cells"]}
    assert set(cells) == {"qwen3-next-80b-extra_buffer_lazy-p1-t256", "qwen3-next-80b-extra_buffer_lazy-p1-t256-lazy_alloc_fail"}, cells
    assert data["launches"] >= len(cells) and data["target"] == "sglang-cpu"
    for check in cells.values():
        assert check["status"] == "pass" and check["metrics"]["examples"] == 4, check
        assert check["metrics"]["requests"] > 0, check


# ------------------------------------------------------------------ the verdict
def test_verdict_refuses_to_pass_vacuously() -> None:
    assert programs_verdict(Exploration(), budget="1", seed=0).status == "fail"
    assert "sent no request" in programs_verdict(Exploration(examples=3), budget="1", seed=0).reason
    assert programs_verdict(Exploration(examples=3, stats=[RunStats(requests=5)]), budget="1", seed=0).status == "fail"  # nothing compared
    assert programs_verdict(Exploration(examples=3, stats=[RunStats(requests=5, compared_tokens=12)]), budget="1", seed=0).status == "pass"


def test_verdict_of_a_finding_names_file_and_replay() -> None:
    f = Found(program_failure(2, [pool_finding("mamba: 1 used at idle", "idle invariant: mamba: 1 used at idle")], []), Program((), ()), 7, 12.5)
    v = programs_verdict(Exploration(examples=7, finding=f), budget="premerge", seed=3, failure=f.failure.what,
                         replay="hybrid-conformance replay x.json --target reference", file="x.json")
    assert v.status == "fail" and v.metrics["examples_to_failure"] == 7 and "replay: hybrid-conformance replay x.json" in v.reason


def test_mutants_programs_names_the_faults_programs_cannot_reach() -> None:
    """A PD transfer fault is out of a one-server program's reach: named, not scored, and
    the shrink budget reaches the programs run."""
    from io import StringIO

    from rich.console import Console

    from conformance.mutants import catalogue, power

    plans = catalogue.reference_plans()
    buf = StringIO()
    reach = power.programs_reach(plans, Console(file=buf, width=300))
    assert "pd_state_off_by_one" not in reach and len(reach) == len(plans) - 1
    assert "pd_state_off_by_one: not applicable to request programs (a PD transfer fault" in buf.getvalue()
    real = catalogue.sglang_cpu_plans()
    assert "track_path_slowdown" not in power.programs_reach(real, Console(file=buf, width=300))
    assert "track_path_slowdown: not applicable to request programs (a performance fault" in buf.getvalue()
    pp = power.programs_plan(plans["double_free"], budget="5m", seed=2, shrink_s=10)
    assert pp.suites == ("programs",) and {"--budget=5m", "--seed=2", "--program-db=none", "--shrink-budget=10"} <= set(pp.extra_args)


def test_power_tells_a_start_up_death_from_a_programs_finding(tmp_path: Path) -> None:
    """A fault that kills SGLang on its warmup request is caught by the kit at start-up,
    not by the programs: the row says so and names the log's line."""
    from io import StringIO

    from rich.console import Console

    from conformance.mutants import power
    from conformance.mutants.runs import Outcome

    died = "server died (exit -9): SGLang's idle check: memory leak detected: [mamba] total=48, available=46"
    rows = [power.Power("pingpong_leak_on_finish", None, Outcome("pingpong_leak_on_finish", True, [died]), None, None, "no report.json", died),
            power.Power("cow_skipped", None, Outcome("cow_skipped", True, ["programs: ..."]), 3, 40.0, "")]
    assert [r.caught_by for r in rows] == ["SGLang's idle check at start-up", "programs"]
    buf = StringIO()
    code = power.render("sglang-cpu", "90s", 0, [("k", Outcome("clean", False))], rows, Console(file=buf, width=300))
    out = buf.getvalue()
    assert code == 0 and "no program ran" in out and "server died at start-up (before any program): 1" in out
    assert "programs caught 1/2" in out and "of which SGLang's idle check named: 1" in out
    unexplained = power.Power("x", None, Outcome("x", False), None, None, "no report.json", "server died at start-up (exit 1): RuntimeError")
    assert unexplained.caught_by == "neither" and power.render("sglang-cpu", "90s", 0, [], [unexplained], Console(file=StringIO())) == 1
    missed = power.Power("x", None, Outcome("x", False), None, None, "8 programs, 90s: nothing found")
    assert missed.caught_by == "neither" and power.render("sglang-cpu", "90s", 0, [], [missed], Console(file=StringIO())) == 1


def _plan_cells(matrix, plan) -> list:
    """The cells a mutants plan's pytest selection picks (its flags, as ``runs._pytest_argv`` passes them)."""
    split = lambda v: v.split(",") if v else None  # noqa: E731
    pages = [int(p) for p in plan.page_sizes.split(",")] if plan.page_sizes else None
    return matrix.select(target=plan.target, models=split(plan.models), strategies=split(plan.strategies), page_sizes=pages,
                         server_options=split(plan.server_options), tier=plan.tier, faults=split(plan.faults))


def test_the_strict_off_rerun_of_an_option_fault_selects_its_own_cell() -> None:
    """An option fault (small Mamba pool) re-run with SGLang's strict idle check off selects
    its own axis cell with the check off (it matched no cell before: "no matrix cell
    matches"); without the matrix's overlay the same selection is empty (not vacuous)."""
    import dataclasses

    from conformance.matrix.cells import load_matrix
    from conformance.mutants import catalogue, power

    plan = catalogue.sglang_cpu_plans(("pressure_evict_slot_still_cached",))["pressure_evict_slot_still_cached"]
    lenient = power.strict_off_plan(plan)
    matrix = load_matrix(Path("fixtures/matrix.toml"))
    cells = _plan_cells(matrix, lenient)
    assert [c.id for c in cells] == [c.id.replace("-mamba_pool-small", f"-{power.NO_STRICT}-mamba_pool-small") for c in _plan_cells(matrix, plan)]
    assert [(c.options, dict(c.env)["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"]) for c in cells] == [((("mamba_pool", "small"),), "0")]
    plain = dataclasses.replace(matrix, faults={**matrix.faults, power.NO_STRICT: dataclasses.replace(matrix.faults[power.NO_STRICT], overlay=False)})
    assert _plan_cells(plain, lenient) == []
    assert not _plan_cells(matrix, dataclasses.replace(lenient, faults="lazy_alloc_fail"))  # only an overlay fault is laid over


def test_a_start_up_death_is_measured_again_with_sglangs_strict_check_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leak SGLang's own strict idle check kills the server for is re-run on the same
    cell with that check off (matrix fault no_strict_idle_check), so the programs' idle
    invariant is what is scored; a cell that already carries a matrix fault is not."""
    from io import StringIO

    from rich.console import Console

    from conformance.matrix.cells import load_matrix
    from conformance.mutants import catalogue, power
    from conformance.mutants.runs import Outcome

    plans = catalogue.sglang_cpu_plans(("pingpong_leak_on_finish", "lazy_alloc_fail_still_inserts"))
    lenient = power.strict_off_plan(plans["pingpong_leak_on_finish"])
    assert lenient.faults == power.NO_STRICT and lenient.tier == plans["pingpong_leak_on_finish"].tier
    assert "+no_strict_idle_check:" in lenient.key
    assert power.strict_off_plan(plans["lazy_alloc_fail_still_inserts"]) is None  # one matrix fault per cell
    matrix = load_matrix(Path("fixtures/matrix.toml"))
    cells, clean = _plan_cells(matrix, lenient), _plan_cells(matrix, plans["pingpong_leak_on_finish"])
    assert cells and [c.id.replace(f"-{power.NO_STRICT}", "") for c in cells] == [c.id for c in clean]  # the same cells
    assert {dict(c.env).get("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE") for c in cells} == {"0"}

    died = "server died (exit -9): SGLang's idle check: memory leak detected"
    ran: list[str] = []

    def fake_run(plan, fault, out_dir):
        ran.append(plan.key)
        return Outcome(fault or "clean", fault is not None and power.NO_STRICT in plan.key, [] if power.NO_STRICT in plan.key else [died])

    def fake_finding(report_dir):
        return (2, 11.0, "idle invariant: mamba: 1 used at idle") if power.NO_STRICT in str(report_dir) else (None, None, power.NO_REPORT)

    monkeypatch.setattr(power, "run_plan", fake_run)
    monkeypatch.setattr(power, "programs_finding", fake_finding)
    only = {"pingpong_leak_on_finish": plans["pingpong_leak_on_finish"]}
    clean, rows = power.measure(only, budget="nightly", seed=0, report_dir=tmp_path, programs_only=True)
    assert rows[0].strict_off and rows[0].examples == 2 and rows[0].caught_by == "programs"
    assert sum(power.NO_STRICT in k for k in ran) == 1 and len(clean) == 1
    buf = StringIO()
    assert power.render("sglang-cpu", "nightly", 0, clean, rows, Console(file=buf, width=300)) == 0
    assert "caught (SGLang's strict idle check off)" in buf.getvalue()
