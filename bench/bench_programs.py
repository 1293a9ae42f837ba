"""Programs throughput: the randomized programs on real SGLang on CPU against the reference
engine, in one run.

    python bench/bench_programs.py [--targets sglang-cpu,reference] [--repeats 1]
                                   [--budget premerge] [--models qwen3-next] [--strategies extra_buffer]

Each repeat runs ``hybrid-conformance fuzz --target T --tier premerge --budget B -n 1`` once
per target, targets interleaved (so the machine's load falls on both alike), and reads the
programs verdict's numbers from each run's ``report.json``: requests, seconds, ``idle_s``
(idle checks) and ``cold_s`` (the cache-off twin's batched cold computations).  Prints each
run, then per target the median requests/s and its ratio to the first target's.  The server
start-up is outside the programs' seconds (the verdict's clock starts at the first program).
Asserts nothing; a run whose verdict is not ``pass`` is printed with its status.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(target: str, args: argparse.Namespace, report_dir: Path) -> dict:
    cmd = ["hybrid-conformance", "fuzz", "--target", target, "--tier", "premerge", "--budget", args.budget,
           "--models", args.models, "--strategies", args.strategies, "-n", "1", "--report-dir", str(report_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=os.environ.copy())
    try:
        report = json.loads((report_dir / "report.json").read_text())
    except (OSError, ValueError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": f"no report (exit {proc.returncode}): {tail[0][:200]}"}
    rows = [c["checks"]["programs"] for c in report.get("cells", []) if "programs" in c.get("checks", {})]
    if not rows:
        why = [ln.strip() for ln in proc.stdout.splitlines() if " ERROR" in ln or "FAILED" in ln or "error:" in ln][:1]
        return {"status": f"no programs verdict (exit {proc.returncode}): {(why or ['no error line'])[0][:200]}"}
    m = rows[0].get("metrics", {})
    seconds = float(m.get("seconds") or 0.0)
    requests = int(m.get("requests") or 0)
    return {"status": rows[0].get("status"), "requests": requests, "seconds": seconds,
            "rate": requests / seconds if seconds else 0.0, "idle_s": m.get("idle_s"), "cold_s": m.get("cold_s"),
            "examples": m.get("examples")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="sglang-cpu,reference")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", default="premerge", help="the programs budget (a tier name or seconds)")
    ap.add_argument("--models", default="qwen3-next")
    ap.add_argument("--strategies", default="extra_buffer")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per fuzz run")
    args = ap.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    runs: dict[str, list[dict]] = {t: [] for t in targets}
    with tempfile.TemporaryDirectory(prefix="bench-programs-") as tmp:
        for rep in range(args.repeats):
            for t in targets:
                try:
                    r = run_once(t, args, Path(tmp) / f"{t}-{rep}")
                except subprocess.TimeoutExpired:
                    r = {"status": f"no verdict within {args.timeout:.0f}s"}
                runs[t].append(r)
                nums = (f"{r['requests']} requests in {r['seconds']:.1f}s = {r['rate']:.1f} req/s "
                        f"(examples {r['examples']}, idle_s {r['idle_s']}, cold_s {r['cold_s']})") if "rate" in r else ""
                print(f"repeat {rep + 1} {t:<11} {r['status']:<6} {nums}", flush=True)
    base = None
    print(f"\n{'target':<12} {'median req/s':>12} {'vs ' + targets[0]:>14}")
    for t in targets:
        rates = [r["rate"] for r in runs[t] if "rate" in r]
        if not rates:
            print(f"{t:<12} {'-':>12} {'-':>14}")
            continue
        med = statistics.median(rates)
        base = med if base is None else base
        print(f"{t:<12} {med:>12.1f} {med / base if base else 0.0:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
