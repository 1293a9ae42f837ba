"""Leak check on recorded gauge samples, log text and process state."""

from __future__ import annotations

import time

from conformance.checks.leaks import (
    TrackSlotUse,
    abort_problems,
    after_flush_problems,
    idle_invariant,
    leak_verdict,
    scan_log,
    track_slot_use,
    track_slot_verdict,
)
from conformance.recordings import IdleProbe, OccupancySample, SessionRecording, TurnResult
from conformance.sglang_contract.metric_names import (
    KIT_MAMBA_USED_PEAK, KV_USED_TOKENS, MAMBA_PINGPONG_RESIDENT_SLOTS, MAMBA_USED_TOKENS, NUM_RUNNING_REQS,
)

IDLE = {MAMBA_USED_TOKENS: 0.0, KV_USED_TOKENS: 0.0}
LOAD = [OccupancySample(0.0, {MAMBA_USED_TOKENS: 0.0, KV_USED_TOKENS: 0.0}), OccupancySample(0.1, {MAMBA_USED_TOKENS: 9.0, KV_USED_TOKENS: 300.0, "sglang:num_running_reqs": 3.0})]
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
    v = leak_verdict([probe(), probe(scenario="sessions")], log_text="all good\n", timeline=LOAD)
    assert v.status == "pass", v.reason
    assert CONTRACT <= set(v.metrics)
    assert v.metrics["mamba_used_at_idle"] == 0.0 and v.metrics["lazy_resident_ratio"] is None
    assert v.details["timeline"][1] == [0.1, 9.0, 300.0, 3.0]


def test_gauges_not_back_to_zero_fail_with_last_values():
    v = leak_verdict([probe(), probe({MAMBA_USED_TOKENS: 3.0, KV_USED_TOKENS: 0.0}, reached=False, scenario="sessions")], timeline=LOAD)
    assert v.status == "fail"
    assert "sessions: idle invariant broken before any flush" in v.reason and "sglang:mamba_used_tokens=3" in v.reason
    assert v.metrics["mamba_used_at_idle"] == 3.0


def test_leak_lines_in_the_log_fail():
    assert len(scan_log(LEAK_LOG)) == 2
    v = leak_verdict([probe()], log_text=LEAK_LOG, timeline=LOAD)
    assert v.status == "fail" and v.metrics["leak_log_lines"] == 2 and "memory leak detected" in v.reason


def test_sglang_leak_report_is_named_when_the_traceback_comes_first():
    # SGLang 0.5.12-0.5.21: the scheduler's exception line precedes its ValueError leak report
    log = """[2026-01-01 10:00:05] Scheduler hit an exception: Traceback (most recent call last):
ValueError: pool memory leak detected! [full] total=8192, available=8144, evictable=0, protected=0, session_held=48, uncached=0
"""
    v = leak_verdict([probe()], log_text=log, alive=False, timeline=LOAD)
    assert v.status == "fail" and "first: [2026-01-01 10:00:05] Scheduler hit an exception" in v.reason
    assert "SGLang's leak report: ValueError: pool memory leak detected! [full]" in v.reason
    assert "leak report" not in leak_verdict([probe()], log_text=LEAK_LOG, timeline=LOAD).reason  # first line already is it


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
    missing = leak_verdict([probe({KV_USED_TOKENS: 0.0})], timeline=LOAD)
    assert missing.status == "fail" and "missing from /metrics" in missing.reason


# ------------------------------------------------------------------ resident track slots
K = "hybrid_conformance:"


def counters(req_steps, slot_steps, *, req_peak=2.0, step_peak=24.0, running=12.0, windows=1.0):
    return {K + "decode_req_steps": req_steps, K + "track_slot_req_steps": slot_steps, K + "track_slots_req_peak": req_peak,
            K + "track_slots_step_peak": step_peak, K + "decode_running_peak": running, K + "busy_periods": windows}


