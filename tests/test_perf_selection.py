"""When the perf suite runs: in the standard tier on the real targets by default; in
premerge or on the kit's reference engine only when asked for; deselected (never skipped)
otherwise -- the same rule for ``hybrid-conformance run``'s default suites and for pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.matrix.cells import load_matrix
from conformance.commands.selection import suites_for as _suites
from conformance.suites.perf.selection import SUITE_DIR, asked_for, not_selected

ROOT = Path(__file__).resolve().parents[1]


def test_the_rule() -> None:
    assert not_selected("sglang-cpu", "standard", asked=False) is None
    assert not_selected("sglang", "nightly", asked=False) is None
    assert "premerge" in not_selected("sglang-cpu", "premerge", asked=False)
    assert "--suite perf" in not_selected("reference", "standard", asked=False)
    assert not_selected("reference", "premerge", asked=True) is None


def test_asked_for_by_marker_or_path() -> None:
    assert asked_for("perf", []) and asked_for("(perf) and not pool", [])
    assert not asked_for("not pool", ["conformance"]) and not asked_for("perfect", [])
    assert asked_for(None, [str(SUITE_DIR)]) and asked_for(None, [f"{SUITE_DIR / 'test_perf.py'}::test_perf"])


@pytest.mark.parametrize(
    "target,tier,expected",
    [("sglang-cpu", None, True), ("sglang-cpu", "premerge", False), ("sglang", "standard", True), ("reference", None, False)],
)
def test_run_default_suites_follow_the_rule(target: str, tier: str | None, expected: bool) -> None:
    assert ("perf" in _suites(None, target=target, tier=tier)) is expected
    assert "perf" in _suites("perf", target=target, tier=tier)


def _collect(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    return out.stdout + out.stderr


def test_pytest_deselects_perf_in_premerge_and_collects_it_in_standard() -> None:
    premerge = _collect("conformance/suites/perf", "conformance/suites/kl", "--target", "sglang-cpu", "--tier", "premerge", "-m", "not pool")
    assert "test_perf[" in premerge  # a path inside the suite asks for it
    whole = _collect("conformance", "--target", "sglang-cpu", "--tier", "premerge", "-m", "not pool", "-k", "test_perf")
    assert "test_perf[" not in whole and "deselected" in whole
    standard = _collect("conformance", "--target", "sglang-cpu", "--tier", "standard", "-m", "not pool", "-k", "test_perf")
    # every standard-tier cell whose fault binds the perf suite (a fault bound to one suite, the PD
    # transfer-failure cells' to disagg, leaves its cells out of the others)
    cells = [c for c in load_matrix().select(target="sglang-cpu", tier="standard") if c.fault.binds_suite("perf")]
    assert len(cells) > 8 and standard.count("test_perf[") == len(cells), standard[-2000:]
    reference = _collect("conformance", "--target", "reference", "-m", "not pool", "-k", "test_perf")
    assert "test_perf[" not in reference
