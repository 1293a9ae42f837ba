"""Pool-leak check: idle gauges back to 0 after every scenario, a clean server log, a live
process, and a pool-occupancy timeline that shows the gauges actually move under load.

Inputs are plain values (gauge dicts from ``SGLangClient.metrics()``, the log text, the
process state, session turn records), so the check needs no server.

* :func:`leak_verdict`: SGLang's idle invariant after every scenario, before any flush;
* :func:`track_slot_verdict`: resident ping-pong track slots per running request under a
  burst (:func:`track_slot_use`), each strategy against its contract, and the lazy claim
  (``extra_buffer_lazy`` holds about half the resident ping-pong slots of ``extra_buffer``)
  against the ``extra_buffer`` sibling cell under the same load;
* :func:`abort_problems`: an aborted session turn really was decoding when aborted and
  finished as an abort, cut short.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from conformance.checks.findings import VACUOUS, Finding, failing
from conformance.recordings import IdleProbe, OccupancySample, SessionRecording
from conformance.records import Verdict
from conformance.server_log import last_crash
from conformance.matrix.strategy import Strategy, strategy_named
from conformance.sglang_contract.metric_names import (
    IDLE_TERMS, KIT_BUSY_PERIODS, KIT_DECODE_REQ_STEPS, KIT_DECODE_RUNNING_PEAK, KIT_MAMBA_USED_PEAK, KIT_RUNNING_REQS,
    KIT_TRACK_SLOT_REQ_STEPS, KIT_TRACK_SLOTS_REQ_PEAK, KIT_TRACK_SLOTS_STEP_PEAK, KIT_WAITING_REQS, KV_USED_TOKENS,
    MAMBA_PINGPONG_RESIDENT_SLOTS, MAMBA_USED_TOKENS, NUM_QUEUE_REQS, NUM_RUNNING_REQS,
)

CHECK = "leaks"

LOG_PATTERNS = (
    re.compile(r"memory leak detected", re.I),
    re.compile(r"Traceback \(most recent call last\)"),
    re.compile(r"Scheduler hit an exception"),
    re.compile(r"Received sigquit from a child process", re.I),
    re.compile(r"scheduler (?:process )?(?:died|is dead|exited|crashed)", re.I),
    re.compile(r"Child process unexpectedly failed", re.I),
)


#: One pool's line of SGLang's own idle-check report: ``[mamba] total=48, available=45, evictable=0, ...``.
_POOL_REPORT = re.compile(r"\[(?P<pool>\w+)\] total=(?P<total>-?\d+)(?P<terms>(?:, \w+=-?\d+(?=,|\s|$))*)")
_TERM = re.compile(r"(\w+)=(-?\d+)")
#: SGLang's report's pool name -> the finding kind of a broken idle invariant there (the
#: kit's own gauges name the pools ``mamba`` and ``kv``).
POOL_KINDS = {"mamba": "leak_mamba", "full": "leak_kv", "swa": "leak_kv", "kv": "leak_kv", "host_kv": "leak_host", "host_mamba": "leak_host"}


def leak_report_pools(text: str) -> list[tuple[str, str]]:
    """The pools whose terms do not add up in the last "memory leak detected" report of a
    server log (SGLang's idle check: ``available + evictable + protected + session_held +
    uncached == total`` per pool), each with its report line: ``[("mamba", "[mamba] total=48, ...")]``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "memory leak detected" in line]
    if not starts:
        return []
    out = []
    for line in lines[starts[-1]: starts[-1] + 8]:
        for m in _POOL_REPORT.finditer(line):
            terms = [int(v) for _, v in _TERM.findall(m["terms"])]
            if sum(terms) != int(m["total"]):
                out.append((m["pool"], line[m.start():].strip()))
    return out


def pool_finding(problem: str, line: str | None = None) -> Finding:
    """A problem of an idle probe (:func:`idle_invariant`'s ``"<pool>: ..."``, after a flush,
    a gauge that must read 0, a server that never went idle) as a finding of its kind; a
    missing gauge judges nothing (``kit_error``)."""
    text = problem.removeprefix("after /flush_cache: ")
    pool = text.split(":", 1)[0]
    if "missing from /metrics" in text:
        kind = "kit_error"
    elif text.startswith("server never went idle"):
        kind = "hung"
    else:
        kind = POOL_KINDS.get(pool, "stuck_at_idle")
    return Finding(kind, line or problem, {"pool": pool, "by": "idle_invariant"} if kind.startswith("leak_") else {})