def timeline_of(before, after):
    return [OccupancySample(0.0, before), OccupancySample(1.0, after)]


# Numbers in the shape measured on sglang-cpu (qwen3-next twin, 52-request burst, 12 tokens
# crossing the 256 boundary): lazy 1.17 slots per request-step, extra_buffer 2.0.
LAZY = timeline_of(counters(10, 12, req_peak=1, step_peak=1, running=1, windows=1), counters(271, 317, windows=2))
EAGER = timeline_of(counters(0, 0, windows=4), counters(261, 522, step_peak=18, running=9, windows=5))


def test_track_slot_use_from_counters_uses_the_load_window_only():
    use = track_slot_use(LAZY)
    assert use.mean_per_request == (317 - 12) / (271 - 10) and use.peak_per_request == 2.0 and use.running_peak == 12.0
    assert use.windows == 1 and use.request_steps == 261
    assert track_slot_use(EAGER).mean_per_request == 2.0


def test_track_slot_use_from_sampled_gauges_and_unmeasured():
    sampled = [OccupancySample(0, {MAMBA_PINGPONG_RESIDENT_SLOTS: 4.0, NUM_RUNNING_REQS: 4.0}), OccupancySample(1, {MAMBA_PINGPONG_RESIDENT_SLOTS: 6.0, NUM_RUNNING_REQS: 4.0}),
               OccupancySample(2, {MAMBA_PINGPONG_RESIDENT_SLOTS: 0.0, NUM_RUNNING_REQS: 0.0})]
    assert track_slot_use(sampled).mean_per_request == 1.25
    assert track_slot_use([OccupancySample(0, {MAMBA_USED_TOKENS: 3.0})]) is None


def test_lazy_claim_against_the_sibling_passes_and_says_where_it_does_not_hold():
    v = track_slot_verdict("extra_buffer_lazy", track_slot_use(LAZY), overlap=True, eager=track_slot_use(EAGER))
    assert v.status == "pass", v.reason
    assert 0.55 < v.metrics["lazy_resident_ratio"] < 0.6 and v.metrics["lazy_baseline"] == "extra_buffer sibling"
    assert v.metrics["lazy_peak_ratio"] == 1.0 and "does not hold on the peak" in v.reason


def test_lazy_claim_fails_when_lazy_holds_as_much_as_extra_buffer():
    kept = timeline_of(counters(0, 0), counters(260, 500))  # the second slot is never given back
    v = track_slot_verdict("extra_buffer_lazy", track_slot_use(kept), overlap=True, eager=track_slot_use(EAGER))
    assert v.status == "fail" and "lazy resident ratio 0.96 > 0.75" in v.reason


def test_lazy_claim_without_sibling_uses_the_contract_and_says_so():
    v = track_slot_verdict("extra_buffer_lazy", track_slot_use(LAZY), overlap=True)
    assert v.status == "pass" and "sibling not recorded" in v.reason and v.metrics["lazy_baseline_mean"] == 2.0
    bad = timeline_of(counters(0, 0), counters(100, 300, req_peak=3, windows=2))
    v = track_slot_verdict("extra_buffer_lazy", track_slot_use(bad), overlap=True)
    assert v.status == "fail" and "held 3 track slots in one step" in v.reason


def test_strategy_contracts_and_unmeasured_fail():
    assert track_slot_verdict("extra_buffer", track_slot_use(EAGER), overlap=True).status == "pass"
    v = track_slot_verdict("extra_buffer", track_slot_use(EAGER), overlap=False)
    assert v.status == "fail" and "expected 1 (overlap off)" in v.reason
    zero = timeline_of(counters(0, 0, req_peak=0), counters(50, 0, req_peak=0))
    assert track_slot_verdict("no_buffer", track_slot_use(zero), overlap=False).status == "pass"
    assert track_slot_verdict("no_buffer", track_slot_use(EAGER), overlap=False).status == "fail"
    assert "unmeasured" in track_slot_verdict("extra_buffer_lazy", None, overlap=True).reason
    idle = timeline_of(counters(5, 5), counters(5, 5))
    v = track_slot_verdict("extra_buffer_lazy", track_slot_use(idle), overlap=True)
    assert v.status == "fail" and "no decode step" in v.reason


