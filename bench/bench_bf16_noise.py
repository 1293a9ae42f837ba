"""The programs' bfloat16 noise on real SGLang on CPU, and the fixture the unit tests replay.

    python bench/bench_bf16_noise.py [--cell qwen3-next-80b-extra_buffer-p1-t256] [--batches 8]
                                     [--save tests/data/checks/programs_noise_bf16.json.gz]

Starts the cell in bfloat16 and its cache-off twin (the programs' cold side), then measures
``--batches`` calibration batches (``conformance/programs/noise.py``: 8 fresh prompts served
in one batch, 16 new tokens each, against the twin's cold computation), each with its own
prompts.  Prints per batch the largest per-token top-k KL and greedy gap and the tolerance
that batch alone would set (what a programs run measures at its start), then the largest
noise over all batches: a clean maximum the first batch's tolerance must admit.  With
``--save`` writes the raw answers (tests/test_bf16_limits.py replays them).  Asserts nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

from conformance.matrix.cells import load_matrix
from conformance.session.options import resolve
from conformance.programs import noise
from conformance.programs.bind import prepare_twin, serve_cold
from conformance.session.suite_support import vocab_size
from conformance.targets import preimport
from conformance.targets.serving import serve_cell
from conformance.workloads.prompts import token_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="qwen3-next-80b-extra_buffer-p1-t256")
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--save", type=Path, default=None)
    args = ap.parse_args()
    opts = resolve(lambda flag: {"--target": "sglang-cpu", "--dtype": "bfloat16"}.get(flag))
    cell = next(c for c in load_matrix().cells if c.id == args.cell)
    logs = Path(tempfile.mkdtemp(prefix="bench-bf16-noise-"))
    prepare_twin(cell)
    batches = []
    t0 = time.time()
    try:
        with serve_cold(cell, opts, logs / "cold") as cold, serve_cell(cell, opts, log_dir=logs / "cell") as ep:
            print(f"servers up in {time.time() - t0:.0f}s (logs {logs})", flush=True)
            vocab = vocab_size(ep)
            for b in range(args.batches):
                measured = noise.measure(ep.client, cold.client, token_prompts(noise.LENGTHS, vocab_size=vocab, seed=f"programs:noise:{b}"))
                tol, m = noise.tolerance(measured)
                batches.append(measured)
                print(f"batch {b}: {m['tokens']} tokens, top-k KL max {m['kl_max']:.3g} mean {m['kl_mean']:.3g}, greedy gap max {m['gap_max']:.3g}"
                      f" -> kl_cap {tol.kl_cap:.3g}, tie {tol.tie_eps:.3g}", flush=True)
    finally:
        preimport.stop_all()
    kls, gaps = noise.samples([r for b in batches for r in b])
    first, _ = noise.tolerance(batches[0])
    over = sum(k > first.kl_cap for k in kls)
    print(f"all {len(batches)} batches: {len(kls)} tokens, top-k KL max {max(kls):.3g}, above the old 5e-3 cap: {sum(k > 5e-3 for k in kls)};"
          f" above batch 0's measured cap {first.kl_cap:.3g}: {over}; greedy gap max {max(gaps):.3g} (tie {first.tie_eps:.3g})")
    if args.save:
        with gzip.open(args.save, "wt") as f:
            json.dump({"cell": cell.id, "dtype": "bfloat16", "batches": batches}, f)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
