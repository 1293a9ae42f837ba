"""The perf check without a server: its statistics (order-statistic intervals for the
median, conservative ratio intervals) and the verdict, which fails when a number would be
vacuous (no request hit, a cold request hit, a phase measured nothing) or when cache hits
are slower than cold prefills beyond the noise."""

from __future__ import annotations

import dataclasses

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks.perf import COVERAGE, Spread, median_interval_ranks, perf_verdict, ratio, spread
from conformance.recordings import PerfRecording, RequestTiming


def coverage_by_enumeration(n: int, lo: int, hi: int) -> float:
    """P(order statistics lo and hi (0-based) bracket the median), counted over all 2^n
    patterns of samples below / above it: X_(lo) < m <= X_(hi) iff lo < #below <= hi."""
    inside = sum(lo < sum(below) <= hi for below in itertools.product((0, 1), repeat=n))
    return inside / 2**n


@pytest.mark.parametrize("n", range(3, 12))
def test_median_interval_covers_the_median_as_stated(n: int) -> None:
    lo, hi = median_interval_ranks(n)
    got = coverage_by_enumeration(n, lo, hi)
    assert got >= COVERAGE or (lo, hi) == (0, n - 1)  # fewer samples: the widest interval there is
    if lo + 1 <= hi - 1:  # and it is the narrowest that does
        assert coverage_by_enumeration(n, lo + 1, hi - 1) < COVERAGE


@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=15))
def test_spread_brackets_the_median(values: list[float]) -> None:
    s = spread(values)
    assert s is not None and s.lo <= s.median <= s.hi and s.n == len(values)
    assert min(values) <= s.lo and s.hi <= max(values)


@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=9), st.lists(st.floats(0.01, 10.0), min_size=1, max_size=9))
def test_ratio_interval_holds_every_ratio_of_values_inside_both_intervals(a: list[float], b: list[float]) -> None:
    sa, sb = spread(a), spread(b)
    r = ratio(sa, sb)
    assert r is not None and r.lo <= r.median <= r.hi
    for x in (sa.lo, sa.median, sa.hi):
        for y in (sb.lo, sb.median, sb.hi):
            assert r.lo - 1e-12 <= x / y <= r.hi + 1e-12


def test_spread_ignores_missing_values_and_a_ratio_needs_a_positive_denominator() -> None:
    assert spread([None, float("nan")]) is None
    assert ratio(Spread(1.0, 1.0, 1.0, 1), Spread(0.0, 0.0, 0.0, 1)) is None
    assert ratio(None, Spread(1.0, 1.0, 1.0, 1)) is None


# ------------------------------------------------------------------ verdict
def rt(phase: str, rep: int, ttft: float | None, *, cached: int = 0, prompt: int = 300, decode: float | None = 30.0) -> RequestTiming:
    return RequestTiming(phase, rep, prompt, cached, 16, ttft, decode)


def recording(cold: list[float], hit: list[float], *, hit_cached: int = 256, cold_cached: int = 0, errors: tuple[str, ...] = (), enabled: bool = True) -> PerfRecording:
    rows = []
    for i, (c, h) in enumerate(zip(cold, hit)):
        rows += [rt("cold", i, c, cached=cold_cached), rt("hit", i, h, cached=hit_cached, prompt=324)]
        rows += [rt("concurrent", i, c * 1.5) for _ in range(4)]
    return PerfRecording(tuple(rows), len(cold), 4, tuple(100.0 for _ in cold), "server", "SGLang test", pools={"mamba_peak_used": 12.0}, cache_enabled=enabled, errors=errors)


COLD = [0.20, 0.25, 0.18, 0.30, 0.22]
HIT = [0.06, 0.08, 0.05, 0.12, 0.07]


