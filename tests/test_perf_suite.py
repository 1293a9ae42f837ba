"""The perf suite end to end through the console script.

On the kit's reference engine (allowed when asked for, and labelled as not SGLang): every
cell gets a perf block with the contract's keys and ratios inside the run.  On real
SGLang on CPU (opt-in, ``-m fault_probe``: four server launches): a run with the seeded
``track_path_slowdown`` is flagged by ``compare`` against a clean run, and only on the
cells whose track path it slows."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conformance.report.perf import BLOCK_KEYS

ROOT = Path(__file__).resolve().parents[1]


def _run(report_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 1500) -> dict:
    cmd = ["hybrid-conformance", "run", "--suite", "perf", "--models", "qwen3-next", "--faults", "none", "--report-dir", str(report_dir), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {}), "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((report_dir / "report.json").read_text())


@pytest.mark.timeout(1200)
def test_perf_on_the_reference_engine_is_labelled_and_has_every_block(tmp_path: Path) -> None:
    report = _run(tmp_path / "ref", "--target", "reference", "--tier", "premerge", "-n", "0")
    assert report["complete"] and len(report["cells"]) == 3
    for cell in report["cells"]:
        block = cell["perf"]
        assert set(BLOCK_KEYS) <= set(block) and block["repeats"] == 9 and block["status"] == "pass"
        assert block["engine"].startswith("reference: the kit's own engine (not SGLang")
        assert block["ttft_cold_s"] > 0 and block["ttft_hit_s"] > 0 and block["decode_tok_s"] > 0 and block["hit_ratio"] > 0.5
    by = {c["strategy"]: c["perf"] for c in report["cells"]}
    assert "ttft_vs_no_buffer" in by["extra_buffer"]["ratios"] and "ttft_vs_no_buffer" not in by["no_buffer"]["ratios"]
    assert by["extra_buffer_lazy"]["ratios"]["resident_vs_extra_buffer"] == 0.5  # the lazy claim, on the kit's engine
    assert "## Performance" in (tmp_path / "ref" / "report.md").read_text()


@pytest.mark.fault_probe
@pytest.mark.timeout(3600)
def test_a_seeded_slowdown_on_real_sglang_is_flagged_by_compare(tmp_path: Path) -> None:
    from sglang_cpu_probes import require_sglang

    require_sglang()
    args = ("--target", "sglang-cpu", "--strategies", "no_buffer,extra_buffer", "--tier", "premerge")
    clean = _run(tmp_path / "clean", *args)
    slow = _run(tmp_path / "slow", *args, env={"HYBRID_CONFORMANCE_SGLANG_FAULT": "track_path_slowdown"})
    fired = [json.loads(line) for p in (tmp_path / "slow" / "logs").glob("*.plugins.jsonl") for line in p.read_text().splitlines()]
    assert any(r.get("status") == "fired" and r.get("fault") == "track_path_slowdown" for r in fired)
    assert all(c["perf"]["engine"].startswith("SGLang 0.5.23") for c in clean["cells"] + slow["cells"])
    out = subprocess.run(["hybrid-conformance", "compare", str(tmp_path / "clean"), str(tmp_path / "slow")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "250"})
    assert out.returncode == 1 and "REGRESSED" in out.stdout, out.stdout
    perf_rows = [ln for ln in out.stdout.splitlines() if ln.startswith("│ perf")]
    assert perf_rows and all("extra_buffer" in ln for ln in perf_rows), out.stdout
