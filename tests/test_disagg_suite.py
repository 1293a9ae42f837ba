"""The disagg suite through the CLI, for the cells that start no server: an
``extra_buffer_lazy`` cell is a stated skip with SGLang's refusal in one line (never a
pass), and nothing is launched for it; a run of nothing but such cells is not green."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conformance.targets.pd_launch import LAZY_REFUSAL


def test_lazy_cells_are_recorded_as_not_applicable_without_a_launch(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--suite", "disagg", "--target", "reference", "--models", "qwen3-next", "--tier", "premerge",
         "--strategies", "extra_buffer_lazy", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    # every selected cell is not applicable: nothing was judged, so the run is not green
    assert out.returncode == 1 and "nothing was judged" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"disagg: {LAZY_REFUSAL}" in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["launches"] == 0 and report["complete"] is False
    cells = {c["id"]: c for c in report["cells"]}
    assert cells and all(c["strategy"] == "extra_buffer_lazy" for c in cells.values())
    for c in cells.values():
        v = c["checks"]["disagg"]
        assert v["status"] == "skip" and v["reason"] == LAZY_REFUSAL


def test_a_disagg_only_run_counts_its_launches_and_draws_its_plots(tmp_path: Path) -> None:
    """One PD cell: the non-PD server and the PD unit are two launches; the PD KL curve and
    the decode server's occupancy timeline are drawn and referenced by report.html."""
    out = subprocess.run(
        [sys.executable, "-m", "conformance.cli", "run", "--suite", "disagg", "--target", "reference", "--models", "qwen3-next", "--tier", "premerge",
         "--strategies", "extra_buffer", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    (cell,) = report["cells"]
    assert cell["checks"]["disagg"]["status"] == "pass"
    assert report["launches"] == 2 and report["launches_by_kind"] == {"pd": 1, "server": 1}
    html = (tmp_path / "report.html").read_text()
    for name in (f"pd_kl_{cell['id']}.png", "pd_pool_extra_buffer.png"):
        assert (tmp_path / "plots" / name).is_file() and f'src="plots/{name}"' in html