def test_a_consistent_recording_passes_with_medians_and_spreads() -> None:
    v = perf_verdict(recording(COLD, HIT))
    assert v.status == "pass", v.reason
    m = v.metrics
    assert m["ttft_cold_s"] == pytest.approx(0.22) and m["ttft_hit_s"] == pytest.approx(0.07)
    assert m["prefill_tok_s"] == pytest.approx(300 / 0.22) and m["hit_ratio"] == pytest.approx(256 / 324)
    assert m["decode_tok_s_concurrent"] == 100.0 and m["repeats"] == 5 and m["mamba_peak_used"] == 12.0
    assert m["hit_vs_cold_ttft"] == pytest.approx(0.07 / 0.22)
    assert v.details["spread"]["ttft_cold_s"]["lo"] == 0.18 and v.details["spread"]["ttft_cold_s"]["hi"] == 0.30
    assert len(v.details["samples"]["ttft_hit_s"]) == 5


def test_no_request_hitting_the_cache_fails_instead_of_timing_a_second_cold_prefill() -> None:
    v = perf_verdict(recording(COLD, HIT, hit_cached=0))
    assert v.status == "fail" and "none of 5 prefix-hit requests hit the cache" in v.reason
    assert v.metrics["ttft_hit_s"] is None and v.metrics["hit_ratio"] is None


def test_a_cell_that_stores_no_prefix_states_why_ttft_hit_does_not_apply_and_passes_on_the_rest() -> None:
    """The chunked_prefill = sub-chunk cell: SGLang stores no prefill state by design, so
    the hit phase is not sent and ttft_hit is n/a with the reason; cold and decode still judged."""
    why = "no prefill on this server stores a Mamba state: --chunked-prefill-size 32 is below the checkpoint grid 64"
    cold_only = dataclasses.replace(recording(COLD, HIT), hit_na=why)
    cold_only = dataclasses.replace(cold_only, requests=tuple(r for r in cold_only.requests if r.phase != "hit"))
    v = perf_verdict(cold_only)
    assert v.status == "pass", v.reason
    assert v.details["not_applicable"]["ttft_hit_s"] == why and v.metrics["ttft_hit_s"] is None
    assert v.metrics["ttft_cold_s"] == pytest.approx(0.22)
    # still judged: a cold phase that measured nothing fails, and a hit sent anyway is named
    empty = dataclasses.replace(cold_only, requests=tuple(r for r in cold_only.requests if r.phase != "cold"))
    assert perf_verdict(empty).status == "fail" and "ttft_cold_s: nothing measured" in perf_verdict(empty).reason
    sent = dataclasses.replace(recording(COLD, HIT, hit_cached=0), hit_na=why)
    assert perf_verdict(sent).status == "fail" and "sent on a cell where no hit applies" in perf_verdict(sent).reason


def test_a_cold_request_that_hit_after_a_flush_fails() -> None:
    v = perf_verdict(recording(COLD, HIT, cold_cached=64))
    assert v.status == "fail" and "cold request(s) hit the cache after a flush" in v.reason


def test_hits_slower_than_cold_prefills_beyond_the_noise_fail_and_inside_it_pass() -> None:
    slower = perf_verdict(recording(COLD, [0.35, 0.40, 0.31, 0.50, 0.33]))
    assert slower.status == "fail" and "slower to the first token than cold prefills beyond the noise" in slower.reason
    overlapping = perf_verdict(recording(COLD, [0.29, 0.35, 0.31, 0.50, 0.33]))  # one hit inside the cold interval
    assert overlapping.status == "pass", overlapping.reason


def test_an_empty_recording_fails_on_every_missing_number() -> None:
    v = perf_verdict(PerfRecording((), 5, 4, (), "client", "x"))
    assert v.status == "fail"
    for key in ("ttft_cold_s", "ttft_hit_s", "decode_tok_s", "decode_tok_s_concurrent"):
        assert f"{key}: nothing measured" in v.reason


def test_workload_errors_fail_and_a_disabled_cache_skips() -> None:
    assert perf_verdict(recording(COLD, HIT, errors=("repetition 2: a concurrent request decoded nothing measurable",))).status == "fail"
    v = perf_verdict(recording(COLD, HIT, enabled=False))
    assert v.status == "skip" and "radix cache is disabled" in v.reason


def test_spread_rel_is_the_interval_width_over_the_median() -> None:
    s = spread([1.0, 2.0, 3.0])
    assert s.rel == pytest.approx(1.0) and math.isclose(Spread.from_json(s.to_json()).median, 2.0)
