"""The observe plugin's per-node state evidence on older SGLang releases' real radix trees,
in-process in each release's venv (``tests/observe_tree_probe.py``, no server, no model):
``MambaRadixCache`` (the hybrid default up to 0.5.15: the ``walk`` plan) and the older
``UnifiedRadixCache`` generations (0.5.16: ``walk``; 0.5.18: the ``drain`` plan).  Before
these hooks, every release before 0.5.23 wrote ``state_evictions: false`` and the oracle's
evidence-gated permissions stayed closed there.  (A release lacking a piece: per_node stays
off, tests/test_observe_plugin.py::test_a_tree_class_missing_a_hook_leaves_per_node_off_and_says_why.)

The venvs are the release-range job's (``conformance.commands.history.ensure_venv``: made once with
PyPI, then reused), so these run where ``tests/test_release_range.py`` runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conformance.commands.history import default_venv_dir, ensure_venv, venv_env
from conformance.programs.evidence import RequestLog

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "observe_tree_probe.py"
A, B = list(range(1, 65)), list(range(1, 97))  # the probe's prefixes: B extends A
pytestmark = [pytest.mark.release_range, pytest.mark.xdist_group("release_range"), pytest.mark.timeout(1800)]


def probe(release: str, tree: str, tmp_path: Path, *extra: str) -> tuple[dict, RequestLog, list[dict]]:
    venv = ensure_venv(release, default_venv_dir())
    requests = tmp_path / f"{release}.requests.jsonl"
    out = subprocess.run([str(venv / "bin" / "python"), str(PROBE), tree, str(requests), *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=venv_env(venv), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    log = RequestLog(requests)
    log.refresh()
    return json.loads(out.stdout.strip().splitlines()[-1]), log, [json.loads(l) for l in requests.read_text().splitlines()]


@pytest.mark.parametrize(("release", "tree", "plan"), [
    ("0.5.15", "MambaRadixCache", "walk"),
    ("0.5.16", "UnifiedRadixCache", "walk"),
    ("0.5.18", "UnifiedRadixCache", "drain"),
])
def test_an_old_releases_tree_records_each_state_it_took_and_the_one_a_walk_evicted(release, tree, plan, tmp_path):
    seen, log, records = probe(release, tree, tmp_path)
    start = records[0]
    assert start["ev"] == "start" and start["state_evictions"] is True and start["state_missing"] == [], start
    assert start["state_plans"][tree] == plan
    assert log.per_node
    # SGLang's own answers: A and B new, A again already there (no record for it)
    assert seen["exist"] == [False, False, True]
    assert [(r["ev"], r["len"]) for r in records[1:]] == [("state_stored", 64), ("state_stored", 96), ("state_evicted", 96)], records
    # the record names the state the tree itself no longer holds after the walk (B's slot), and only it
    assert seen["mamba_evicted"] == 1 and seen["held_before"] == sorted(seen["slots"].values())
    assert seen["held_after"] == [seen["slots"]["a"]] and seen["remembered_after_evict"] == [seen["slots"]["a"]]
    assert log.state_stored(A) and log.state_stored(B) and log.state_stored(B[:80]) is False
    assert log.states_evicted.keys() == {(96, records[2]["key"])}
    assert seen["remembered_after_reset"] == []  # a flush forgets every slot