#: The check a cell's teardown files when an idle probe of its scenarios (or its last one) did
#: not reach SGLang's idle invariant.
TEARDOWN = "teardown"


def teardown_verdict(cell_id: str, bad: Sequence[IdleProbe]) -> Verdict:
    """The cell's teardown over the idle probes that did not reach idle: each problem a
    finding of its kind (:func:`pool_finding`, as the leaks suite files it), so a known bug
    may excuse it by its kind as it excuses the leaks suite's."""
    found = [pool_finding(problem, f"{p.scenario}: {problem}") for p in bad for problem in (p.problems or ("not idle",))]
    where = "; ".join(f"{p.scenario}: {', '.join(p.problems[:2]) or 'not idle'}" for p in bad[:3])
    return failing(TEARDOWN, found, {"probes_not_idle": len(bad)}, reason=f"cell {cell_id}: pools not idle ({where})")


def death_findings(line: str, log_text: str, *, startup: bool = False) -> list[Finding]:
    """What a server's death (or its log's error lines) names, as findings each carrying
    ``line``: SGLang's own idle check (one finding per pool its report shows broken,
    ``leak_<pool>``, or ``server_died:idle_check``), one of SGLang's own assertions
    (``server_died:assertion``), another exception (``server_died:exception``: not SGLang's
    invariant), or nothing the log explains (``server_died:unexplained`` / ``:startup``)."""
    pools = leak_report_pools(log_text)
    if pools:  # the line names the broken pool's own report (SGLang's first report line is [full])
        return [Finding(POOL_KINDS.get(pool, "leak_kv"), line if report[:40] in line else f"{line}; the broken pool: {report[:200]}",
                        {"pool": pool, "by": "sglang_idle_check", "report": report[:200]})
                for pool, report in pools]
    if "memory leak detected" in log_text:
        return [Finding("server_died:idle_check", line, {"by": "sglang_idle_check"})]
    crash = last_crash(log_text)
    if crash is not None and crash.in_sglang:
        where = f"{crash.path.rsplit('/', 1)[-1]}:{crash.line}"
        exception = crash.exception.split(":", 1)[0].rsplit(".", 1)[-1]
        kind = "server_died:assertion" if crash.sglang_assertion else "server_died:exception"
        return [Finding(kind, line, {"at": where, "exception": exception})]
    if crash is not None:
        return [Finding("server_died:exception", line, {"exception": crash.exception.split(":", 1)[0].rsplit(".", 1)[-1], "in_sglang": False})]
    return [Finding("server_died:startup" if startup else "server_died:unexplained", line)]


def is_idle(values: Mapping[str, float]) -> bool:
    """Nothing running and nothing queued (by SGLang's gauges, or the kit's where present)."""
    running = values.get(KIT_RUNNING_REQS, values.get(NUM_RUNNING_REQS, 0.0))
    waiting = values.get(KIT_WAITING_REQS, values.get(NUM_QUEUE_REQS, 0.0))
    return running == 0 and waiting == 0


def idle_invariant(values: Mapping[str, float]) -> list[str]:
    """SGLang's idle invariant ``available + evictable + protected + session_held == total``
    from outside, per pool: with nothing running, what the pool counts as used must be
    exactly what open sessions and locked tree nodes hold.  Above: a leak; below: a slot
    counted twice.  A missing ``used`` gauge is itself a problem (nothing is judged)."""
    problems = []
    for pool, terms in IDLE_TERMS.items():
        used = values.get(terms.used)
        if used is None or used != used:
            problems.append(f"{pool}: gauge {terms.used} missing from /metrics")
            continue
        protected = values.get(terms.protected, 0.0)
        held = values.get(terms.session_held, 0.0)
        if protected:
            problems.append(f"{pool}: {protected:g} protected (locked) at idle: a lock was not released")
        leaked = used - protected - held
        if leaked > 0:
            problems.append(f"{pool}: {leaked:g} used at idle beyond what sessions hold (used {used:g}, session-held {held:g}): leaked")
        elif leaked < 0:
            problems.append(f"{pool}: used {used:g} < session-held {held:g} + protected {protected:g}: counted twice")
        total = values.get(terms.total)
        avail, evict = values.get(terms.available), values.get(terms.evictable)
        if total is not None and avail is not None and evict is not None and avail + evict + used != total:
            problems.append(f"{pool}: available {avail:g} + evictable {evict:g} + used {used:g} != total {total:g}")
    return problems