# ------------------------------------------------------------------ aborted turns
def turn(finish="abort", seen=True, tokens=5, out=7, max_new=1024, aborted=True):
    return TurnResult("s", 1, "r", finish, 0, out, decoding_seen=seen, tokens_at_abort=tokens, max_new_tokens=max_new, aborted=aborted)


def test_abort_problems_each_way_it_can_go_wrong():
    assert abort_problems(SessionRecording((turn(),), (), 3)) == []
    assert "not exercised" in abort_problems(SessionRecording((turn(aborted=False, finish="length"),), (), 1))[0]
    assert "never seen decoding" in abort_problems(SessionRecording((turn(seen=False, tokens=0),), (), 1))[0]
    assert "expected 'abort'" in abort_problems(SessionRecording((turn(finish="length", out=1024),), (), 1))[0]
    assert "after all 1024/1024" in abort_problems(SessionRecording((turn(out=1024),), (), 1))[0]
    v = leak_verdict([probe()], require_load_evidence=False, sessions=SessionRecording((turn(finish="length"),), (), 1))
    assert v.status == "fail" and "expected 'abort'" in v.reason and v.metrics["aborted_turns"] == 1


# ------------------------------------------------------------------ SGLang's idle invariant
KIT_CLEAN = {
    MAMBA_USED_TOKENS: 0.0, KV_USED_TOKENS: 0.0,
    "sglang:mamba_available_tokens": 47.0, "sglang:mamba_evictable_tokens": 1.0,
    "sglang:kv_available_tokens": 8000.0, "sglang:kv_evictable_tokens": 192.0,
    "hybrid_conformance:mamba_total": 48.0, "hybrid_conformance:kv_total": 8192.0,
}


def test_idle_invariant_clean_and_session_held():
    assert idle_invariant(KIT_CLEAN) == []
    held = {**KIT_CLEAN, MAMBA_USED_TOKENS: 2.0, "sglang:mamba_available_tokens": 45.0, "hybrid_conformance:mamba_session_held": 2.0}
    assert idle_invariant(held) == []


def test_idle_invariant_leak_double_count_lock_and_bad_sum():
    leak = {**KIT_CLEAN, MAMBA_USED_TOKENS: 3.0, "sglang:mamba_available_tokens": 44.0}
    assert any("3 used at idle" in p and "leaked" in p for p in idle_invariant(leak))
    twice = {**KIT_CLEAN, MAMBA_USED_TOKENS: -19.0, "sglang:mamba_available_tokens": 66.0}
    assert any("counted twice" in p for p in idle_invariant(twice))
    locked = {**KIT_CLEAN, KV_USED_TOKENS: 5.0, "sglang:kv_available_tokens": 7995.0, "hybrid_conformance:kv_protected": 5.0}
    assert any("protected" in p for p in idle_invariant(locked))
    bad_sum = {**KIT_CLEAN, "hybrid_conformance:mamba_total": 50.0}
    assert any("!= total 50" in p for p in idle_invariant(bad_sum))


def test_idle_invariant_refuses_missing_gauges():
    assert any("missing" in p for p in idle_invariant({KV_USED_TOKENS: 0.0}))


def test_after_flush_nothing_evictable():
    assert after_flush_problems({**KIT_CLEAN, "sglang:mamba_evictable_tokens": 0.0, "sglang:kv_evictable_tokens": 0.0}) == []
    assert any("still evictable" in p for p in after_flush_problems(KIT_CLEAN))


