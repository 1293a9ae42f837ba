"""Pool tier benchmark: state-machine steps per second per pool key, and the tier's wall time.

    python bench/bench_pool.py [--examples N] [--steps N] [--tier standard]

Prints one line per distinct pool key of the selected tier (plus the page-64 /
interval-128 coverage keys): examples run, rule steps, steps/s, arrivals with a non-zero
hit, examples in which SGLang evicted, decode track boundaries crossed; then the sglang import time and the
tier's total wall time.  Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=25)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--tier", default="standard")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from conformance.sglang_api import pool as sglang_api

    sglang_api.load()
    import_s = time.perf_counter() - t0

    from hypothesis.stateful import run_state_machine_as_test

    from conformance.matrix.cells import load_matrix
    from conformance.sglang_api.pool_runtime import PoolKey
    from conformance.targets.pool.harness import PoolHarness, PoolSizes
    from conformance.targets.pool.machine import pool_machine
    from conformance.targets.pool.scenarios import machine_settings, oracle_for

    cells = load_matrix().select(target="pool", tier="nightly")
    keys = list(dict.fromkeys(PoolKey.from_cell(c) for c in cells if c.tier != "nightly" or c.page_size != 1 or c.track_interval != 256))
    keys = [k for k in keys if args.tier == "nightly" or k in {PoolKey.from_cell(c) for c in load_matrix().select(target="pool", tier=args.tier)} or k.page_size != 1 or k.track_interval != 256]

    print(f"{'pool key':44s} {'examples':>8s} {'steps':>6s} {'steps/s':>8s} {'hits':>5s} {'evicting':>9s} {'boundaries':>10s}")
    total_steps, t_tier = 0, time.perf_counter()
    for key in keys:
        stats = {"examples": 0, "steps": 0, "hits": 0, "evictions": 0, "boundaries": 0}

        def harness_factory(key=key, stats=stats):
            stats["examples"] += 1
            h = PoolHarness(key, PoolSizes())
            admit, decode = h.admit, h.decode

            def counted_admit(*a, **k):
                run = admit(*a, **k)
                stats["hits"] += run.matched > 0
                return run

            def counted_decode(*a, **k):
                crossed = decode(*a, **k)
                stats["boundaries"] += crossed
                return crossed

            h.admit, h.decode = counted_admit, counted_decode
            return h

        machine = pool_machine(harness_factory, oracle_for)

        class Counting(machine):  # type: ignore[misc, valid-type]
            def check_invariants(self, *a, **k):  # runs once after every rule step
                stats["steps"] += 1
                return super().check_invariants(*a, **k)

            def teardown(self):
                stats["evictions"] += self.h.evictions > 0
                super().teardown()

        t = time.perf_counter()
        run_state_machine_as_test(Counting, settings=machine_settings(args.examples, args.steps))
        dt = time.perf_counter() - t
        total_steps += stats["steps"]
        print(f"{key.id:44s} {stats['examples']:8d} {stats['steps']:6d} {stats['steps'] / dt:8.1f} {stats['hits']:5d} {stats['evictions']:9d} {stats['boundaries']:10d}")
    wall = time.perf_counter() - t_tier
    print(f"sglang import: {import_s:.1f} s; state machines: {total_steps} steps in {wall:.1f} s ({total_steps / wall:.1f} steps/s); tier wall time incl. import: {wall + import_s:.1f} s")


if __name__ == "__main__":
    main()