def after_flush_problems(values: Mapping[str, float]) -> list[str]:
    """After ``/flush_cache`` on an idle server nothing stays evictable in the radix cache."""
    problems = []
    for pool, terms in IDLE_TERMS.items():
        evict = values.get(terms.evictable)
        if evict:
            problems.append(f"{pool}: {evict:g} still evictable after the flush")
    return problems


def scan_log(text: str) -> list[str]:
    """Lines of a server log that report a leak, a traceback or a dead scheduler."""
    return [line.strip() for line in text.splitlines() if any(p.search(line) for p in LOG_PATTERNS)]


#: SGLang's own lines when a process of the server went away without an error of its own
#: (a signal from outside: the OOM killer, a kill): what a death with no error names.
_SHUTDOWN_SIGNS = re.compile(r"Subprocess \w+ \(pid=\d+\) crashed with exit code -?\d+|SIGQUIT received.*|SIGTERM received.*")


def death_cause(text: str) -> str:
    """Why a server's log says it stopped serving: its last traceback; else its last error line; else SGLang's last
    line about a process that went away (no error of its own: killed from outside); else
    that the log names nothing.  A traceback's exception is named with the frame that raised
    it (``conformance.server_log``), not by its first line."""
    crash = last_crash(text)
    later = scan_log("\n".join(text.splitlines()[crash.at_line + 1:])) if crash else scan_log(text)
    if later:  # an error line of the server's own after its last traceback (or with none)
        return later[-1][:300]
    if crash:
        return crash.describe()
    signs = _SHUTDOWN_SIGNS.findall(text)
    if signs:
        return f"no error in its log; SGLang's last word: {signs[-1][:200]} (no error of its own: likely killed from outside, e.g. by the OOM killer)"
    return "no error in its log"


def timeline_rows(samples: Sequence[OccupancySample]) -> list[list[float]]:
    """``[[t_s, mamba_used, kv_used, running], ...]`` for the report (NaN-free: 0 if absent)."""
    return [[s.t_s, s.values.get(MAMBA_USED_TOKENS, 0.0), s.values.get(KV_USED_TOKENS, 0.0), s.values.get(NUM_RUNNING_REQS, 0.0)] for s in samples]


def peak(samples: Sequence[OccupancySample], gauge: str) -> float | None:
    vals = [s.values[gauge] for s in samples if gauge in s.values]
    return max(vals) if vals else None


# ------------------------------------------------------------------ resident track slots
# Busy-side gauges the kit's observe plugin publishes from SGLang's request objects
# (conformance/sglang_plugins/observe.py): cumulative sums over decode steps and peaks.
TRACK_GAUGES = (KIT_DECODE_REQ_STEPS, KIT_TRACK_SLOT_REQ_STEPS, KIT_TRACK_SLOTS_REQ_PEAK, KIT_TRACK_SLOTS_STEP_PEAK,
                KIT_DECODE_RUNNING_PEAK, KIT_BUSY_PERIODS)
#: "about half" of extra_buffer's resident ping-pong slots: the mean ratio must not exceed this.
LAZY_RATIO_MAX = 0.75


@dataclass(frozen=True)
class TrackSlotUse:
    """Ping-pong track slots held per running request under one load, and how measured.

    ``mean_per_request``: track slots held per request-step of decode, averaged over the
    load (what stays resident); ``peak_per_request``: the most one request held in one
    step; ``peak_step_total`` / ``running_peak``: the most held by one decode batch and the
    most requests in one.  ``request_steps`` is the evidence (0: nothing decoded)."""

    method: str
    mean_per_request: float | None
    peak_per_request: float | None
    peak_step_total: float | None = None
    running_peak: float | None = None
    request_steps: float = 0.0
    windows: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


