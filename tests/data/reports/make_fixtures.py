"""Regenerate the recorded report fixtures: ``python tests/data/reports/make_fixtures.py``.

clean/report.json    a plausible nightly run on target sglang, every check passing
                     except one recorded skip and one cell without KL details;
regressed/report.json the same run with one regression of every kind seeded:
                     a leak (pass -> fail), KL up 10x, GSM8K accuracy below the old
                     Wilson bound, two more launches, 1.8x the wall time, a cell missing.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

from conformance.matrix.cells import load_matrix
from conformance.records import Verdict
from conformance.report.plots import wilson_interval
from conformance.report.schema import build_report, dump_report, status_counts

HERE = Path(__file__).resolve().parent
CELL_IDS = (
    "qwen3-next-80b-no_buffer-p1-t256",
    "qwen3-next-80b-extra_buffer-p1-t256",
    "qwen3-next-80b-extra_buffer_lazy-p1-t256",
    "qwen3-next-80b-extra_buffer_lazy-p1-t256-lazy_alloc_fail",
    "nemotron-nano-9b-v2-extra_buffer-p64-t256",
)


def _verdicts(cell, rng: random.Random) -> dict:
    lazy = cell.strategy.name == "extra_buffer_lazy"
    floor = 2e-5
    per_pos = [[p, float(f"{abs(rng.gauss(floor, floor / 2)) * (3 if p > 256 else 1):.3g}")] for p in range(0, 600, 12)]
    kl_details = {"per_position": per_pos, "boundaries": [256, 512]} if cell.model.id.startswith("qwen") else {}
    kl = Verdict("kl", "pass", {
        "tokens": len(per_pos), "k3_mean": 1.1e-4, "topk_kl_mean": 6e-5, "max_token_kl": 4e-4,
        "hit_fraction": 0.97, "noise_floor": floor,
    }, details=kl_details)
    hits = 0 if cell.fault.injected else 6
    pb = Verdict("prefix_branching", "pass", {"requests": 9, "hits_expected": hits, "hits_observed": hits, "mismatches": 0})
    timeline, t = [], 0.0
    for i in range(25):
        running = min(i, 24 - i, 8)
        timeline.append([round(t, 2), running * (2 if lazy else 3), running * 300, running])
        t += 0.5
    leaks = Verdict("leaks", "pass", {
        "mamba_used_at_idle": 0, "kv_used_at_idle": 0, "leak_log_lines": 0,
        "lazy_resident_ratio": 0.52 if lazy else None,
    }, details={"timeline": timeline})
    if cell.model.id.startswith("nemotron"):
        gsm = Verdict("gsm8k", "skip", reason="gsm8k runs on page size 1 cells only")
    else:
        n, correct = 200, 190 - rng.randrange(3)
        low, high = wilson_interval(correct / n, n)
        gsm = Verdict("gsm8k", "pass", {"n": n, "accuracy": correct / n, "wilson_low": low, "agreement": 0.99},
                      details={"wilson_high": high})
    return {v.check: v.to_json() for v in (kl, pb, leaks, gsm)}


def clean_report() -> dict:
    rng = random.Random(0)
    cells = {c.id: c for c in load_matrix().cells}
    rows = [dict(cells[cid].describe(), checks=_verdicts(cells[cid], rng)) for cid in CELL_IDS]
    report = build_report("sglang", 5, 1800.0, rows)
    report["generated_at"] = "2026-11-20T02:00:00+00:00"
    return report


def regressed_report(clean: dict) -> dict:
    report = copy.deepcopy(clean)
    report["launches"] += 2
    report["wall_s"] = 3240.0
    report["generated_at"] = "2026-11-21T02:00:00+00:00"
    report["cells"] = [c for c in report["cells"] if c["id"] != CELL_IDS[4]]
    by_id = {c["id"]: c for c in report["cells"]}
    kl = by_id[CELL_IDS[1]]["checks"]["kl"]
    kl["metrics"]["topk_kl_mean"] *= 10
    kl["details"]["per_position"] = [[p, float(f"{v * 10:.3g}") if p >= 256 else v] for p, v in kl["details"]["per_position"]]
    leaks = by_id[CELL_IDS[2]]["checks"]["leaks"]
    leaks.update(status="fail", reason="3 mamba slots still used at idle (ping-pong slots leaked)")
    leaks["metrics"]["mamba_used_at_idle"] = 3
    leaks["details"]["timeline"][-1][1] = 3
    gsm = by_id[CELL_IDS[0]]["checks"]["gsm8k"]
    n = gsm["metrics"]["n"]
    gsm["metrics"]["accuracy"] = 168 / n
    gsm["metrics"]["wilson_low"], gsm["details"]["wilson_high"] = wilson_interval(168 / n, n)
    report["summary"] = status_counts(report["cells"])
    return report


if __name__ == "__main__":
    clean = clean_report()
    for name, report in (("clean", clean), ("regressed", regressed_report(clean))):
        (HERE / name).mkdir(exist_ok=True)
        (HERE / name / "report.json").write_text(dump_report(report))
        print(f"wrote {HERE / name / 'report.json'}")
