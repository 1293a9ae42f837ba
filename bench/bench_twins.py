"""Speed of the tiny twins on CPU: generation, load, prefill and decode tokens/s.

    python bench/bench_twins.py [--prompt 512] [--decode 64] [--threads 1] [names...]

Generation is timed into a throw-away cache folder (the real cache is not touched);
load, prefill and decode use the twin as the reference engine does (Twin.extend).
Prints one row per twin; numbers, not assertions.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_one(name: str, prompt_len: int, decode_steps: int) -> dict[str, float]:
    from conformance.reference import twins
    from conformance.reference.model import load_twin
    from conformance.reference.twin_metrics import random_prompt

    with tempfile.TemporaryDirectory() as scratch:
        saved = os.environ.get(twins.CACHE_ENV)
        os.environ[twins.CACHE_ENV] = scratch
        try:
            start = time.perf_counter()
            twins.ensure_twin(name)
            generate_s = time.perf_counter() - start
        finally:
            if saved is None:
                os.environ.pop(twins.CACHE_ENV)
            else:
                os.environ[twins.CACHE_ENV] = saved
    twins.ensure_twin(name)
    start = time.perf_counter()
    twin = load_twin(name)
    load_s = time.perf_counter() - start
    ids = random_prompt(twin, prompt_len + decode_steps, 0)
    twin.extend(twin.empty_state(), ids[:16])  # warm-up
    prefill_s = _best_of(3, lambda: twin.extend(twin.empty_state(), ids[:prompt_len]))
    _, state = twin.extend(twin.empty_state(), ids[:prompt_len])

    def decode() -> None:
        s = state
        for token in ids[prompt_len:]:
            _, s = twin.extend(s, [token])

    decode_s = _best_of(2, decode)
    return {
        "generate_s": generate_s,
        "load_s": load_s,
        "prefill_tok_s": prompt_len / prefill_s,
        "prefill_s": prefill_s,
        "decode_tok_s": decode_steps / decode_s,
        "decode_ms": 1e3 * decode_s / decode_steps,
        "slot_kib": state.nbytes_recurrent() / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from conformance.reference.model import known_twins

    print(f"prompt {args.prompt} tokens, {args.decode} decode steps, {args.threads} thread(s)")
    print(f"{'twin':<18}{'generate s':>11}{'load s':>8}{'prefill tok/s':>15}{'prefill s':>10}"
          f"{'decode tok/s':>14}{'ms/step':>9}{'slot KiB':>10}")
    for name in args.names or known_twins():
        r = bench_one(name, args.prompt, args.decode)
        print(f"{name:<18}{r['generate_s']:>11.2f}{r['load_s']:>8.2f}{r['prefill_tok_s']:>15.0f}"
              f"{r['prefill_s']:>10.3f}{r['decode_tok_s']:>14.0f}{r['decode_ms']:>9.1f}{r['slot_kib']:>10.1f}")


if __name__ == "__main__":
    main()