def test_the_observe_plugins_mamba_peak_is_load_evidence_and_zero_is_not():
    """A short PD decode can end between SGLang's own gauge samples: the observe plugin's
    busy-window peak counts as evidence that the gauges are live; a zero peak does not."""

    seen = [OccupancySample(0.0, {**IDLE, KIT_MAMBA_USED_PEAK: 0.0}), OccupancySample(0.1, {**IDLE, KIT_MAMBA_USED_PEAK: 3.0})]
    assert leak_verdict([probe()], timeline=seen).status == "pass"
    flat = [OccupancySample(0.0, {**IDLE, KIT_MAMBA_USED_PEAK: 0.0})]
    v = leak_verdict([probe()], timeline=flat)
    assert v.status == "fail" and "never rose above 0" in v.reason


def test_the_load_sampler_carries_the_mamba_peak_the_guard_reads():
    """SGLang 0.5.11 declares ``sglang:mamba_used_tokens`` but never sets it: during a burst its
    /metrics shows the Mamba pool at 0 and only the observe plugin's busy-window peak moves.  The
    sampled timeline must carry that peak, or the load-evidence guard refuses a load the pool served."""
    from conformance.workloads.runners import sample_occupancy

    class BurstOn0511:
        def __init__(self) -> None:
            self.scrapes = 0

        def metrics(self) -> dict[str, float]:
            self.scrapes += 1
            return {**IDLE, KIT_MAMBA_USED_PEAK: 4.0 if self.scrapes > 1 else 0.0}

    timeline, _ = sample_occupancy(BurstOn0511(), lambda: time.sleep(0.05), interval_s=0.005)
    assert max(s.values.get(KIT_MAMBA_USED_PEAK, 0.0) for s in timeline) == 4.0
    assert leak_verdict([probe()], timeline=timeline).status == "pass"


def test_a_death_without_an_error_names_sglangs_last_word_about_it() -> None:
    from conformance.checks.leaks import death_cause

    quiet = "[t] Prefill batch, #new-seq: 1\n[t] INFO: POST /generate 200 OK\n"
    assert death_cause(quiet) == "no error in its log"
    killed = quiet + "[t] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n"
    assert "SGLang's last word: SIGQUIT received" in death_cause(killed) and "killed from outside" in death_cause(killed)
    # an error line of the server's own wins over the shutdown lines that follow it
    crashed = quiet + "ValueError: pool memory leak detected! [full] total=8192\n" + killed
    assert death_cause(crashed).startswith("ValueError: pool memory leak detected")


def test_a_release_without_sglangs_mamba_gauges_is_judged_on_the_observe_plugins_terms():
    """0.5.11 exports only sglang:mamba_usage; the client stands the observe plugin's reading
    of the same PoolStats terms in for the missing gauges, so a leak there still fails, and
    SGLang's own gauge wins wherever it is published."""
    from conformance.client import parse_metrics

    def text(used: int, avail: int, *, sglang_used: int | None = None) -> str:
        lines = ["sglang:mamba_usage 0.0", "sglang:kv_used_tokens 0", "sglang:kv_available_tokens 8192",
                 "sglang:kv_evictable_tokens 0", "hybrid_conformance:mamba_total 48", "hybrid_conformance:kv_total 8192",
                 f"hybrid_conformance:mamba_used {used}", f"hybrid_conformance:mamba_available {avail}",
                 "hybrid_conformance:mamba_evictable 0"]
        return "\n".join(lines + ([] if sglang_used is None else [f"sglang:mamba_used_tokens {sglang_used}"]))

    assert idle_invariant(parse_metrics(text(0, 48))) == []
    assert any("3 used at idle" in p and "leaked" in p for p in idle_invariant(parse_metrics(text(3, 45))))
    assert parse_metrics(text(0, 48, sglang_used=2))[MAMBA_USED_TOKENS] == 2.0
    assert any("missing" in p for p in idle_invariant(parse_metrics("sglang:mamba_usage 0.0\nsglang:kv_used_tokens 0")))
