"""The kl suite against what real SGLang's tree held (its per-node records): with the seeded
fault ``stored_state_not_reused`` (SGLang 0.5.23 on CPU, the match skips a state its tree
stored), the kl check names ``hit_below_held`` with the state the tree held, besides the
vacuity of the missing hits; with ``first_decode_boundary_unseen`` (the state a first decode
step tracks is never recorded) it names ``state_not_stored`` with the length the storage
rule owes; the same cell without a fault passes (every prompt owed a hit hit it, each at the
length the storage rule owes).  One real SGLang server per run, through the CLI as a user
types it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(1800)]

CELL = "qwen3-next-80b-extra_buffer-p1-t256"


def kl_of(tmp_path: Path, fault: str | None) -> dict:
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    env = {**os.environ, **({"HYBRID_CONFORMANCE_SGLANG_FAULT": fault} if fault else {})}
    env.pop("HYBRID_CONFORMANCE_TARGET", None)
    out = subprocess.run(["hybrid-conformance", "run", "--target", "sglang-cpu", "--cells", CELL, "--suite", "kl", "-n", "0",
                          "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=1500, env=env)
    (cell,) = json.loads((tmp_path / "report.json").read_text())["cells"]
    return cell["checks"]["kl"] | {"exit": out.returncode}


def test_a_stored_state_not_reused_is_hit_below_held_in_the_kl_suite(tmp_path: Path) -> None:
    faulty = kl_of(tmp_path / "fault", "stored_state_not_reused")
    kinds = {f["kind"] for f in faulty["details"]["findings"]}
    assert faulty["status"] == "fail" and faulty["exit"] == 1 and "hit_below_held" in kinds, faulty.get("reason")
    assert "SGLang held a state of" in faulty["reason"] and "per-node records" in faulty["reason"]
    clean = kl_of(tmp_path / "clean", None)
    assert clean["status"] == "pass" and clean["metrics"]["hit_fraction"] == 1.0, clean.get("reason")
    owed = [m for m in clean["details"]["modelled"] if m["modelled"] > 0]  # decode_hit: the state turn one's finish caches
    assert owed and all(m["cached_tokens"] == m["modelled"] for m in owed), clean["details"]["modelled"]


def test_a_first_decode_boundary_never_recorded_is_state_not_stored_in_the_kl_suite(tmp_path: Path) -> None:
    faulty = kl_of(tmp_path / "fault", "first_decode_boundary_unseen")
    lost = [f for f in faulty["details"]["findings"] if f["kind"] == "state_not_stored"]
    assert faulty["status"] == "fail" and faulty["exit"] == 1 and lost, faulty.get("reason")
    assert all(f["facts"]["scenario"] == "decode_hit" and f["facts"]["modelled"] > f["facts"]["cached_tokens"] for f in lost), lost
    assert "never took the state for the prefix of" in faulty["reason"] and "per-node records" in faulty["reason"]
