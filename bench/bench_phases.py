"""Where a run spends its wall time, per phase: server start and stop, the cold twin, each
suite, idle probes, pytest collection, and for CI each step of ``.ci/run``.

    python bench/bench_phases.py premerge [--repeats 3] [--suite kl] [--cell ID] [-n 2] [--launch preimported,preimported-fork]
    python bench/bench_phases.py ci [--repeats 1]
    python bench/bench_phases.py table REPORT_DIR [REPORT_DIR ...]

``premerge`` runs ``hybrid-conformance run --target sglang-cpu --tier premerge`` (with
``--suite``/``--cell`` narrowed: ``--suite kl --cell qwen3-next-80b-extra_buffer-p1-t256`` is
one cell's kl suite) ``--repeats`` times; ``ci`` runs the steps of ``.ci/run`` one after
another (``bash ci/setup-cpu.sh``, then each of the README's pytest runs, with a report
directory each). Each run's report.json carries ``phases`` (``conformance.report.phases``:
timed where they happen, summed over the xdist workers, so a phase can exceed the wall);
the bench prints one table, the median over the repeats per row, and the wall it measured
itself around each command. ``--launch`` takes launch modes (``HYBRID_CONFORMANCE_LAUNCH``),
runs them interleaved in each repeat and prints a table per mode plus each mode's median wall
over the first's (a ratio from one run, under the same load). ``table`` prints the same table from report directories a run
already wrote. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_runs() -> list[list[str]]:
    """The pytest argument lists of the README's test command (what ``.ci/run`` runs)."""
    block = (ROOT / "README.md").read_text().split("```bash\n")[2].split("```")[0].strip()
    runs = []
    for segment in re.split(r"&&", block):
        words = shlex.split(segment)
        if words[:3] == ["python3", "-m", "pytest"]:
            runs.append(words[3:])
    return runs


def rows_of(report_dir: Path) -> dict[str, float]:
    """One run's table rows (seconds) from its report.json's ``phases``; a run that wrote no
    report ends the bench with one line naming it."""
    path = report_dir / "report.json"
    if not path.exists():
        raise SystemExit(f"bench_phases: the measured run wrote no {path} (it failed before its report; its output is above)")
    doc = json.loads(path.read_text())["phases"]
    rows = {"wall (report)": doc["wall_s"]}
    if doc.get("collection_s") is not None:
        rows["collection + worker start"] = doc["collection_s"]
    for name, secs in doc["phases"].items():
        rows[f"phase: {name}"] = secs
    for suite, d in doc["suites"].items():
        for when in ("setup", "call", "teardown"):
            if d.get(when):
                rows[f"{suite}: {when} ({d['tests']} tests)"] = d[when]
    return rows


def timed_run(argv: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    subprocess.run(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, check=False)
    return time.monotonic() - start


def print_table(title: str, runs: list[dict[str, float]]) -> None:
    print(f"\n{title} (seconds; median of {len(runs)}; phases summed over workers)")
    names = list(dict.fromkeys(k for r in runs for k in r))
    width = max(len(n) for n in names) + 2
    print(f"{'':{width}}{'median':>10}{'min':>10}{'max':>10}")
    for name in names:
        vals = [r[name] for r in runs if name in r]
        print(f"{name:{width}}{statistics.median(vals):10.1f}{min(vals):10.1f}{max(vals):10.1f}")


def premerge(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    modes = [m for m in (args.launch or "").split(",") if m] or [None]
    runs: dict[str | None, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in modes:
            out = work / f"premerge-{i}-{mode or 'default'}"
            argv = ["hybrid-conformance", "run", "--target", "sglang-cpu", "--tier", "premerge", "--report-dir", str(out), "-n", str(args.n)]
            if args.suite:
                argv += ["--suite", args.suite]
            if args.cell:
                argv += ["-k", args.cell]
            wall = timed_run(argv, {**env, "HYBRID_CONFORMANCE_LAUNCH": mode} if mode else env)
            runs[mode].append({"wall (measured)": wall, **rows_of(out)})
    shown = " ".join(a for a in argv if not a.startswith(str(work)))
    for mode in modes:
        print_table(f"HYBRID_CONFORMANCE_LAUNCH={mode} {shown}" if mode else shown, runs[mode])
    if len(modes) > 1:
        first = statistics.median(r["wall (measured)"] for r in runs[modes[0]])
        for mode in modes[1:]:
            print(f"wall {mode} / {modes[0]}: {statistics.median(r['wall (measured)'] for r in runs[mode]) / first:.3f}")


def ci(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    runs = []
    for i in range(args.repeats):
        rows = {"setup: bash ci/setup-cpu.sh": timed_run(["bash", "ci/setup-cpu.sh"], env)}
        for k, pytest_args in enumerate(readme_test_runs(), 1):
            out = work / f"ci-{i}-{k}"
            rows[f"pytest run {k}: wall"] = timed_run([sys.executable, "-m", "pytest", *pytest_args, f"--report-dir={out}", "-q"], env)
            rows.update({f"pytest run {k}: {name}": v for name, v in rows_of(out).items()})
        runs.append(rows)
    print_table(".ci/run, step by step", runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    pre = sub.add_parser("premerge")
    pre.add_argument("--repeats", type=int, default=3)
    pre.add_argument("--suite")
    pre.add_argument("--cell", help="one cell id (passed as -k)")
    pre.add_argument("-n", type=int, default=2)
    pre.add_argument("--launch", help="launch modes to compare, comma-separated (HYBRID_CONFORMANCE_LAUNCH), run interleaved")
    c = sub.add_parser("ci")
    c.add_argument("--repeats", type=int, default=1)
    t = sub.add_parser("table")
    t.add_argument("dirs", nargs="+", type=Path)
    args = p.parse_args()
    if args.what == "table":
        print_table("from report.json", [rows_of(d) for d in args.dirs])
        return
    env = {**os.environ, "HYBRID_CONFORMANCE_GSM8K_DIR": os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR") or str(ROOT.parent / "shared" / "data" / "gsm8k")}
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        (premerge if args.what == "premerge" else ci)(args, env, Path(tmp))


if __name__ == "__main__":
    main()
