"""Benchmark of the reference engine (in process, no HTTP): prefill and decode tokens/s per
model, and the prefill time of a cache hit against a miss.

    python bench/bench_reference.py [--models tiny-qwen3-next toy] [--strategy extra_buffer]
                                    [--prompt-len 1024] [--decode 64] [--repeats 3]

The hit request is the missed prompt plus ``--tail`` new tokens; it re-computes only the
uncached tokens, so its prefill should cost about (uncached tokens / missed prompt) of the
miss: the last column prints that expected ratio next to the measured one.  Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from conformance.reference.drive import make_req
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.loader import known_models, load_model


def _prefill_seconds(eng: Engine, ids: list[int]) -> tuple[float, int]:
    """Time of the step that admits and prefills one request (1 output token)."""
    req = make_req(ids, 1, logprobs=False)
    eng.submit(req)
    t0 = time.perf_counter()
    eng.step()
    elapsed = time.perf_counter() - t0
    while eng.step():  # let it finish
        pass
    return elapsed, req.prefix_len


def bench_model(name: str, strategy: str, prompt_len: int, decode: int, repeats: int, tail_len: int) -> dict:
    model = load_model(name)
    rng = random.Random(0)
    prompt_len = min(prompt_len, model.max_context - decode - tail_len)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(prompt_len)] for _ in range(repeats)]
    miss, hit, decode_rates, hit_len = [], [], [], 0
    for ids in prompts:
        eng = Engine(model, EngineConfig(strategy=strategy))
        t, _ = _prefill_seconds(eng, ids)
        miss.append(t)
        tail = ids + [rng.randrange(3, model.vocab_size) for _ in range(tail_len)]
        t, hit_len = _prefill_seconds(eng, tail)
        hit.append(t)
        req = make_req(ids[: prompt_len // 2], decode, logprobs=False)
        eng.submit(req)
        eng.step()  # prefill
        t0 = time.perf_counter()
        while eng.step():
            pass
        decode_rates.append((decode - 1) / (time.perf_counter() - t0))
    m, h = statistics.median(miss), statistics.median(hit)
    uncached = prompt_len + tail_len - hit_len
    return {"model": name, "strategy": strategy, "prompt": prompt_len, "prefill_tok_s": prompt_len / m,
            "decode_tok_s": statistics.median(decode_rates), "miss_s": m, "hit_s": h, "hit_len": hit_len,
            "measured_ratio": h / m, "expected_ratio": uncached / prompt_len}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=[n for n in known_models() if n != "toy"])
    p.add_argument("--strategy", default="extra_buffer")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tail", type=int, default=256, help="uncached tokens appended for the hit")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    head = f"{'model':<18} {'strategy':<18} {'prompt':>6} {'prefill tok/s':>13} {'decode tok/s':>12} " \
           f"{'miss s':>8} {'hit s':>8} {'hit len':>7} {'hit/miss':>8} {'uncached/miss':>13}"
    print(head)
    for name in args.models:
        r = bench_model(name, args.strategy, args.prompt_len, args.decode, args.repeats, args.tail)
        print(f"{r['model']:<18} {r['strategy']:<18} {r['prompt']:>6} {r['prefill_tok_s']:>13.0f} "
              f"{r['decode_tok_s']:>12.1f} {r['miss_s']:>8.3f} {r['hit_s']:>8.3f} {r['hit_len']:>7} "
              f"{r['measured_ratio']:>8.3f} {r['expected_ratio']:>13.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
