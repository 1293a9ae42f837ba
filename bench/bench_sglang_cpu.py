"""Benchmark of the ``sglang-cpu`` target (real SGLang on CPU serving the twins): server
start-up, prefill and decode tokens/s per twin and strategy, and the wall time of the same
small cell workload on real SGLang against the reference engine.

    python bench/bench_sglang_cpu.py [--models tiny-qwen3-next tiny-nemotron-h]
                                     [--strategies no_buffer extra_buffer extra_buffer_lazy]
                                     [--prompt-len 1000] [--decode 128] [--repeats 2]

Start-up is split with SGLang's own "Engine startup timings" log line (tokenizer process,
scheduler process).  The cell workload is the agreement script (conformance/workloads/
agreement.py): the ratio column is SGLang's wall time over the reference engine's for the
same requests.  Prints numbers only; nothing is asserted (the machine's load moves them:
compare ratios taken in one run).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

from conformance.matrix.cells import load_matrix
from conformance.plugin import Options
from conformance.targets.serving import serve_cell
from conformance.workloads.agreement import agreement_script, run_agreement
from conformance.workloads.prompts import token_prompts
from conformance.workloads.runners import generate_tokens

STARTUP = re.compile(r"Engine startup timings \(s\): (.*)")


def _options(target: str) -> Options:
    return Options(target=target, models=None, strategies=None, faults=None, page_sizes=None, tier=None, matrix_path=None,
                   report_dir=None, log_dir=None, sglang_launcher="python -m sglang.launch_server", gpus_per_worker=1,
                   twins=False, gsm8k_dir=None)


def _startup_parts(log: str) -> str:
    m = STARTUP.search(log)
    if not m:
        return "-"
    keep = ("scheduler_e2e", "tokenizer_e2e", "load_weight")
    return ", ".join(p.strip() for p in m.group(1).split(",") if p.strip().split("=")[0] in keep)


def _tok_s(client, vocab: int, prompt_len: int, decode: int, repeats: int, seed: int) -> tuple[float, float]:
    pre, dec = [], []
    for r in range(repeats):
        client.flush_cache()
        (p,) = token_prompts([prompt_len], vocab_size=vocab, seed=seed + r)
        t0 = time.perf_counter()
        generate_tokens(client, [p], 1)
        t1 = time.perf_counter()
        client.flush_cache()
        generate_tokens(client, [p], decode + 1)
        t2 = time.perf_counter()
        pre.append(prompt_len / (t1 - t0))
        dec.append(decode / max(1e-9, (t2 - t1) - (t1 - t0)))
    return statistics.median(pre), statistics.median(dec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-qwen3-next", "tiny-nemotron-h"])
    ap.add_argument("--strategies", nargs="+", default=["no_buffer", "extra_buffer", "extra_buffer_lazy"])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    cells = {(c.model.twin, c.strategy.name): c for c in load_matrix().select(tier="standard") if not c.fault.injected}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-sglang-cpu-"))
    print(f"{'twin':18} {'strategy':18} {'start s':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'cell s sglang':>14} {'cell s ref':>11} {'ratio':>6}  start-up parts")
    for twin in args.models:
        for strategy in args.strategies:
            cell = cells[(twin, strategy)]
            script = agreement_script(chunk=cell.grid.chunk, grid=cell.grid.track_grid, vocab_size=32000)
            walls = {}
            for target in ("sglang-cpu", "reference"):
                t0 = time.perf_counter()
                with serve_cell(cell, _options(target), log_dir=log_dir / target) as ep:
                    start_s = time.perf_counter() - t0
                    vocab = int(ep.info.get("vocab_size") or 32000)
                    if target == "sglang-cpu":
                        pre, dec = _tok_s(ep.client, vocab, args.prompt_len, args.decode, args.repeats, seed=7)
                        sg_start, parts = start_s, _startup_parts(ep.log_text())
                    t1 = time.perf_counter()
                    run_agreement(ep.client, script)
                    walls[target] = time.perf_counter() - t1
            print(f"{twin:18} {strategy:18} {sg_start:8.1f} {pre:14.0f} {dec:13.1f} {walls['sglang-cpu']:14.2f} {walls['reference']:11.2f} "
                  f"{walls['sglang-cpu'] / walls['reference']:6.2f}  {parts}", flush=True)


if __name__ == "__main__":
    main()
