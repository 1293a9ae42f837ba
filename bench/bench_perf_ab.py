"""Detection rates of the paired A/B perf test on real SGLang on CPU (docs/perf.md).

    python bench/bench_perf_ab.py [--cell qwen3-next-80b-extra_buffer-p1-t256] [--repeats 10]
                                  [--grades 0,0.05,0.1,0.2] [--pairs 30] [--json out.json]

Each repeat starts a fresh pair of servers of the cell (both with the seeded fault
``step_slowdown`` at grade 0, ``conformance/suites/perf/ab.py``), then, for each grade in a random
order, slows a randomly drawn side by that fraction of each step's work and runs one paired
A/B (``--pairs`` prompts, each sent to both servers back to back in a random order, or
with ``--together`` at the same moment; by default each block of two pairs slows each side
once, ``--no-crossover`` one side for the run), judged
by ``conformance.checks.perf_ab.ab_verdict`` at the stated false-flag rate.  Grade 0 is the
clean pair.  Prints each run's verdict line, then per grade: runs flagged (the verdict judges
the servers' CPU time), median B/A of TTFT, decode time per token and CPU time, and how many
runs a wall-time metric alone would have flagged at the same rate (reported, not judged).
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from conformance.checks.perf_ab import ALPHA
from conformance.matrix.cells import load_matrix
from conformance.session.options import resolve
from conformance.suites.perf.ab import AbPlan, graded_runs
from conformance.targets import preimport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="qwen3-next-80b-extra_buffer-p1-t256")
    ap.add_argument("--target", default="sglang-cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--grades", default="0,0.05,0.1,0.2")
    ap.add_argument("--pairs", type=int, default=AbPlan.pairs)
    ap.add_argument("--prompt-len", type=int, default=AbPlan.prompt_len)
    ap.add_argument("--new-tokens", type=int, default=AbPlan.new_tokens)
    ap.add_argument("--warmup", type=int, default=AbPlan.warmup)
    ap.add_argument("--together", action="store_true", help="the two sides of a pair at the same moment (default: back to back in a random order)")
    ap.add_argument("--no-crossover", action="store_true", help="one drawn side slowed for a whole run (default: each side in turn, per block of two pairs)")
    ap.add_argument("--alpha", type=float, default=ALPHA)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--max-seconds", type=float, default=None, help="start no paired run after this many seconds (a shared slot's end)")
    args = ap.parse_args()
    grades = [float(g) for g in args.grades.split(",")]
    plan = AbPlan(pairs=args.pairs, prompt_len=args.prompt_len, new_tokens=args.new_tokens, warmup=args.warmup, together=args.together,
                  crossover=not args.no_crossover)
    opts = resolve(lambda flag: {"--target": args.target}.get(flag))
    cell = next(c for c in load_matrix().cells if c.id == args.cell)
    rows: list[dict] = []
    t_start = time.time()
    try:
        for run in graded_runs(cell, opts, grades=grades, repeats=args.repeats, plan=plan, alpha=args.alpha, seed=args.seed,
                               work_dir=Path(tempfile.mkdtemp(prefix="bench-perf-ab-"))):
            rows.append(run.row())
            if args.json:  # after every run: a run cut short by its timeout keeps what it measured
                args.json.write_text(json.dumps({"cell": cell.id, "plan": vars(plan), "alpha": args.alpha, "runs": rows}, indent=1))
            print(f"repeat {run.repeat + 1} grade +{run.grade:.0%} (side {run.slowed}) {run.seconds:.1f}s: {run.verdict.line()}"
                  f" [{time.time() - t_start:.0f}s]", flush=True)
            if args.max_seconds and time.time() - t_start > args.max_seconds:
                print(f"stopped after {len(rows)} runs: --max-seconds {args.max_seconds:g} reached", flush=True)
                break
    finally:
        preimport.stop_all()
    print(f"\n{len(rows)} runs ({args.repeats} repeats x {len(grades)} grades planned), {plan.pairs} pairs each, {time.time() - t_start:.0f}s; cell {cell.id}; false-flag rate {args.alpha:g}")
    print(f"{'grade':>7} {'flagged':>9} {'TTFT B/A':>9} {'decode B/A':>11} {'CPU B/A':>8} {'wall p < alpha':>15}")
    for g in grades:
        mine = [x for x in rows if x["grade"] == g]
        if mine:
            cpu = [x["cpu_ratio"] for x in mine if "cpu_ratio" in x]
            print(f"{'+' + format(g, '.0%'):>7} {sum(x['flagged'] for x in mine):>4} / {len(mine):<3} "
                  f"{statistics.median(x['ttft_ratio'] for x in mine):9.3f} {statistics.median(x['decode_per_token_ratio'] for x in mine):11.3f}"
                  f" {statistics.median(cpu) if cpu else float('nan'):8.3f}"
                  f" {sum(min(x['ttft_p'], x['decode_per_token_p']) < args.alpha for x in mine):>9} / {len(mine)}")


if __name__ == "__main__":
    main()
