"""The kit's own speed: client overhead per request as a fraction of the server's time.

    python bench/bench_client_overhead.py [--target sglang-cpu] [--model tiny-qwen3-next]
                                          [--strategy extra_buffer] [--repeats 5]

Starts one cell's server, runs the perf workload (``conformance.workloads.perf``, the same
requests the ``perf`` suite times) and a batch of the plain ``/generate`` calls the other
suites make, and prints, per request kind, the medians and 90th percentiles of

* ``server s``: SGLang's own ``e2e_latency`` (its tokenizer manager, arrival to finish);
* ``client s``: the kit's wall time for the same request (send to parsed result);
* ``overhead``: (client - server) / server -- everything outside SGLang's request time
  (HTTP both ways, the kit's client, JSON).  Goal: under 5%.

Also the TTFT seen by the client against SGLang's ``first_token_latency`` and the numbers
the perf block would carry.  Needs a target that reports its timings (SGLang with
``--enable-metrics``; the reference engine does not).  Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from conformance.checks.perf import overhead_fractions, perf_verdict
from conformance.matrix.cells import load_matrix
from conformance.plugin import Options
from conformance.targets.serving import serve_cell
from conformance.workloads.perf import CPU_PLAN, PerfPlan, engine_label, record_perf
from conformance.workloads.prompts import token_prompts

GOAL = 0.05


def _options(target: str) -> Options:
    return Options(target=target, models=None, strategies=None, faults=None, page_sizes=None, tier=None, matrix_path=None,
                   report_dir=None, log_dir=None, sglang_launcher="python -m sglang.launch_server", gpus_per_worker=1,
                   twins=False, gsm8k_dir=None)


def _q(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _row(kind: str, client: list[float], server: list[float], fractions: list[float]) -> str:
    verdict = "meets goal" if fractions and statistics.median(fractions) < GOAL else "OVER GOAL"
    return (f"{kind:24} {len(fractions):>3} {statistics.median(server):>10.4f} {statistics.median(client):>10.4f} "
            f"{statistics.median(fractions):>9.1%} {_q(fractions, 0.9):>9.1%}  {verdict}")


def plain_generate(client, vocab: int, n: int, new_tokens: int) -> tuple[list[float], list[float]]:
    """Non-streamed single requests, as the KL and prefix suites send them: (client s, server s)."""
    walls, servers = [], []
    for i in range(n):
        (p,) = token_prompts([CPU_PLAN.prompt_len], vocab_size=vocab, seed=f"bench-overhead:{i}")
        t0 = time.perf_counter()
        out = client.generate({"input_ids": list(p), "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}})
        walls.append(time.perf_counter() - t0)
        servers.append(float(out["meta_info"].get("e2e_latency") or "nan"))
    return walls, servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="sglang-cpu", choices=("sglang-cpu", "reference"))
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--strategy", default="extra_buffer")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cell = next(c for c in load_matrix().cells if c.model.twin == args.model and c.strategy.name == args.strategy and not c.fault.injected and c.page_size == 1)
    plan = PerfPlan(CPU_PLAN.prompt_len, CPU_PLAN.new_tokens, CPU_PLAN.hit_ext, CPU_PLAN.concurrency, args.repeats)
    with serve_cell(cell, _options(args.target), log_dir=Path(tempfile.mkdtemp(prefix="bench-overhead-"))) as ep:
        vocab = int(ep.info.get("vocab_size") or 32000)
        rec = record_perf(ep.client, plan, vocab_size=vocab, engine=engine_label(ep.target, ep.info))
        walls, servers = plain_generate(ep.client, vocab, 2 * args.repeats, CPU_PLAN.new_tokens)
    print(f"cell {cell.id} on {rec.engine}; timings from the {rec.timing_source}")
    if rec.timing_source != "server":
        print("this target reports no server-side timings: overhead cannot be measured here")
        return
    print(f"{'request kind':24} {'n':>3} {'server s':>10} {'client s':>10} {'overhead':>9} {'p90':>9}  (goal < {GOAL:.0%})")
    for phase in ("cold", "hit", "concurrent"):
        rows = [r for r in rec.requests if r.phase == phase]
        print(_row(f"perf {phase} (streamed)", [r.client_total_s for r in rows], [r.server_e2e_s for r in rows], overhead_fractions(rows)))
    plain = [(w - s) / s for w, s in zip(walls, servers) if s == s and s > 0]
    print(_row("plain /generate", walls, servers, plain))
    ttft = [(r.client_ttft_s - r.server_ttft_s) / r.server_ttft_s for r in rec.requests if r.client_ttft_s and r.server_ttft_s]
    print(f"TTFT seen by the client over SGLang's first_token_latency: median {statistics.median(ttft):+.1%}, p90 {_q(ttft, 0.9):+.1%}")
    m = perf_verdict(rec).metrics
    print("perf block numbers: " + ", ".join(f"{k}={m[k]:.4g}" for k in ("ttft_cold_s", "ttft_hit_s", "prefill_tok_s", "decode_tok_s", "decode_tok_s_concurrent", "hit_ratio") if m.get(k) is not None))


if __name__ == "__main__":
    main()