def track_slot_use(timeline: Sequence[OccupancySample]) -> TrackSlotUse | None:
    """Resident track slots per running request from an occupancy timeline taken around a
    load: from the kit's cumulative observe gauges (real SGLang) when present, else from
    sampled instantaneous gauges (:data:`MAMBA_PINGPONG_RESIDENT_SLOTS` over running requests, the
    reference server); None when the target exports neither."""
    with_counters = [s for s in timeline if KIT_DECODE_REQ_STEPS in s.values and KIT_TRACK_SLOT_REQ_STEPS in s.values]
    if len(with_counters) >= 2:
        first, last = with_counters[0].values, with_counters[-1].values
        steps = last[KIT_DECODE_REQ_STEPS] - first[KIT_DECODE_REQ_STEPS]
        slots = last[KIT_TRACK_SLOT_REQ_STEPS] - first[KIT_TRACK_SLOT_REQ_STEPS]
        w0 = first.get(KIT_BUSY_PERIODS, 0.0)
        inside = [s.values for s in with_counters if s.values.get(KIT_BUSY_PERIODS, 0.0) > w0]  # windows opened by this load
        return TrackSlotUse(
            "hybrid_conformance observe gauges (SGLang request objects, every decode step)",
            slots / steps if steps > 0 else None,
            max((v.get(KIT_TRACK_SLOTS_REQ_PEAK, 0.0) for v in inside), default=None),
            max((v.get(KIT_TRACK_SLOTS_STEP_PEAK, 0.0) for v in inside), default=None),
            max((v.get(KIT_DECODE_RUNNING_PEAK, 0.0) for v in inside), default=None),
            steps,
            int(last.get(KIT_BUSY_PERIODS, 0.0) - w0),
        )
    busy = [s.values for s in timeline if MAMBA_PINGPONG_RESIDENT_SLOTS in s.values and s.values.get(NUM_RUNNING_REQS, 0.0) > 0]
    if busy:
        ratios = [v[MAMBA_PINGPONG_RESIDENT_SLOTS] / v[NUM_RUNNING_REQS] for v in busy]
        return TrackSlotUse(
            f"{MAMBA_PINGPONG_RESIDENT_SLOTS} / {NUM_RUNNING_REQS} over {len(busy)} busy samples",
            sum(ratios) / len(ratios),
            None,
            max(v[MAMBA_PINGPONG_RESIDENT_SLOTS] for v in busy),
            max(v[NUM_RUNNING_REQS] for v in busy),
            float(sum(v[NUM_RUNNING_REQS] for v in busy)),
            1,
        )
    return None


