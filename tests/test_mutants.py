"""The mutation command: a caught fault is reported with its check and numbers, an
uncaught one fails the command, and the score line comes last."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from conformance.errors import KitError
from conformance.mutants import catalogue, command
from conformance.mutants.catalogue import MutantPlan

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_caught_by_reads_failing_checks(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps({"cells": [{"checks": {"kl": {"status": "fail", "reason": "top-k KL 1e-3 > 1e-9"}, "leaks": {"status": "pass"}}}]}))
    assert command._caught_by(tmp_path, "", 1) == ["kl: top-k KL 1e-3 > 1e-9"]
    empty = tmp_path / "none"
    empty.mkdir()
    assert command._caught_by(empty, "", 0) == []
    assert command._caught_by(empty, "", 3) == ["pytest exit 3"]


def test_unknown_fault_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(KitError, match=r"--only: unknown fault 'nope'; known: pingpong_leak_on_finish"):
        command.run_mutants(target="reference", only="nope", report_dir=tmp_path)


def test_every_reference_fault_has_a_plan_and_doc() -> None:
    from conformance.reference.faults import FAULTS

    from conformance.reference.pd import PD_FAULTS

    plans = catalogue.reference_plans()
    assert set(plans) == set(FAULTS) | set(PD_FAULTS) and len(FAULTS) >= 12
    assert all(plans[name].suites == ("disagg",) and plans[name].fault_env == "HYBRID_CONFORMANCE_PD_FAULT" for name in PD_FAULTS)
    assert all(len(spec.description) > 40 and spec.models for spec in FAULTS.values())


@pytest.fixture
def gsm8k_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR"):
        monkeypatch.setenv("HYBRID_CONFORMANCE_GSM8K_DIR", str(GSM8K))


def test_fast_reference_subset_catches_and_scores(tmp_path: Path, gsm8k_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two faults on the smallest cell: both caught, by the check that should catch them."""
    small = MutantPlan("qwen3-next/extra_buffer:kl+prefix", suites=("kl", "prefix_branching"), models="qwen3-next", strategies="extra_buffer", stop_at_first=True)
    monkeypatch.setattr(catalogue, "reference_plans", lambda: {"cached_tokens_overreport": small, "track_boundary_late": small})
    monkeypatch.setattr(command, "reference_plans", catalogue.reference_plans)
    console = Console(width=300, record=True)
    code = command.run_mutants(target="reference", only=None, report_dir=tmp_path, console=console)
    text = console.export_text()
    assert code == 0, text
    assert text.rstrip().splitlines()[-1] == "mutation score: 2/2"
    assert "prefix_branching: " in text and "kl: " in text


def test_uncaught_fault_fails_the_command(tmp_path: Path, gsm8k_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault run only on a suite that cannot see it must be reported NOT CAUGHT, exit 1."""
    blind = MutantPlan("qwen3-next/extra_buffer:gsm8k", suites=("gsm8k",), models="qwen3-next", strategies="extra_buffer", stop_at_first=True)
    monkeypatch.setattr(command, "reference_plans", lambda: {"cached_tokens_underreport": blind})
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
    monkeypatch.setattr(command, "_pytest_argv", lambda plan, report_dir: [sys.executable, "-c", "\n".join(sleeper)])
    plan = MutantPlan("slow", suites=("kl",), timeout_s=3.0)
    t0 = time.monotonic()
    caught = command.run_plan(plan, "cached_tokens_overreport", tmp_path)
    assert time.monotonic() - t0 < 60
    assert caught.caught is False and caught.timed_out and "not caught" in caught.by[0]
    clean = command.run_plan(plan, None, tmp_path)
    assert clean.caught is True and clean.timed_out  # a clean run that times out voids the score
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    monkeypatch.setattr(command, "reference_plans", lambda: {"cached_tokens_overreport": plan})
    console = Console(width=300, record=True)
    assert command.run_mutants(target="reference", only=None, report_dir=tmp_path / "all", console=console) == 1
    text = console.export_text()
    assert "NOT CAUGHT (timed out after 3s: not caught)" in text and text.rstrip().splitlines()[-1] == "mutation score: 0/1"
