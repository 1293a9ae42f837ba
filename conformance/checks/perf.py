"""Perf check: what one cell's Mamba caching strategy costs, in time and in pool memory.

Input is a :class:`PerfRecording` (``conformance.workloads.perf``): per repetition a cold
prompt, a prefix hit on it (the next turn of the same conversation), and ``N`` concurrent
requests; the pools' peaks and the resident track slots per running request.  Output is
a :class:`~conformance.records.Verdict` whose metrics are the medians (TTFT cold and hit,
prefill and decode tok/s at 1 and N requests, hit ratio, peaks, track slots) and whose
details keep every sample and each metric's spread, so ratios against other cells of the
run (``conformance.report.perf``) carry an interval too.

Spread is distribution-free: the interval between two order statistics that covers the
median with probability >= :data:`COVERAGE` (for 3 to 6 repeats: min and max; for 9, the
3rd and 7th).  Absolute
times on a shared machine are not stable, which is why the report compares ratios.

The check never passes vacuously: it fails when no request hit the cache (a ``ttft_hit``
measured on a miss is a second cold TTFT), when a cold prompt hit after a flush, when a
phase measured nothing, and when cache hits were slower than cold prefills beyond the
measured noise (every hit sample above every cold one).  A disabled radix cache skips.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from scipy import stats

from conformance.recordings import PerfRecording, RequestTiming
from conformance.records import Verdict

CHECK = "perf"
#: Probability that a metric's interval covers its median (order statistics, any distribution).
#: 0.8: with 9 repeats the 3rd and 7th of 9 samples, which a load spike on a shared machine
#: does not move; two such intervals that do not overlap differ beyond the noise.
COVERAGE = 0.8
#: Timed phases of one repetition.
PHASES = ("cold", "hit", "concurrent")


# ------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class Spread:
    """A median and the order-statistic interval around it (``lo`` <= median <= ``hi``)."""

    median: float
    lo: float
    hi: float
    n: int

    @property
    def rel(self) -> float:
        """Interval width relative to the median (0 for a single or constant sample)."""
        return (self.hi - self.lo) / abs(self.median) if self.median else 0.0

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "n": self.n, "rel": round(self.rel, 4)}

    @classmethod
    def from_json(cls, raw: Mapping[str, float]) -> "Spread":
        return cls(float(raw["median"]), float(raw["lo"]), float(raw["hi"]), int(raw.get("n", 1)))


def median_interval_ranks(n: int, coverage: float = COVERAGE) -> tuple[int, int]:
    """0-based ranks (k, n-1-k) of the narrowest symmetric order-statistic interval that
    covers the median with probability >= ``coverage`` (``1 - 2 * BinomCDF(k; n, 1/2)``);
    the widest one, min and max, when even that covers less (fewer than 5 samples)."""
    k = 0
    while k + 1 < (n + 1) // 2 and 1.0 - 2.0 * float(stats.binom.cdf(k + 1, n, 0.5)) >= coverage:
        k += 1
    return k, n - 1 - k


def spread(values: Iterable[float | None]) -> Spread | None:
    """Median and interval of the finite values; None when there are none."""
    xs = sorted(float(v) for v in values if v is not None and v == v)
    if not xs:
        return None
    lo, hi = median_interval_ranks(len(xs))
    return Spread(float(statistics.median(xs)), xs[lo], xs[hi], len(xs))


def ratio(num: Spread | None, den: Spread | None) -> Spread | None:
    """num / den with a conservative interval (lo/hi and hi/lo of the two intervals)."""
    if num is None or den is None or den.median <= 0 or den.lo <= 0:
        return None
    return Spread(num.median / den.median, num.lo / den.hi, num.hi / den.lo, min(num.n, den.n))


def fixed(value: float | None) -> Spread | None:
    """A count (a pool peak): no noise of its own."""
    return None if value is None else Spread(float(value), float(value), float(value), 1)


# ------------------------------------------------------------------ verdict
#: Metric -> how its samples are taken from a recording (see :func:`samples`).
TIME_METRICS = ("ttft_cold_s", "ttft_hit_s", "prefill_tok_s", "decode_tok_s", "decode_tok_s_concurrent", "hit_ratio")
POOL_METRICS = ("mamba_peak_used", "kv_peak_used", "track_slots_per_request", "track_slots_peak_per_request")


def _hits(rec: PerfRecording) -> list[RequestTiming]:
    return [r for r in rec.requests if r.phase == "hit" and r.cached_tokens > 0]


def samples(rec: PerfRecording) -> dict[str, list[float]]:
    """Per metric, one sample per measured request (or repetition for the concurrent phase).
    Hit metrics use only requests that really hit (``cached_tokens`` > 0)."""
    cold = [r for r in rec.requests if r.phase == "cold"]
    hits = _hits(rec)
    return {
        "ttft_cold_s": [r.ttft_s for r in cold if r.ttft_s],
        "ttft_hit_s": [r.ttft_s for r in hits if r.ttft_s],
        "prefill_tok_s": [r.prompt_tokens / r.ttft_s for r in cold if r.ttft_s],
        "decode_tok_s": [r.decode_tok_s for r in cold if r.decode_tok_s],
        "decode_tok_s_concurrent": [v for v in rec.concurrent_decode_tok_s if v],
        "hit_ratio": [r.cached_tokens / r.prompt_tokens for r in hits if r.prompt_tokens],
    }


def perf_verdict(rec: PerfRecording) -> Verdict:
    """Medians, spreads and the within-cell ratios of one cell; fail on what makes them vacuous."""
    got = samples(rec)
    spreads = {k: spread(v) for k, v in got.items()}
    metrics: dict[str, float | int | str | None] = {k: (s.median if s else None) for k, s in spreads.items()}
    for key in POOL_METRICS:
        metrics[key] = rec.pools.get(key)
    hit_vs_cold = ratio(spreads["ttft_hit_s"], spreads["ttft_cold_s"])
    batching = ratio(spreads["decode_tok_s_concurrent"], spreads["decode_tok_s"])
    metrics.update(
        repeats=rec.repeats,
        concurrency=rec.concurrency,
        hit_vs_cold_ttft=hit_vs_cold.median if hit_vs_cold else None,
        concurrent_vs_single_decode=batching.median if batching else None,
    )
    details = {
        "engine": rec.engine,
        "timing_source": rec.timing_source,
        "quiet": rec.quiet,
        "samples": {k: [round(x, 6) for x in v] for k, v in got.items()},
        "spread": {k: s.to_json() for k, s in spreads.items() if s},
        "requests": [r.__dict__ for r in rec.requests],
    }
    if rec.hit_na:
        details["not_applicable"] = {"ttft_hit_s": rec.hit_na, "hit_ratio": rec.hit_na, "hit_vs_cold_ttft": rec.hit_na}
    if not rec.cache_enabled:
        return Verdict(CHECK, "skip", metrics, "the radix cache is disabled on this server: no prefix hit to time", details)
    problems = list(rec.errors)
    stale = [r for r in rec.requests if r.phase in ("cold", "concurrent") and r.cached_tokens > 0]
    if stale:
        problems.append(f"{len(stale)} cold request(s) hit the cache after a flush (e.g. {stale[0].cached_tokens} cached tokens): no cold time measured")
    hit_requests = [r for r in rec.requests if r.phase == "hit"]
    if hit_requests and not _hits(rec):
        problems.append(f"none of {len(hit_requests)} prefix-hit requests hit the cache (cached_tokens 0): ttft_hit would time a second cold prefill")
    if rec.hit_na and hit_requests:
        problems.append(f"{len(hit_requests)} prefix-hit request(s) sent on a cell where no hit applies ({rec.hit_na})")
    for key in ("ttft_cold_s", "ttft_hit_s", "decode_tok_s", "decode_tok_s_concurrent"):
        if key == "ttft_hit_s" and rec.hit_na:
            continue
        if spreads[key] is None and not (key == "ttft_hit_s" and hit_requests and not _hits(rec)):
            problems.append(f"{key}: nothing measured")
    hit, cold = spreads["ttft_hit_s"], spreads["ttft_cold_s"]
    if hit and cold and hit.lo > cold.hi:
        problems.append(
            f"cache hits were slower to the first token than cold prefills beyond the noise: hit {hit.median:.3g} s "
            f"[{hit.lo:.3g}, {hit.hi:.3g}] vs cold {cold.median:.3g} s [{cold.lo:.3g}, {cold.hi:.3g}]"
        )
    if problems:
        return Verdict(CHECK, "fail", metrics, "; ".join(problems), details)
    return Verdict(CHECK, "pass", metrics, "", details)


def interval_of(details: Mapping, metric: str) -> Spread | None:
    """A metric's :class:`Spread` from a verdict's details (report.json), else None."""
    raw = (details.get("spread") or {}).get(metric)
    return Spread.from_json(raw) if raw else None


def requests_by_phase(rec: PerfRecording) -> dict[str, list[RequestTiming]]:
    return {p: [r for r in rec.requests if r.phase == p] for p in PHASES}


def overhead_fractions(requests: Sequence[RequestTiming]) -> list[float]:
    """Client time beyond the server's own end-to-end time, as a fraction of the latter."""
    return [(r.client_total_s - r.server_e2e_s) / r.server_e2e_s for r in requests if r.client_total_s and r.server_e2e_s]
