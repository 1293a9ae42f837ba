"""Pool-leak check: idle gauges back to 0 after every scenario, a clean server log, a live
process, and a pool-occupancy timeline that shows the gauges actually move under load.

Inputs are plain values (gauge dicts from ``SGLangClient.metrics()``, the log text, the
process state), so the check needs no server. The lazy claim (``extra_buffer_lazy`` holds
about half the resident ping-pong slots of ``extra_buffer``) is measured by
:func:`lazy_resident_ratio` from two occupancy timelines under the same load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from conformance.records import Verdict

CHECK = "leaks"
MAMBA_GAUGE = "sglang:mamba_used_tokens"
KV_GAUGE = "sglang:kv_used_tokens"
RUNNING_GAUGE = "sglang:num_running_reqs"
QUEUE_GAUGE = "sglang:num_queue_reqs"
MAMBA_AVAILABLE = "sglang:mamba_available_tokens"
MAMBA_EVICTABLE = "sglang:mamba_evictable_tokens"
KV_AVAILABLE = "sglang:kv_available_tokens"
KV_EVICTABLE = "sglang:kv_evictable_tokens"
# Resident ping-pong/track slots: exposed by the kit's reference server, not by SGLang.
TRACK_SLOTS_GAUGE = "sglang:mamba_pingpong_resident_slots"
# The terms of SGLang's idle invariant it does not export, published next to its gauges by
# the kit's observe plugin inside real SGLang (conformance/sglang_plugins/observe.py) and
# by the reference server; absent gauges count as 0 held.
KIT = "hybrid_conformance:"
SEQ_GAUGE = KIT + "idle_publish_seq"
POOLS = {
    "mamba": (MAMBA_GAUGE, MAMBA_AVAILABLE, MAMBA_EVICTABLE),
    "kv": (KV_GAUGE, KV_AVAILABLE, KV_EVICTABLE),
}

LOG_PATTERNS = (
    re.compile(r"memory leak detected", re.I),
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r"Scheduler hit an exception"),
    re.compile(r"Received sigquit from a child process", re.I),
    re.compile(r"scheduler (?:process )?(?:died|is dead|exited|crashed)", re.I),
    re.compile(r"Child process unexpectedly failed", re.I),
)


@dataclass(frozen=True)
class IdleProbe:
    """SGLang's idle invariant after one scenario: ``values`` read BEFORE any flush (what
    the leak check judges), ``after_flush`` read after one; ``reached`` is True when both
    held, ``problems`` says what did not; ``fresh`` when the sample was provably
    published while idle (kit observe gauge)."""

    scenario: str
    reached: bool
    values: Mapping[str, float]
    waited_s: float
    requests: int = 1
    after_flush: Mapping[str, float] = field(default_factory=dict)
    fresh: bool = False
    problems: tuple[str, ...] = ()


def is_idle(values: Mapping[str, float]) -> bool:
    """Nothing running and nothing queued (by SGLang's gauges, or the kit's where present)."""
    running = values.get(KIT + "running_reqs", values.get(RUNNING_GAUGE, 0.0))
    waiting = values.get(KIT + "waiting_reqs", values.get(QUEUE_GAUGE, 0.0))
    return running == 0 and waiting == 0


def idle_invariant(values: Mapping[str, float]) -> list[str]:
    """SGLang's idle invariant ``available + evictable + protected + session_held == total``
    from outside, per pool: with nothing running, what the pool counts as used must be
    exactly what open sessions and locked tree nodes hold.  Above: a leak; below: a slot
    counted twice.  A missing ``used`` gauge is itself a problem (nothing is judged)."""
    problems = []
    for pool, (used_g, avail_g, evict_g) in POOLS.items():
        used = values.get(used_g)
        if used is None or used != used:
            problems.append(f"{pool}: gauge {used_g} missing from /metrics")
            continue
        protected = values.get(f"{KIT}{pool}_protected", 0.0)
        held = values.get(f"{KIT}{pool}_session_held", 0.0)
        if protected:
            problems.append(f"{pool}: {protected:g} protected (locked) at idle: a lock was not released")
        leaked = used - protected - held
        if leaked > 0:
            problems.append(f"{pool}: {leaked:g} used at idle beyond what sessions hold (used {used:g}, session-held {held:g}): leaked")
        elif leaked < 0:
            problems.append(f"{pool}: used {used:g} < session-held {held:g} + protected {protected:g}: counted twice")
        total = values.get(f"{KIT}{pool}_total")
        avail, evict = values.get(avail_g), values.get(evict_g)
        if total is not None and avail is not None and evict is not None and avail + evict + used != total:
            problems.append(f"{pool}: available {avail:g} + evictable {evict:g} + used {used:g} != total {total:g}")
    return problems


def after_flush_problems(values: Mapping[str, float]) -> list[str]:
    """After ``/flush_cache`` on an idle server nothing stays evictable in the radix cache."""
    problems = []
    for pool, (_used_g, _avail_g, evict_g) in POOLS.items():
        evict = values.get(evict_g)
        if evict:
            problems.append(f"{pool}: {evict:g} still evictable after the flush")
    return problems


@dataclass(frozen=True)
class OccupancySample:
    t_s: float
    values: Mapping[str, float] = field(default_factory=dict)


def scan_log(text: str) -> list[str]:
    """Lines of a server log that report a leak, a traceback or a dead scheduler."""
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in LOG_PATTERNS)]


def timeline_rows(samples: Sequence[OccupancySample]) -> list[list[float]]:
    """``[[t_s, mamba_used, kv_used, running], ...]`` for the report (NaN-free: 0 if absent)."""
    return [[s.t_s, s.values.get(MAMBA_GAUGE, 0.0), s.values.get(KV_GAUGE, 0.0), s.values.get(RUNNING_GAUGE, 0.0)] for s in samples]


def peak(samples: Sequence[OccupancySample], gauge: str) -> float | None:
    vals = [s.values[gauge] for s in samples if gauge in s.values]
    return max(vals) if vals else None


def lazy_resident_ratio(
    lazy: Sequence[OccupancySample],
    eager: Sequence[OccupancySample],
    *,
    baseline: Sequence[OccupancySample] = (),
    gauge: str = TRACK_SLOTS_GAUGE,
    fallback_gauge: str = MAMBA_GAUGE,
) -> tuple[float | None, str]:
    """Peak resident track slots of ``extra_buffer_lazy`` over ``extra_buffer`` under the
    same load, and how it was measured.

    Uses ``gauge`` when both timelines carry it; otherwise (real SGLang) the peak of
    ``fallback_gauge`` minus the ``no_buffer`` baseline's peak when one is given (the
    ping-pong slots alone), else the raw peak ratio.
    """
    lp, ep = peak(lazy, gauge), peak(eager, gauge)
    if lp is not None and ep is not None:
        return (lp / ep if ep > 0 else None), gauge
    lp, ep = peak(lazy, fallback_gauge), peak(eager, fallback_gauge)
    if lp is None or ep is None:
        return None, "unmeasured"
    bp = peak(baseline, fallback_gauge) if baseline else None
    if bp is not None:
        return ((lp - bp) / (ep - bp) if ep > bp else None), f"{fallback_gauge} peak minus no_buffer peak"
    return (lp / ep if ep > 0 else None), f"{fallback_gauge} peak"


def leak_verdict(
    probes: Sequence[IdleProbe],
    *,
    log_text: str = "",
    alive: bool = True,
    exit_code: int | None = None,
    ok_exit_codes: Sequence[int] = (0, -15, 143),
    timeline: Sequence[OccupancySample] = (),
    require_load_evidence: bool = True,
    lazy_resident_ratio: float | None = None,
    lazy_ratio_max: float | None = None,
    scenario_errors: Sequence[str] = (),
    gauges: Sequence[str] = (MAMBA_GAUGE, KV_GAUGE),
) -> Verdict:
    """Judge the idle probes of a cell's scenarios plus its log and process state."""
    log_lines = scan_log(log_text)
    rows = timeline_rows(timeline)
    at_idle = {g: _worst(p.values.get(g) for p in probes) for g in gauges}
    metrics = {
        "mamba_used_at_idle": at_idle.get(MAMBA_GAUGE),
        "kv_used_at_idle": at_idle.get(KV_GAUGE),
        "leak_log_lines": len(log_lines),
        "lazy_resident_ratio": lazy_resident_ratio,
        "scenarios": len(probes),
        "mamba_used_peak": peak(timeline, MAMBA_GAUGE),
        "idle_wait_s_max": max((p.waited_s for p in probes), default=None),
    }
    details = {"timeline": rows, "log_lines": log_lines[:50], "probes": [_probe_row(p) for p in probes]}
    fails: list[str] = []
    if not alive:
        fails.append(f"server process is not alive after the scenarios (exit code {exit_code})")
    elif exit_code is not None and exit_code not in ok_exit_codes:
        fails.append(f"server exited with status {exit_code}")
    if log_lines:
        fails.append(f"{len(log_lines)} bad log line(s), first: {log_lines[0][:160]}")
    fails += [f"scenario error: {e}" for e in scenario_errors]
    for p in probes:
        missing = [g for g in gauges if g not in p.values]
        if missing:
            fails.append(f"{p.scenario}: gauge(s) {', '.join(missing)} missing from /metrics")
        elif not p.reached:
            why = "; ".join(p.problems) if p.problems else ", ".join(f"{g}={p.values[g]:g}" for g in gauges)
            fails.append(f"{p.scenario}: idle invariant broken before any flush ({why})")
    if not probes and not fails:
        return Verdict(CHECK, "skip", metrics, "no scenario ran: nothing shows the pools return to idle", details)
    if probes and not any(p.requests for p in probes) and not fails:
        return Verdict(CHECK, "skip", metrics, "vacuous: the scenarios sent no request", details)
    if require_load_evidence and not fails:
        moved = peak(timeline, MAMBA_GAUGE)
        if not timeline:
            fails.append("no occupancy sample under load: cannot tell the gauges are live")
        elif not moved:
            fails.append(f"{MAMBA_GAUGE} never rose above 0 under load: a leak would be invisible")
    if lazy_ratio_max is not None and lazy_resident_ratio is not None and lazy_resident_ratio > lazy_ratio_max:
        fails.append(f"lazy resident ratio {lazy_resident_ratio:.2f} > {lazy_ratio_max:.2f} (claim: about half of extra_buffer)")
    if fails:
        return Verdict(CHECK, "fail", metrics, "; ".join(fails), details)
    return Verdict(CHECK, "pass", metrics, "", details)


def _worst(values) -> float | None:
    """The largest present value (None when no probe carries the gauge)."""
    present = [v for v in values if v is not None and v == v]
    return max(present) if present else None


def _probe_row(p: IdleProbe) -> dict:
    return {
        "scenario": p.scenario,
        "reached": p.reached,
        "values": dict(p.values),
        "after_flush": dict(p.after_flush),
        "fresh": p.fresh,
        "problems": list(p.problems),
        "waited_s": p.waited_s,
        "requests": p.requests,
    }
