"""Programs the reference engine once answered wrongly, replayed through the console script:
each must pass on the reference target (the engine models SGLang's rule that made it pass)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).resolve().parent.parent / "fixtures" / "programs"


@pytest.mark.parametrize("name", ["reference_lazy_burst_member_followup.json"])
def test_reference_replay_passes(name: str) -> None:
    """A granite-h extra_buffer_lazy burst of 26 members of 256 tokens, then member 21's prompt
    + 5: without SGLang's Mamba cap on running requests the member's checkpoint found no slot
    and was dropped with no eviction counted, so the follow-up hit 0 where the oracle owed 256."""
    proc = subprocess.run(["hybrid-conformance", "replay", str(PROGRAMS / name), "--target", "reference"],
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "0/1 runs failed" in out and "run 1: PASS" in out, out[-3000:]
