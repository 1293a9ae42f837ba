"""The perf workload: timed requests against one cell's server, recorded as a
:class:`~conformance.recordings.PerfRecording`.

Per repetition, after a flush (each repetition has its own seeded prompts):

1. **cold**: a prompt of ``prompt_len`` tokens, ``new_tokens`` decoded (TTFT cold, prefill
   tok/s, decode tok/s of one request);
2. **hit**: the next turn of that conversation (prompt + its output + ``hit_ext`` new
   tokens), which every strategy can serve from the cache (``no_buffer`` from the state
   the finished request donated, ``extra_buffer*`` from the chunk-aligned prefill track);
   only requests whose ``cached_tokens`` > 0 count as hits;
3. **concurrent**: ``concurrency`` fresh prompts at once (aggregate decode tok/s: the sum
   of each request's rate while they decode together).

Every request is streamed, so the client's own TTFT is known on any target; where the
server reports its own timings (SGLang with ``--enable-metrics``: ``first_token_latency``,
``decode_throughput``, ``e2e_latency``) those are the ones recorded, without the HTTP and
client overhead.  Pool peaks and resident track slots come from the kit's observe gauges
(real SGLang on CPU: read before and after, nothing polled while timing) or, where a
server lacks them, from ``/metrics`` sampled during the concurrent phase.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from conformance.checks.leaks import peak, track_slot_use
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.recordings import OccupancySample, PerfRecording, RequestTiming
from conformance.targets.registry import target_for
from conformance.workloads.prompts import extension, token_prompts
from conformance.workloads.runners import OCCUPANCY_GAUGES, cache_enabled
from conformance.sglang_contract.metric_names import KIT_KV_USED_PEAK, KIT_MAMBA_USED_PEAK, KV_USED_TOKENS, MAMBA_USED_TOKENS


@dataclass(frozen=True)
class PerfPlan:
    """Sizes of the perf workload (kept small on CPU: it runs in every standard-tier cell)."""

    prompt_len: int
    new_tokens: int
    hit_ext: int
    concurrency: int
    repeats: int
    request_timeout_s: float = 300.0


#: Tiny twins on CPU: a 300-token prompt prefills in ~0.1-0.3 s, a decode step takes 10-30 ms
#: (140 ms on a 2-core machine loaded 8x); 9 repetitions take 30-60 s per cell.
CPU_PLAN = PerfPlan(prompt_len=300, new_tokens=8, hit_ext=8, concurrency=4, repeats=9)
GPU_PLAN = PerfPlan(prompt_len=2048, new_tokens=128, hit_ext=64, concurrency=16, repeats=5)


@dataclass(frozen=True)
class _Streamed:
    prompt_tokens: int
    output_ids: tuple[int, ...]
    meta: dict[str, Any]
    client_ttft_s: float | None
    client_total_s: float


def stream_one(client: SGLangClient, input_ids: Sequence[int], new_tokens: int, *, timeout: float) -> _Streamed:
    """One greedy streamed ``/generate``: client arrival times and the last chunk's meta_info."""
    payload = {"input_ids": list(input_ids), "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] | None = None
    for chunk in client.generate_stream(payload, timeout=timeout):
        if first is None and chunk.get("output_ids"):
            first = time.perf_counter() - t0
        last = chunk
    total = time.perf_counter() - t0
    if last is None or "meta_info" not in last:
        raise KitError(f"/generate stream ended without a final chunk carrying meta_info ({len(input_ids)}-token prompt)")
    return _Streamed(len(input_ids), tuple(int(t) for t in last.get("output_ids") or ()), last["meta_info"], first, total)


def _number(meta: dict[str, Any], key: str) -> float | None:
    v = meta.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def server_timed(s: _Streamed) -> bool:
    return _number(s.meta, "first_token_latency") is not None


def timing(s: _Streamed, phase: str, rep: int, source: str) -> RequestTiming:
    out = len(s.output_ids) or int(s.meta.get("completion_tokens") or 0)
    server_ttft, server_e2e = _number(s.meta, "first_token_latency"), _number(s.meta, "e2e_latency")
    client_decode = None
    if s.client_ttft_s is not None and out > 1 and s.client_total_s > s.client_ttft_s:
        client_decode = (out - 1) / (s.client_total_s - s.client_ttft_s)
    if source == "server":
        ttft, decode = server_ttft, _number(s.meta, "decode_throughput")
    else:
        ttft, decode = s.client_ttft_s, client_decode
    return RequestTiming(
        phase, rep, s.prompt_tokens, int(s.meta.get("cached_tokens") or 0), out, ttft, decode,
        client_ttft_s=s.client_ttft_s, client_total_s=s.client_total_s, server_ttft_s=server_ttft, server_e2e_s=server_e2e,
    )


def _kit_gauges(values: dict[str, float]) -> bool:
    return KIT_MAMBA_USED_PEAK in values


def _sampled(client: SGLangClient, load: Callable[[], Any], interval_s: float = 0.05) -> tuple[list[OccupancySample], Any]:
    """Run ``load`` in a thread while sampling the occupancy gauges (servers without the kit's gauges)."""
    samples: list[OccupancySample] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(load)
        while not fut.done():
            m = client.metrics()
            samples.append(OccupancySample(round(time.monotonic() - t0, 4), {g: m[g] for g in OCCUPANCY_GAUGES if g in m}))
            time.sleep(interval_s)
        return samples, fut.result()


def record_perf(client: SGLangClient, plan: PerfPlan, *, vocab_size: int, engine: str, quiet: bool | None = None,
                hit_na: str | None = None) -> PerfRecording:
    """Run the perf workload (see the module docstring); every request bounded by the plan's timeout.
    ``hit_na``: why this server can store no prefix for a hit to time (no hit request is sent)."""
    enabled = cache_enabled(client)
    timeout = plan.request_timeout_s
    client.flush_cache()
    (warm,) = token_prompts([plan.prompt_len], vocab_size=vocab_size, seed="perf:warmup")
    source = "server" if server_timed(stream_one(client, warm, 2, timeout=timeout)) else "client"
    before = client.metrics()
    kit = _kit_gauges(before)
    timings: list[RequestTiming] = []
    aggregate: list[float] = []
    timeline: list[OccupancySample] = [OccupancySample(0.0, before)]
    peaks: dict[str, list[float]] = {"mamba_peak_used": [], "kv_peak_used": []}
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=max(1, plan.concurrency)) as pool:
        for rep in range(plan.repeats):
            client.flush_cache()
            (prompt,) = token_prompts([plan.prompt_len], vocab_size=vocab_size, seed=f"perf:{rep}:cold")
            cold = stream_one(client, prompt, plan.new_tokens, timeout=timeout)
            timings.append(timing(cold, "cold", rep, source))
            if hit_na is None:
                turn = tuple(prompt) + cold.output_ids + extension(plan.hit_ext, vocab_size=vocab_size, seed=f"perf:{rep}:ext")
                timings.append(timing(stream_one(client, turn, plan.new_tokens, timeout=timeout), "hit", rep, source))
            fresh = token_prompts([plan.prompt_len] * plan.concurrency, vocab_size=vocab_size, seed=f"perf:{rep}:concurrent")

            def concurrent(prompts=fresh) -> list[_Streamed]:
                futs = [pool.submit(stream_one, client, p, plan.new_tokens, timeout=timeout) for p in prompts]
                return [f.result(timeout=timeout + 30) for f in futs]

            if kit:
                done = concurrent()
                after = client.metrics()
                timeline.append(OccupancySample(float(rep + 1), after))
                peaks["mamba_peak_used"].append(after.get(KIT_MAMBA_USED_PEAK, float("nan")))
                peaks["kv_peak_used"].append(after.get(KIT_KV_USED_PEAK, float("nan")))
            else:
                sampled, done = _sampled(client, concurrent)
                timeline += sampled
                for key, gauge in (("mamba_peak_used", MAMBA_USED_TOKENS), ("kv_peak_used", KV_USED_TOKENS)):
                    p = peak(sampled, gauge)
                    if p is not None:
                        peaks[key].append(p)
            rows = [timing(s, "concurrent", rep, source) for s in done]
            timings += rows
            rates = [r.decode_tok_s for r in rows]
            if all(rates):
                aggregate.append(float(sum(rates)))
            else:
                errors.append(f"repetition {rep}: a concurrent request decoded nothing measurable")
    client.flush_cache()
    use = track_slot_use(timeline)
    pools = {
        "mamba_peak_used": max((p for p in peaks["mamba_peak_used"] if p == p), default=None),
        "kv_peak_used": max((p for p in peaks["kv_peak_used"] if p == p), default=None),
        "track_slots_per_request": use.mean_per_request if use else None,
        "track_slots_peak_per_request": use.peak_per_request if use else None,
    }
    return PerfRecording(
        tuple(timings), plan.repeats, plan.concurrency, tuple(aggregate), source, engine,
        pools=pools, cache_enabled=enabled, quiet=quiet, errors=tuple(errors), hit_na=hit_na,
    )


def engine_label(target: str, info: dict[str, Any]) -> str:
    """What served the cell, as the perf block names it: SGLang (and its version), or the
    kit's own reference engine -- allowed, and labelled as not SGLang."""
    return target_for(target).engine.perf_label(target, info)

