"""Which KL estimator catches which state corruption, at the anchor's token budget.

Starts the reference server once per fault (HYBRID_CONFORMANCE_FAULT), records the KL
prefill-hit (and optionally decode-hit) scenario with ``record_kl``, and prints, per
fault, SGLang's averaged chosen-token estimator at its 0.002 threshold, the same
estimator's per-sequence maximum, the top-k KL against the clean run's measured floor,
and greedy-token disagreement.

    python bench/bench_kl_estimators.py --model tiny-qwen3-next --prompts 32 \
        --min-len 128 --max-len 512 --faults state_scaled_1pct,track_boundary_early

Fault names pass straight through to the server; the default list is every reference
fault whose documented symptom is a divergence on a hit (``lazy_*`` faults run under
``extra_buffer_lazy`` with SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from conformance.checks.kl import kl_verdict
from conformance.client import SGLangClient
from conformance.matrix.faults import FAULT_ENV, LAZY_ALLOC_FAIL_ENV
from conformance.recordings import KLRecording
from conformance.targets.launcher import ServerProcess, free_port
from conformance.workloads.prompts import decode_cross_lengths, prefill_hit_lengths, token_prompts
from conformance.workloads.runners import record_kl

ANCHOR = 0.002


def kl_faults() -> list[str]:
    from conformance.reference.faults import FAULTS

    words = ("kl", "diverge", "logprob", "differ")
    return [f.name for f in FAULTS.values() if any(w in f.observable.lower() for w in words)]


def record(fault: str, args: argparse.Namespace, logdir: Path) -> list[KLRecording]:
    port = free_port()
    lazy = fault.startswith("lazy_")  # lazy-path faults only fire under extra_buffer_lazy with alloc failing
    strategy = "extra_buffer_lazy" if lazy else args.strategy
    argv = [sys.executable, "-m", "conformance.reference.server", "--model", args.model, "--strategy", strategy, "--port", str(port)]
    env = {"OMP_NUM_THREADS": "1", FAULT_ENV: "" if fault == "none" else fault}
    if lazy:
        env[LAZY_ALLOC_FAIL_ENV] = "1"
    srv = ServerProcess(f"ref-{fault}", argv, f"http://127.0.0.1:{port}/health", logdir / f"{fault}.log", env)
    with srv.start(), SGLangClient(f"http://127.0.0.1:{port}", timeout=args.timeout, liveness=srv.exit_reason) as client:
        info = client.server_info()
        vocab, chunk, track = int(info.get("vocab_size", 512)), int(info["mamba_cache_chunk_size"]), int(info["mamba_track_interval"])
        lengths = prefill_hit_lengths(chunk, track, n=args.prompts, min_len=args.min_len, max_len=args.max_len)
        lengths = (lengths * math.ceil(args.prompts / len(lengths)))[: args.prompts]
        recs = [record_kl(client, token_prompts(lengths, vocab_size=vocab, seed=args.seed), vocab_size=vocab, new_tokens=args.new_tokens, top_k=args.top_k)]
        if args.decode:
            dl = decode_cross_lengths(track, args.new_tokens, n=args.prompts, min_len=args.min_len, max_len=args.max_len)
            dl = (dl * math.ceil(args.prompts / len(dl)))[: args.prompts]
            prompts = token_prompts(dl, vocab_size=vocab, seed=args.seed + 1)
            recs.append(record_kl(client, prompts, scenario="decode_hit", new_tokens=args.new_tokens, turn1_tokens=args.new_tokens, vocab_size=vocab, top_k=args.top_k))
    return recs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-qwen3-next")
    p.add_argument("--strategy", default="extra_buffer")
    p.add_argument("--faults", default="", help="comma list (default: every KL-visible reference fault)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--floor-factor", type=float, default=100.0)
    p.add_argument("--decode", action="store_true", help="also run the decode-hit scenario")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    faults = [f for f in args.faults.split(",") if f] or kl_faults()
    logdir = Path(tempfile.mkdtemp(prefix="bench-kl-"))
    print(f"model {args.model}, strategy {args.strategy}, {args.prompts} prompts x {args.min_len}-{args.max_len} tokens, {args.new_tokens} new, top-{args.top_k}; logs {logdir}")
    floor = None
    header = f"{'fault':28} {'scen':7} {'hit':>5} {'k3 mean':>9} {'k3 seqmax':>9} {'topk seqmax':>11} {'max tok':>9} {'greedy%':>7}  caught by"
    print(header)
    for fault in ["none", *faults]:
        t0 = time.monotonic()
        try:
            recs = record(fault, args, logdir)
        except Exception as e:  # one line per failed fault, keep benchmarking the rest
            print(f"{fault:28} ERROR {type(e).__name__}: {str(e)[:150]}")
            continue
        for rec in recs:
            v = kl_verdict(rec, chunk=1, track_interval=1, hit_fraction_min=0.0, abs_cap=math.inf, exact=True)
            m = v.metrics
            if m.get("k3_mean") is None:
                print(f"{fault:28} {rec.sequences[0].scenario[:7]:7} no hit: {v.reason}")
                continue
            if fault == "none" and floor is None:
                floor = max(m["noise_floor"] or 0.0, m["topk_kl_seq_max"])
            limit = max(args.floor_factor * (floor or 0.0), 1e-9)
            caught = [
                name
                for name, hit in (
                    ("sglang-k3", m["k3_mean"] >= ANCHOR),
                    ("k3-seqmax", m["k3_seq_max"] >= ANCHOR),
                    ("topk-vs-floor", m["topk_kl_seq_max"] > limit),
                    ("greedy", m["argmax_mismatch_fraction"] > 0),
                )
                if hit
            ]
            print(
                f"{fault:28} {rec.sequences[0].scenario[:7]:7} {m['hit_fraction']:5.2f} {m['k3_mean']:9.2e} {m['k3_seq_max']:9.2e} "
                f"{m['topk_kl_seq_max']:11.2e} {m['max_token_kl']:9.2e} {100 * m['argmax_mismatch_fraction']:7.1f}  {', '.join(caught) or '-'}"
            )
        print(f"{'':28} ({time.monotonic() - t0:.1f}s)")
    print(f"clean floor (top-k KL, per-sequence max, clean hit vs cold) = {floor:.2e}; topk limit = {max(args.floor_factor * (floor or 0.0), 1e-9):.2e}" if floor is not None else "no clean floor measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
