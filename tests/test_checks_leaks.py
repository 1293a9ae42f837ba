"""Leak check on recorded gauge samples, log text and process state."""

from __future__ import annotations

from conformance.checks.leaks import (
    KV_GAUGE,
    MAMBA_GAUGE,
    TRACK_SLOTS_GAUGE,
    IdleProbe,
    after_flush_problems,
    idle_invariant,
    OccupancySample,
    lazy_resident_ratio,
    leak_verdict,
    scan_log,
)

IDLE = {MAMBA_GAUGE: 0.0, KV_GAUGE: 0.0}
LOAD = [OccupancySample(0.0, {MAMBA_GAUGE: 0.0, KV_GAUGE: 0.0}), OccupancySample(0.1, {MAMBA_GAUGE: 9.0, KV_GAUGE: 300.0, "sglang:num_running_reqs": 3.0})]
# Lines in the shape SGLang 0.5.23 prints (invariant_checker.py, scheduler.py).
LEAK_LOG = """[2026-01-01 10:00:00] Prefill batch. #new-seq: 1
[2026-01-01 10:00:05] [mamba] total=1889, available=1886, evictable=0, protected=0, session_held=0, uncached=0
[2026-01-01 10:00:05] mamba memory leak detected! token_msg
[2026-01-01 10:00:05] Scheduler hit an exception: Traceback (most recent call last):
"""


def probe(values=IDLE, reached=True, scenario="kl", requests=8):
    return IdleProbe(scenario, reached, values, 0.5, requests)


CONTRACT = {"mamba_used_at_idle", "kv_used_at_idle", "leak_log_lines", "lazy_resident_ratio"}


def test_clean_cell_passes_with_contract_metrics_and_timeline():
    v = leak_verdict([probe(), probe(scenario="sessions")], log_text="all good\n", timeline=LOAD, lazy_resident_ratio=0.5)
    assert v.status == "pass", v.reason
    assert CONTRACT <= set(v.metrics)
    assert v.metrics["mamba_used_at_idle"] == 0.0 and v.metrics["lazy_resident_ratio"] == 0.5
    assert v.details["timeline"][1] == [0.1, 9.0, 300.0, 3.0]


def test_gauges_not_back_to_zero_fail_with_last_values():
    v = leak_verdict([probe(), probe({MAMBA_GAUGE: 3.0, KV_GAUGE: 0.0}, reached=False, scenario="sessions")], timeline=LOAD)
    assert v.status == "fail"
    assert "sessions: idle invariant broken before any flush" in v.reason and "sglang:mamba_used_tokens=3" in v.reason
    assert v.metrics["mamba_used_at_idle"] == 3.0


def test_leak_lines_in_the_log_fail():
    assert len(scan_log(LEAK_LOG)) == 2
    v = leak_verdict([probe()], log_text=LEAK_LOG, timeline=LOAD)
    assert v.status == "fail" and v.metrics["leak_log_lines"] == 2 and "memory leak detected" in v.reason


def test_dead_process_and_bad_exit_status_fail():
    assert "not alive" in leak_verdict([probe()], alive=False, exit_code=-9, timeline=LOAD).reason
    assert "exited with status 1" in leak_verdict([probe()], exit_code=1, timeline=LOAD).reason
    assert leak_verdict([probe()], exit_code=-15, timeline=LOAD).status == "pass"


def test_refuses_to_pass_vacuously():
    assert leak_verdict([]).status == "skip"
    assert leak_verdict([probe(requests=0)], timeline=LOAD).status == "skip"
    dead_gauge = [OccupancySample(0.0, IDLE), OccupancySample(0.1, IDLE)]
    v = leak_verdict([probe()], timeline=dead_gauge)
    assert v.status == "fail" and "never rose above 0" in v.reason
    assert "no occupancy sample" in leak_verdict([probe()]).reason
    missing = leak_verdict([probe({KV_GAUGE: 0.0})], timeline=LOAD)
    assert missing.status == "fail" and "missing from /metrics" in missing.reason


def test_lazy_ratio_from_track_gauge_then_fallbacks():
    lazy = [OccupancySample(0, {TRACK_SLOTS_GAUGE: 4.0, MAMBA_GAUGE: 12.0})]
    eager = [OccupancySample(0, {TRACK_SLOTS_GAUGE: 8.0, MAMBA_GAUGE: 16.0})]
    assert lazy_resident_ratio(lazy, eager) == (0.5, TRACK_SLOTS_GAUGE)
    lazy_u = [OccupancySample(0, {MAMBA_GAUGE: 12.0})]
    eager_u = [OccupancySample(0, {MAMBA_GAUGE: 16.0})]
    base = [OccupancySample(0, {MAMBA_GAUGE: 8.0})]
    assert lazy_resident_ratio(lazy_u, eager_u, baseline=base)[0] == 0.5
    assert lazy_resident_ratio(lazy_u, eager_u)[0] == 0.75
    assert lazy_resident_ratio([], eager_u) == (None, "unmeasured")
    v = leak_verdict([probe()], timeline=LOAD, lazy_resident_ratio=0.9, lazy_ratio_max=0.75)
    assert v.status == "fail" and "lazy resident ratio" in v.reason


# ------------------------------------------------------------------ SGLang's idle invariant
KIT_CLEAN = {
    MAMBA_GAUGE: 0.0, KV_GAUGE: 0.0,
    "sglang:mamba_available_tokens": 47.0, "sglang:mamba_evictable_tokens": 1.0,
    "sglang:kv_available_tokens": 8000.0, "sglang:kv_evictable_tokens": 192.0,
    "hybrid_conformance:mamba_total": 48.0, "hybrid_conformance:kv_total": 8192.0,
}


def test_idle_invariant_clean_and_session_held():
    assert idle_invariant(KIT_CLEAN) == []
    held = {**KIT_CLEAN, MAMBA_GAUGE: 2.0, "sglang:mamba_available_tokens": 45.0, "hybrid_conformance:mamba_session_held": 2.0}
    assert idle_invariant(held) == []


def test_idle_invariant_leak_double_count_lock_and_bad_sum():
    leak = {**KIT_CLEAN, MAMBA_GAUGE: 3.0, "sglang:mamba_available_tokens": 44.0}
    assert any("3 used at idle" in p and "leaked" in p for p in idle_invariant(leak))
    twice = {**KIT_CLEAN, MAMBA_GAUGE: -19.0, "sglang:mamba_available_tokens": 66.0}
    assert any("counted twice" in p for p in idle_invariant(twice))
    locked = {**KIT_CLEAN, KV_GAUGE: 5.0, "sglang:kv_available_tokens": 7995.0, "hybrid_conformance:kv_protected": 5.0}
    assert any("protected" in p for p in idle_invariant(locked))
    bad_sum = {**KIT_CLEAN, "hybrid_conformance:mamba_total": 50.0}
    assert any("!= total 50" in p for p in idle_invariant(bad_sum))


def test_idle_invariant_refuses_missing_gauges():
    assert any("missing" in p for p in idle_invariant({KV_GAUGE: 0.0}))


def test_after_flush_nothing_evictable():
    assert after_flush_problems({**KIT_CLEAN, "sglang:mamba_evictable_tokens": 0.0, "sglang:kv_evictable_tokens": 0.0}) == []
    assert any("still evictable" in p for p in after_flush_problems(KIT_CLEAN))
