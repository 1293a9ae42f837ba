"""The release-range job: ``hybrid-conformance history`` through the installed console
script, on real SGLang releases from PyPI, each in its own venv (cached under
``HYBRID_CONFORMANCE_VENVS`` or ~/.cache/hybrid-conformance/venvs).

* the oldest supported release (0.5.12), 0.5.22 and the newest (0.5.23), pool tier:
  PR 26941's ping-pong leak is flagged on 0.5.12 (``pool:session_reuse`` fails on the
  slot partition) and nothing fails on 0.5.22 and 0.5.23, where most scenarios run;
* ``docs/history.md``'s commands as typed (the first is the CI command above): 0.5.12 and
  0.5.13, where the leak clears and the Mamba2 cache chunk follows the model; the table
  lists every check and the command exits 1 because 0.5.12 fails.

Needs PyPI on the first run (about 200 MB per release); afterwards the venvs are reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3600
pytestmark = [pytest.mark.release_range, pytest.mark.xdist_group("release_range"), pytest.mark.timeout(TIMEOUT_S)]


def history(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("hybrid-conformance")
    assert exe, "the hybrid-conformance console script is not installed (bash ci/setup-cpu.sh)"
    return subprocess.run([exe, "history", *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def rows_of(out: subprocess.CompletedProcess) -> dict[tuple[str, str], dict]:
    doc = json.loads(out.stdout)
    assert set(doc) >= {"rows", "probes"}
    for r in doc["rows"]:
        assert set(r) == {"release", "check", "status", "reason", "cell", "replay"} and r["status"] in ("pass", "fail", "na")
    return {(r["release"], r["check"]): r for r in doc["rows"]}


@pytest.fixture(scope="module")
def oldest_022_newest():
    out = history("--releases", "0.5.12,0.5.22,0.5.23", "--checks", "pool", "--format", "json")
    return out, rows_of(out)


def test_26941_leak_is_flagged_on_the_oldest_release(oldest_022_newest):
    out, rows = oldest_022_newest
    assert out.returncode == 1, out.stderr[-2000:]
    leak = rows[("0.5.12", "pool:session_reuse")]
    assert leak["status"] == "fail" and "slot_partition" in leak["reason"] and "by several" in leak["reason"], leak
    assert rows[("0.5.12", "pool:branch_at_chunk_boundary")]["status"] == "pass"
    assert rows[("0.5.12", "pool:lazy_alloc_fail_effects")]["status"] == "na"
    assert "extra_buffer_lazy" in rows[("0.5.12", "pool:lazy_alloc_fail_effects")]["reason"]


@pytest.mark.parametrize("release", ["0.5.22", "0.5.23"])
def test_newer_releases_run_every_pool_scenario_and_pass(oldest_022_newest, release):
    _, rows = oldest_022_newest
    mine = {check: r for (rel, check), r in rows.items() if rel == release}
    scenarios = {c: r for c, r in mine.items() if c.startswith("pool:") and c != "pool:machine"}
    assert scenarios and all(r["status"] == "pass" for r in scenarios.values()), {c: r for c, r in scenarios.items() if r["status"] != "pass"}
    assert mine["install"]["status"] == "pass"


def test_docs_history_command_as_typed():
    # as typed; the state machine's budget is cut (its own env knobs) to keep CI short
    out = history("--releases", "0.5.12,0.5.13", env={"HYBRID_CONFORMANCE_POOL_EXAMPLES": "4", "HYBRID_CONFORMANCE_POOL_STEPS": "12"})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["check"])
    assert lines[header].split() == ["check", "0.5.12", "0.5.13"]
    table = {ln.split()[0]: ln.split()[1:] for ln in lines[header + 1:] if ln.strip() and not ln.startswith(" ") and len(ln.split()) == 3}
    assert table["pool:session_reuse"] == ["FAIL", "pass"]
    assert table["install"] == ["pass", "pass"] and table["pool:machine"][1] == "pass"
    plan = next(ln for ln in lines if ln.startswith("plan --validate"))
    # 0.5.12 resolves the mamba cache chunk as max(FLA chunk 64, page) for every model, so the
    # Mamba2 twin (chunk 128) is tracked off its kernel's chunk grid; 0.5.13 reads the model's chunk
    assert plan.split()[2:] == ["FAIL", "pass"], plan
    assert "SGLang resolved mamba cache chunk 64, the matrix says 128" in out.stdout
    assert any(ln.startswith("sglang 0.5.12: lazy strategy absent -> lazy cells not applicable") for ln in lines)
    assert "1 of 2 releases failed (0.5.12)" in out.stdout
