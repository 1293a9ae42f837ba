"""The README's test command (what CI runs) selects nothing scheduled: no test that needs
another SGLang release's venv or a slow real-SGLang fault probe; ``-m scheduled`` selects
them all, so the scheduled workflow runs what CI leaves out."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_TEST_COMMAND = [b.split("```")[0].strip() for b in (ROOT / "README.md").read_text().split("```bash\n")[1:3]][1]


def pytest_runs(command: str) -> list[list[str]]:
    """The pytest argument lists of a shell line's ``python3 -m pytest ...`` segments, without
    the xdist options (collection only)."""
    runs = []
    for segment in re.split(r"&&|;|\|\|", command):
        words = shlex.split(segment)
        if words[:3] in (["python3", "-m", "pytest"], ["python", "-m", "pytest"]):
            args, skip = [], False
            for w in words[3:]:
                if skip:
                    skip = False
                elif w in ("-n", "--dist"):
                    skip = True
                else:
                    args.append(w)
            runs.append(args)
    return runs


def collected(args: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:randomly"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]
    return {ln.strip() for ln in out.stdout.splitlines() if "::" in ln}


def test_the_readme_test_command_selects_no_scheduled_test():
    runs = pytest_runs(README_TEST_COMMAND)
    assert len(runs) == 2, f"the README's test command has two pytest runs: {README_TEST_COMMAND}"
    scheduled = collected(["tests", "-m", "scheduled"])
    assert any("test_release_range.py" in n for n in scheduled), "non-vacuous: -m scheduled selects the release-range tests"
    assert any("test_sglang_fault_probes.py" in n for n in scheduled), "and the slow real-SGLang fault probes"
    for args in runs:
        selected = collected(args)
        assert selected, f"the README's pytest run selects tests: {args}"
        assert not selected & scheduled, f"README's run {args} selects scheduled tests: {sorted(selected & scheduled)[:5]}"


def test_segments_are_read_as_the_shell_runs_them():
    line = 'bash ci/setup-cpu.sh && export X=1 && python3 -m pytest -n 2 --dist loadgroup --target reference && python3 -m pytest -n 2 conformance -m "not pool"'
    assert pytest_runs(line) == [["--target", "reference"], ["conformance", "-m", "not pool"]]