def track_slot_verdict(
    strategy: Strategy | str,
    use: TrackSlotUse | None,
    *,
    overlap: bool,
    eager: TrackSlotUse | None = None,
    ratio_max: float = LAZY_RATIO_MAX,
) -> Verdict:
    """Judge one cell's resident track slots against its strategy's contract and, for
    ``extra_buffer_lazy``, the claim "about half the resident ping-pong memory of
    extra_buffer" against the ``extra_buffer`` sibling measured under the same load (or, when
    the sibling was not recorded in this run, against extra_buffer's contract, said so).

    The claim is asserted on the mean; the peak ratio is reported with a note when the claim
    does not hold for it (requests that cross a track boundary in the same step each hold 2)."""
    s = strategy_named(strategy)
    metrics: dict = {"lazy_resident_ratio": None, "track_slots_mean_per_request": None}
    if use is None or use.mean_per_request is None:
        why = "the target exports no track-slot gauge" if use is None else "no decode step was observed under load"
        return failing(CHECK, [Finding(VACUOUS, f"{s.name}: resident track slots unmeasured: {why}")], metrics)
    metrics.update(
        track_slots_mean_per_request=round(use.mean_per_request, 4),
        track_slots_peak_per_request=use.peak_per_request,
        decode_running_peak=use.running_peak,
        track_slot_request_steps=use.request_steps,
    )
    details: dict = {"track_slots": use.to_json()}
    mean, peak = use.mean_per_request, use.peak_per_request
    fails: list[str] = []
    notes: list[str] = []
    resident = s.resident_track_slots(overlap=overlap)
    if not s.has_buffer:
        if mean != 0 or (peak or 0) != 0:
            fails.append(f"{s.name} requests held track slots (mean {mean:.3g}, peak {peak}): expected none")
    elif not s.lazy:
        if abs(mean - resident) > 1e-9 or (peak is not None and peak != resident):
            fails.append(f"{s.name} requests held {mean:.3g} track slots on average (peak {peak}), expected {resident} (overlap {'on' if overlap else 'off'})")
    else:
        sibling = s.eager
        contract = sibling.resident_track_slots(overlap=overlap)
        if eager is not None and eager.mean_per_request:
            base, base_name = eager.mean_per_request, f"{sibling.name} sibling"
            base_peak = eager.peak_per_request
        else:
            base, base_name, base_peak = float(contract), f"{sibling.name} contract (sibling not recorded in this run)", float(contract)
            notes.append(f"{sibling.name} sibling not recorded in this run: compared with its contract of {contract} slots per request")
        ratio = mean / base
        metrics.update(lazy_resident_ratio=round(ratio, 4), lazy_baseline=base_name, lazy_baseline_mean=base)
        if peak is not None and base_peak:
            metrics["lazy_peak_ratio"] = round(peak / base_peak, 4)
        if mean < resident - 1e-9:
            fails.append(f"lazy requests held {mean:.3g} track slots on average: below the {resident} they always hold")
        if peak is not None and peak > s.peak_track_slots:
            fails.append(f"a lazy request held {peak:g} track slots in one step (at most {s.peak_track_slots})")
        if ratio > ratio_max:
            fails.append(f"lazy resident ratio {ratio:.2f} > {ratio_max:.2f}: mean {mean:.3g} vs {base:.3g} slots per request ({base_name}); claim: about half")
        else:
            notes.append(f"claim holds on the mean: {mean:.3g} vs {base:.3g} slots per running request ({ratio:.2f})")
        if metrics.get("lazy_peak_ratio") is not None and metrics["lazy_peak_ratio"] > ratio_max:
            notes.append(
                f"claim does not hold on the peak: a lazy request held {peak:g} slots in one step vs {base_peak:g} "
                f"(ratio {metrics['lazy_peak_ratio']:.2f}): requests that cross a track boundary together each hold 2"
            )
    details["notes"] = notes
    if fails:
        return failing(CHECK, [Finding("track_slots", f) for f in fails], metrics, details, reason="; ".join(fails + notes))
    return Verdict(CHECK, "pass", metrics, "; ".join(notes), details)


def abort_problems(rec: SessionRecording) -> list[str]:
    """Every turn the kit aborted must have been seen decoding before the abort, end with
    finish reason ``abort``, and stop short of its ``max_new_tokens``; a recording that was
    asked to abort nothing proves nothing about aborts."""
    aborted = [t for t in rec.turns if t.aborted]
    if not aborted:
        return ["no turn was aborted: the abort path was not exercised"]
    out = []
    for t in aborted:
        where = f"session {t.session} turn {t.turn} (aborted)"
        if not t.decoding_seen:
            out.append(f"{where}: never seen decoding before the abort ({t.tokens_at_abort} tokens streamed): the abort did not hit a decoding request")
        if t.finish != "abort":
            out.append(f"{where}: finish reason {t.finish!r}, expected 'abort'" + (f" ({t.error})" if t.error else ""))
        elif t.max_new_tokens is not None and t.output_len >= t.max_new_tokens:
            out.append(f"{where}: reported abort after all {t.output_len}/{t.max_new_tokens} tokens")
    return out


