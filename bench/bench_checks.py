"""Wall time per check on the CPU reference target.

Runs the server suites (one launch per cell) through ``hybrid-conformance run`` for a tier
(default: premerge) and prints the time spent in each check, summed over cells, from the
run's junit.xml, plus launch time (setup of each cell's first test) and the total.

    python bench/bench_checks.py [--tier premerge|standard] [-n 2]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="premerge")
    ap.add_argument("-n", dest="workers", default="0")
    ap.add_argument("--models")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-checks-"))
    cmd = [sys.executable, "-m", "conformance.cli", "run", "--tier", args.tier, "-n", args.workers, "--report-dir", str(out)]
    if args.models:
        cmd += ["--models", args.models]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    junit = out / "junit.xml"
    if not junit.exists():
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        return 1
    per_check: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        suite = case.get("classname", "").split(".")[1] if case.get("classname", "").startswith("conformance.") else "other"
        per_check[suite] += float(case.get("time", 0.0))
        counts[suite] += 1
    print(f"tier={args.tier} workers={args.workers} exit={proc.returncode}")
    print(f"{'check':<18}{'tests':>6}{'seconds':>10}")
    for check, secs in sorted(per_check.items(), key=lambda kv: -kv[1]):
        print(f"{check:<18}{counts[check]:>6}{secs:>10.1f}")
    print(f"{'wall (run)':<18}{'':>6}{wall:>10.1f}")
    print("(test times include each cell's server launch in the setup of its first test)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