def leak_verdict(
    probes: Sequence[IdleProbe],
    *,
    log_text: str = "",
    alive: bool = True,
    exit_code: int | None = None,
    ok_exit_codes: Sequence[int] = (0, -15, 143),
    timeline: Sequence[OccupancySample] = (),
    require_load_evidence: bool = True,
    scenario_errors: Sequence[str] = (),
    gauges: Sequence[str] = (MAMBA_USED_TOKENS, KV_USED_TOKENS),
    sessions: SessionRecording | None = None,
    tree: Sequence[Finding] = (),
) -> Verdict:
    """Judge the idle probes of a cell's scenarios plus its log and process state (and,
    given a session recording, its aborted turns: :func:`abort_problems`; ``tree``: the tree
    audit's findings, ``conformance/checks/tree_structure.py``)."""
    log_lines = scan_log(log_text)
    rows = timeline_rows(timeline)
    at_idle = {g: _worst(p.values.get(g) for p in probes) for g in gauges}
    metrics = {
        "mamba_used_at_idle": at_idle.get(MAMBA_USED_TOKENS),
        "kv_used_at_idle": at_idle.get(KV_USED_TOKENS),
        "leak_log_lines": len(log_lines),
        "lazy_resident_ratio": None,  # judged by track_slot_verdict
        "scenarios": len(probes),
        "mamba_used_peak": peak(timeline, MAMBA_USED_TOKENS),
        "idle_wait_s_max": max((p.waited_s for p in probes), default=None),
    }
    details = {"timeline": rows, "log_lines": log_lines[:50], "probes": [_probe_row(p) for p in probes]}
    fails: list[Finding] = list(tree)
    if sessions is not None:
        aborted = [t for t in sessions.turns if t.aborted]
        metrics["aborted_turns"] = len(aborted)
        metrics["abort_tokens_streamed_min"] = min((t.tokens_at_abort or 0 for t in aborted), default=None)
        details["turns"] = [dict(t.__dict__) for t in sessions.turns]
        fails += [Finding("session_abort" if aborted else "vacuous", p) for p in abort_problems(sessions)]
    died = []
    if not alive:
        died.append(f"server process is not alive after the scenarios (exit code {exit_code})")
    elif exit_code is not None and exit_code not in ok_exit_codes:
        died.append(f"server exited with status {exit_code}")
    if log_lines:
        died.append(f"{len(log_lines)} bad log line(s), first: {log_lines[0][:160]}")
        reports = [line for line in log_lines if LOG_PATTERNS[0].search(line)]
        if reports and reports[0] != log_lines[0]:  # SGLang's own leak report, not only the traceback's first line
            died.append(f"SGLang's leak report: {reports[0][:200]}")
    for line in died:  # one cause, named by the log: each line judged as that cause
        fails += death_findings(line, log_text)
    cause = fails[-1] if died else None

    def consequence(line: str) -> Finding:
        """What a dead server leaves (a scenario that raised, gauges it no longer serves) is
        its death's finding; on a live server the kit could not judge."""
        return Finding(cause.kind, line, cause.facts) if cause is not None else Finding("kit_error", line)

    fails += [consequence(f"scenario error: {e}") for e in scenario_errors]
    for p in probes:
        missing = [g for g in gauges if g not in p.values]
        if missing:
            fails.append(consequence(f"{p.scenario}: gauge(s) {', '.join(missing)} missing from /metrics"))
        elif not p.reached and p.problems:
            fails += [pool_finding(q, f"{p.scenario}: idle invariant broken before any flush ({q})") for q in p.problems]
        elif not p.reached:
            why = ", ".join(f"{g}={p.values[g]:g}" for g in gauges)
            fails.append(Finding("kit_error", f"{p.scenario}: idle invariant broken before any flush ({why})"))
    if not probes and not fails:
        return Verdict(CHECK, "skip", metrics, "no scenario ran: nothing shows the pools return to idle", details)
    if probes and not any(p.requests for p in probes) and not fails:
        return Verdict(CHECK, "skip", metrics, "vacuous: the scenarios sent no request", details)
    if require_load_evidence and not fails:
        moved = peak(timeline, MAMBA_USED_TOKENS) or peak(timeline, KIT_MAMBA_USED_PEAK)
        if not timeline:
            fails.append(Finding(VACUOUS, "no occupancy sample under load: cannot tell the gauges are live"))
        elif not moved:
            fails.append(Finding(VACUOUS, f"{MAMBA_USED_TOKENS} (and {KIT_MAMBA_USED_PEAK} where published) never rose above 0 under load: a leak would be invisible"))
    if fails:
        return failing(CHECK, fails, metrics, details)
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
