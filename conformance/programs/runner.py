"""Play a request program over HTTP and judge it after every step.

``run_program(program, target)`` starts from an idle, flushed server, plays each step
(requests go in flight on threads; ``wait``/``idle`` and follow-ups block on what they
need), and after every step hands the oracle what happened: answers that arrived (their
shape, and a batched cold computation of each on the cache-off twin), hits whose
overlapping requests all finished, and -- whenever nothing is in flight -- the idle
invariant and the reuse counters.  The first finding raises a :class:`ProgramFailure`
of its kind (:func:`failure_type`: one exception type per kind of finding, so hypothesis
shrinks each kind on its own) with the step, the request and the numbers; whatever was in
flight is aborted and open sessions are closed, so the next program starts from a usable
server.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.checks.differential import Tolerance, cold_from_meta, compare_served, served_logprobs
from conformance.checks.hit_bounds import StrategyGrid
from conformance.checks.leaks import death_findings, pool_finding
from conformance.server_log import last_crash
from conformance.checks.reuse import ReuseTally
from conformance.checks.tree_structure import tree_findings
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.checks.findings import Finding
from conformance.programs.coverage import Coverage, program_coverage, read_coverage
from conformance.programs.evidence import Evidence, RecordedAdmission
from conformance.programs.flights import Clock, Flight, FlightDeck
from conformance.programs.oracle import HitBook, Limits, Served, answer_problems, counter_problems, retraction_allowance, idle_problems, log_cached_tokens
from conformance.programs.program import (
    After, Burst, Close, Flush, Idle, Open, Program, Send, Step, Turn, Wait, describe_step,
)
from conformance.programs.resolve import Resolver
from conformance.session.suite_support import idle_probe
from conformance.sglang_plugins import evict_all
from conformance.sglang_contract.metric_names import CACHED_TOKENS_TOTAL, KIT_TREE_AUDITS_TOTAL
from conformance.targets.serving import not_serving

WAIT_S = 300.0
#: How long the observe plugin may take to answer an evict-all request (it answers at an idle publish, about 1 s).
EVICT_ALL_DEADLINE_S = 30.0
#: After a failure the program's requests are aborted and the scheduler goes idle, where
#: SGLang's own idle check runs: how long the runner reads the log for what it reports.
LATE_DEATH_S = 3.0
#: What burst members and session turns ask for (``Resolver``): output logprobs and a top-5.
LOGPROB_OPTIONS = {"return_logprob": True, "top_logprobs_num": 5}


class ProgramFailure(AssertionError):
    """A program broke the oracle: ``step`` is the step index (len(steps) = the end),
    ``findings`` what it found (one, or one per pool a death's leak report names)."""

    def __init__(self, step: int, findings: list[Finding], trace: list[str]) -> None:
        what = findings[0].line
        super().__init__(f"step {step}: {what}")
        self.step, self.what, self.trace, self.findings = step, what, trace, list(findings)

    @property
    def kind(self) -> str:
        return self.findings[0].kind


_FAILURE_TYPES: dict[str, type[ProgramFailure]] = {}


def failure_type(kind: str) -> type[ProgramFailure]:
    """The :class:`ProgramFailure` subclass of one kind of finding.  Hypothesis tells failures
    apart by exception type and the line that raised them, and every finding is raised from
    one line (:meth:`ProgramRun.fail`): one type per kind keeps a shrink from turning one
    kind of finding into another."""
    if kind not in _FAILURE_TYPES:
        _FAILURE_TYPES[kind] = type(f"ProgramFailure[{kind}]", (ProgramFailure,), {"__module__": __name__})
    return _FAILURE_TYPES[kind]


def program_failure(step: int, findings: list[Finding], trace: list[str]) -> ProgramFailure:
    """The failure of its first finding's kind."""
    return failure_type(findings[0].kind)(step, findings, trace)


@dataclass
class ProgramTarget:
    """What a program runs against: the server under test and the cache-off twin."""

    client: SGLangClient
    cold: SGLangClient
    grid: StrategyGrid
    limits: Limits
    tol: Tolerance
    exact: bool
    idle_deadline_s: float = 5.0
    log_text: Any = None  # () -> the server log so far, or None
    alive: Any = None  # () -> None while the process lives, else why not
    info: dict[str, Any] = field(default_factory=dict)
    requests: Any = None  # evidence.RequestLog: the server's per-request evidence (real SGLang), or None
    noise: dict[str, Any] = field(default_factory=dict)  # non-exact mode: the measured noise ``tol`` comes from (programs.noise)
    #: the server mixes prefill chunks into running decodes, only for requests without logprobs
    #: (``conformance.matrix.axes.MIXED_BATCHES``): bursts then ask none, so their prefills mix
    mixed: bool = False


@dataclass
class RunStats:
    requests: int = 0
    hits: int = 0
    compared_tokens: int = 0
    idle_checks: int = 0
    steps: int = 0
    seconds: float = 0.0
    max_logprob_gap: float = 0.0  # largest |served - cold| logprob seen (exact mode: the noise)
    #: judged hits per relaxation that admitted them (oracle.PERMISSIONS; absent: none)
    permissions: dict[str, int] = field(default_factory=dict)
    cold_s: float = 0.0  # seconds waiting for the cache-off twin's batched cold computations
    idle_s: float = 0.0  # seconds in idle checks (waiting for fresh idle gauges)
    max_topk_kl: float = 0.0  # largest per-token top-k KL (cold || served) of a request that passed
    max_flip_margin: float = 0.0  # largest flip margin (checks.differential.flip_margin) of a request that passed
    hits_seen_stored: int = 0  # judged hits whose state SGLang's per-node records showed stored before admission
    #: judged hits per relaxation the prefix model alone needed (before the per-node records settled them)
    model_permissions: dict[str, int] = field(default_factory=dict)
    #: judged requests whose owed hit SGLang's per-node records gave exactly, and the others by why they are only bounded
    expected_exact: int = 0
    expected_bounded: dict[str, int] = field(default_factory=dict)
    #: reuse efficiency, reported and not judged (``checks.reuse``)
    reuse: ReuseTally = field(default_factory=ReuseTally)
    #: audits of SGLang's tree seen at the idle checks (None: the server audits none, not real SGLang)
    tree_audits: float | None = None
    #: what SGLang was seen doing under memory pressure (``programs.coverage``)
    coverage: Coverage = field(default_factory=Coverage)
    #: eviction walks over the whole tree answered at program ends and before flushes (evict, don't flush),
    #: and why the release's tree could not be driven so (None: it could, or it was not asked)
    evict_alls: int = 0
    evict_all_error: str | None = None
    #: requests whose asked abort came after they had finished (a loaded machine outran the client):
    #: the run did not play those steps as written
    late_aborts: list[str] = field(default_factory=list)

    def note_hit(self, s: Served) -> None:
        """Count one judged request: what admitted its hit, before and after the records, and
        whether the hit SGLang owed it was exact."""
        for book, name in ((self.permissions, s.permission), (self.model_permissions, s.model_permission)):
            if name:
                book[name] = book.get(name, 0) + 1
        if s.expected == "exact":
            self.expected_exact += 1
        elif s.expected:
            self.expected_bounded[s.expected] = self.expected_bounded.get(s.expected, 0) + 1
        if s.expected:
            self.reuse.note(s.reuse)

    @classmethod
    def total(cls, runs: "list[RunStats]") -> "RunStats":
        """The sum over several programs' runs (the largest logprob gap of any)."""
        def summed(name: str) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in runs:
                for k, n in getattr(r, name).items():
                    out[k] = out.get(k, 0) + n
            return out

        return cls(
            sum(r.requests for r in runs), sum(r.hits for r in runs), sum(r.compared_tokens for r in runs),
            sum(r.idle_checks for r in runs), sum(r.steps for r in runs), sum(r.seconds for r in runs),
            max((r.max_logprob_gap for r in runs), default=0.0), summed("permissions"), sum(r.cold_s for r in runs), sum(r.idle_s for r in runs),
            max((r.max_topk_kl for r in runs), default=0.0), max((r.max_flip_margin for r in runs), default=0.0),
            sum(r.hits_seen_stored for r in runs), summed("model_permissions"), sum(r.expected_exact for r in runs), summed("expected_bounded"),
            ReuseTally.total(r.reuse for r in runs),
            None if all(r.tree_audits is None for r in runs) else sum(r.tree_audits or 0 for r in runs), Coverage.total(r.coverage for r in runs),
            sum(r.evict_alls for r in runs), next((r.evict_all_error for r in runs if r.evict_all_error), None),
            [rid for r in runs for rid in r.late_aborts],
        )


def cold_logprob_start(input_len: int, served_start: int | None) -> int:
    """``logprob_start_len`` of the cold computation of a request whose input logprobs were
    served from ``served_start`` (None: output logprobs only).  SGLang answers None at the
    first position of a prefill's logprobs (it has no row before it), so the cold side
    starts one position earlier: its first real value is then the served first position
    (or, output only, the first output token)."""
    return max(0, min(input_len, served_start if served_start is not None else input_len) - 1)


class ProgramRun:
    def __init__(self, program: Program, target: ProgramTarget) -> None:
        self.p, self.t = program, target
        self.tag = uuid.uuid4().hex[:8]
        self.clock = Clock()
        self.deck = FlightDeck(target.client.base_url, self.clock)
        self.resolver = Resolver(program, target.grid, target.limits, exact=target.exact, tag=self.tag, mixed=target.mixed)
        self.evidence = Evidence(target.requests)
        self.book = HitBook(target.grid, target.limits, self.evidence, server_rid=self.resolver.server_rid)
        self.flights: dict[str, Flight] = {}  # rid -> its flight (bursts share one)
        self.served: dict[str, Served] = {}
        self.pending: list[Flight] = []
        self.sessions: dict[str, str] = {}  # program sid -> server session id
        self.trace: list[str] = []
        self.stats = RunStats()
        self.step_no = 0
        self._since_idle: list[Served] = []
        self._counter0 = 0.0
        self._audits0: float | None = None  # the tree audits counter at the last idle check (program start)
        self._violations0 = 0  # tree violations of the per-request log already judged
        self._log0 = 0
        self._log_start = 0  # the log's length when the program started (its flush done)
        self._coverage0 = Coverage()

    # ------------------------------------------------------------ top level
    def run(self) -> RunStats:
        t0 = time.monotonic()
        try:
            self._start()
            for i, step in enumerate(self.p.steps):
                self.step_no = i
                self.trace.append(f"{i:>3} {describe_step(step)}")
                self._apply(step)
                self._settle()
                self.stats.steps += 1
            self.step_no = len(self.p.steps)
            self.trace.append(f"{self.step_no:>3} end: close open sessions, wait for every request")
            for sid in list(self.sessions):
                self._close(sid)
            self._wait_all()
            self._settle(final=True)
            self._evict_all()
            self.stats.coverage = program_coverage(self._coverage(), self._coverage0, self.stats.tree_audits)
        except KitError:  # a scheduler that died mid-step leaves connection errors: name the death, a finding
            dead = self._dead()
            self._cleanup()
            if dead:
                raise program_failure(self.step_no, self._death(dead), self.trace) from None
            raise
        except ProgramFailure as failure:
            self._cleanup()
            later = self._late_death(failure)
            if later:
                raise program_failure(failure.step, [*failure.findings, *later], failure.trace) from None
            raise
        except BaseException:
            self._cleanup()
            raise
        finally:
            self.deck.close()
            self.stats.seconds = time.monotonic() - t0
        return self.stats

    def fail(self, *findings: Finding) -> None:
        """End the program here with ``findings``, after what the tree audit named since its last
        look: a tree rule broken before an answer went wrong is the likelier cause, so it comes first."""
        try:
            tree = self._new_violations()
        except (OSError, ValueError):  # an unreadable evidence file: the findings alone
            tree = []
        raise program_failure(self.step_no, [*tree, *findings], self.trace)

    def _death(self, why: str, *, where: str = "server died") -> list[Finding]:
        """A dead server's findings: first what the tree audit named before it died (a leak or a
        broken tree the death followed from is the finding, the death its consequence), then
        the death, named by its log (``checks.leaks.death_findings``)."""
        try:
            audit = self._new_violations()
        except (OSError, ValueError):  # an unreadable evidence file: the death alone
            audit = []
        return [*audit, *death_findings(f"{where}: {why}", self.t.log_text() if self.t.log_text else "")]

    def _start(self) -> None:
        c = self.t.client
        dead = self._dead()
        if dead:
            self.fail(*self._death(dead, where="server not serving before the program started"))
        c.flush_cache(attempts=40, pause_s=0.25)
        metrics = c.metrics()
        self.evidence.reset(self.clock.tick(), metrics)
        self._counter0 = metrics.get(CACHED_TOKENS_TOTAL, 0.0)
        self._log0 = len(self.t.log_text()) if self.t.log_text else 0
        self._log_start = self._log0
        self._audits0 = metrics.get(KIT_TREE_AUDITS_TOTAL)
        self._violations0 = len(self.t.requests.tree_violations) if self.t.requests is not None else 0
        self._coverage0 = self._coverage()

    def _coverage(self) -> Coverage:
        """The coverage counters SGLang's per-request records show so far (cumulative)."""
        if self.evidence.requests is not None:
            self.evidence.requests.refresh()
        return read_coverage(self.evidence.requests)

    # ------------------------------------------------------------ steps
    def _apply(self, step: Step) -> None:
        if isinstance(step, Send):
            self._send(step)
        elif isinstance(step, Burst):
            self._burst(step)
        elif isinstance(step, Wait):
            flight = self.flights.get(step.rid)
            if flight is not None:
                self._wait(flight)
        elif isinstance(step, Idle):
            self._wait_all()
        elif isinstance(step, Open):
            sid = self.t.client.open_session(65536, streaming=step.streaming)
            self.sessions[step.sid] = sid
            self.resolver.open(step.sid, step.streaming)
        elif isinstance(step, Turn):
            self._turn(step)
        elif isinstance(step, Close):
            if step.sid in self.sessions:
                self._close(step.sid)
        elif isinstance(step, Flush):
            self._wait_all()
            self._settle()
            self._evict_all()
            self.t.client.flush_cache(attempts=40, pause_s=0.25)
            self.book.reset()
            metrics = self.t.client.metrics()
            self.evidence.reset(self.clock.tick(), metrics)
            self._counter0 = metrics.get(CACHED_TOKENS_TOTAL, 0.0)
            self._log0 = len(self.t.log_text()) if self.t.log_text else 0

    def _base_ready(self, step: Send | Turn) -> None:
        """A follow-up or a stop taken from an output needs that request finished."""
        needs = []
        if isinstance(step, Send) and isinstance(step.base, After):
            needs.append(step.base.rid)
        if isinstance(step, Send) and step.options.stop is not None:
            needs.append(step.options.stop.rid)
        if isinstance(step, Turn) and step.parent:
            needs.append(step.parent)
        for rid in needs:
            flight = self.flights.get(rid)
            if flight is not None and not flight.done.is_set():
                self._wait(flight)
                self._collect()

    def _send(self, step: Send) -> None:
        self._base_ready(step)
        if step.gate is not None and step.gate.rid in self.flights:
            g = self.flights[step.gate.rid]
            if not g.wait_tokens(step.gate.tokens, WAIT_S):
                self.fail(Finding("hung", f"gate: {step.gate.rid} streamed no {step.gate.tokens} tokens within {WAIT_S:.0f}s"))
        ids, max_new, payload, opts = self.resolver.send(step, self.served)
        self._launch(step.rid, ids, max_new, payload, opts, stream=step.stream or step.abort_at is not None, kind="send",
                     overflow=step.overflow, abort_at=step.abort_at)

    def _burst(self, step: Burst) -> None:
        prompts, payload = self.resolver.burst(step)
        rids = tuple(step.rids())
        flight = self.deck.launch(tuple(self.resolver.server_rid(r) for r in rids), payload, stream=False)
        self.pending.append(flight)
        for rid, ids in zip(rids, prompts):
            self.flights[rid] = flight
            self.served[rid] = Served(rid, self.step_no, ids, step.max_new, {} if self.t.mixed else LOGPROB_OPTIONS, flight.sent_seq, kind="burst")
        self._note_load()

    def _turn(self, step: Turn) -> None:
        self._base_ready(step)
        sid = self.sessions.get(step.sid)
        if sid is None:
            return
        prev = self.resolver.session_in_flight(step.sid)
        if prev is not None and prev in self.flights:
            self._wait(self.flights[prev])
            self._collect()
        ids, payload, meta = self.resolver.turn(step, sid, self.served)
        self._launch(step.rid, ids, step.max_new, payload, LOGPROB_OPTIONS, stream=step.stream or step.abort_at is not None,
                     kind="turn", abort_at=step.abort_at, session=step.sid, **meta)

    def _launch(self, rid: str, ids, max_new: int, payload: dict, opts: dict, *, stream: bool, kind: str, overflow: bool = False,
                abort_at: int | None = None, session: str | None = None, **meta: Any) -> None:
        flight = self.deck.launch((self.resolver.server_rid(rid),), payload, stream=stream)
        self.pending.append(flight)
        self.flights[rid] = flight
        s = Served(rid, self.step_no, tuple(ids), max_new, opts, flight.sent_seq, kind=kind, session=session, overflow=overflow, **meta)
        self.served[rid] = s
        self._note_load()
        if abort_at is not None:
            if abort_at > 0:
                flight.wait_tokens(abort_at, WAIT_S)
            if not flight.done.is_set():
                s.abort_requested = True
                self.deck.abort(flight)
            else:
                self.stats.late_aborts.append(rid)
                self.trace.append(f"      {rid}: finished before its abort after {abort_at} tokens was sent (not played as written)")

    def _close(self, sid: str) -> None:
        in_flight = self.resolver.session_in_flight(sid)
        if in_flight is not None and in_flight in self.flights and not self.flights[in_flight].done.is_set():
            self.served[in_flight].abort_requested = True  # closing a session may abort its running turn
        try:
            self.t.client.close_session(self.sessions.pop(sid))
        except KitError as e:
            self.fail(Finding("session_refused", f"close_session {sid}: {e}"))
        self.resolver.close(sid)

    # ------------------------------------------------------------ waiting
    def _wait(self, flight: Flight) -> None:
        if not flight.done.wait(WAIT_S + 30):
            self.fail(Finding("hung", f"request {','.join(flight.rids)} did not answer within {WAIT_S + 30:.0f}s"))

    def _wait_all(self) -> None:
        for flight in list(self.pending):
            self._wait(flight)

    def _note_load(self) -> None:
        in_flight = sum(len(f.rids) for f in self.pending if not f.done.is_set())
        self.book.note_load(in_flight, len(self.sessions))

    def _collect(self) -> list[Served]:
        """Move finished flights into their Served records (in completion order)."""
        done = sorted((f for f in self.pending if f.done.is_set()), key=lambda f: f.done_seq)
        out = []
        for flight in done:
            self.pending.remove(flight)
            rids = [r for r, f in self.flights.items() if f is flight]
            for i, rid in enumerate(rids):
                s = self.served[rid]
                s.done_seq, s.http_status, s.error = flight.done_seq, flight.http_status, flight.error
                s.response = flight.responses[i] if i < len(flight.responses) else None
                self.resolver.finished(s)
                self.book.add(s)
                out.append(s)
                self._since_idle.append(s)
                self.trace.append(f"      {rid}: {len(s.input_ids)} in, {len(s.output_ids)} out, cached {s.cached_tokens}, "
                                  f"finish {s.finish_type if s.answered else 'error: ' + s.error[:80]}")
        return out

    # ------------------------------------------------------------ judging
    def _settle(self, final: bool = False) -> None:
        fresh = self._collect()
        dead = self._dead() if any(not s.answered for s in fresh) else self._exited()
        if dead:
            self.fail(*self._death(dead))
        found = self._new_violations() if fresh else []  # what SGLang's tree broke while serving these: the cause, judged before its effects
        if found:
            self.fail(*found)
        for s in fresh:
            for problem in answer_problems(s, self.t.limits):
                self.fail(problem)
        self._compare_cold([s for s in fresh if s.answered])
        ready = self.book.ready([f.sent_seq for f in self.pending])
        if fresh or any(self.evidence.stale(s.done_seq) for s in ready):  # the evidence counters, read after these answers arrived (oracle relaxations rest on them; answers collected while waiting for a follow-up's base count too)
            self.evidence.note(self.clock.tick(), self.t.client.metrics())  # reads the per-request log too
        elif self.evidence.requests is not None:  # the per-request records of everything judged below (a file read)
            self.evidence.requests.refresh()
        for s in ready:
            problem = self.book.judge(s)
            if s.answered and not s.refused_for_closed_session:
                self.stats.requests += 1
                self.stats.hits += s.cached_tokens > 0
                self.stats.hits_seen_stored += bool(s.held_seen)
                self.stats.note_hit(s)
            if problem:
                self.fail(Finding(problem.kind, f"request {s.rid}: {problem.line}", {**problem.facts, "rid": s.rid}))
        if not self.pending:
            self._idle_checks()

    def _compare_cold(self, fresh: list[Served]) -> None:
        todo = []
        for s in fresh:
            if s.refused_for_closed_session:
                continue
            served_start = s.logprob_start if s.meta.get("input_token_logprobs") else None
            if not s.output_ids and served_start is None:
                continue
            start = cold_logprob_start(len(s.input_ids), served_start)
            todo.append((s, start, served_start))
        if not todo:
            return
        top = max(2, *(int(s.options.get("top_logprobs_num") or 0) for s, _, _ in todo))
        payload = {
            "input_ids": [list(s.input_ids + s.output_ids) for s, _, _ in todo],
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": 0} for _ in todo],
            "return_logprob": True,
            "logprob_start_len": [start for _, start, _ in todo],
            "top_logprobs_num": top,
            "return_text_in_logprobs": False,
        }
        t0 = time.monotonic()
        try:
            out = self.t.cold.generate(payload, timeout=WAIT_S)
        except KitError as e:
            raise KitError(f"the cache-off twin failed a cold computation: {e}") from None
        finally:
            self.stats.cold_s += time.monotonic() - t0
        out = out if isinstance(out, list) else [out]
        for (s, start, served_start), resp in zip(todo, out):
            cold = cold_from_meta(resp.get("meta_info", {}), start)
            served = served_logprobs(s.meta, served_start)
            seen = compare_served(s.input_ids, s.output_ids, served, cold, self.t.tol,
                                  expect_logprobs=bool(s.options.get("return_logprob")) and s.finish_type != "abort")
            problems = seen.differences
            if not problems:
                self.stats.max_logprob_gap = max(self.stats.max_logprob_gap, seen.logprob_gap)
                self.stats.max_topk_kl = max([self.stats.max_topk_kl, *seen.topk_kls])
                self.stats.max_flip_margin = max(self.stats.max_flip_margin, seen.flip_margin)
            self.stats.compared_tokens += len(s.output_ids)
            if problems:
                self.fail(difference_finding(s, problems, retracted=self._retractions(s.rid), admission=self._admission(s.rid, problems[0]),
                                            session_retracted=self._session_retractions(s)))

    def _retractions(self, rid: str) -> int | None:
        """How often SGLang retracted request ``rid`` (its per-request records), None without them."""
        log = self.t.requests
        if log is None:
            return None
        log.refresh()
        return log.retracted.count(self.resolver.server_rid(rid))

    def _session_retractions(self, s: Served) -> int | None:
        """How often SGLang retracted the turns sent before ``s`` in its session (its records):
        a turn resumes from the state they left in the session's slot.  None: not a turn, or
        no records."""
        if s.session is None or self.t.requests is None:
            return None
        return sum(self._retractions(q.rid) or 0 for q in self.served.values() if q.session == s.session and q.sent_seq < s.sent_seq)

    def _admission(self, rid: str, difference: Any) -> RecordedAdmission | None:
        """The admission (per SGLang's records) that computed a request's first differing output
        (None: no position, or no records)."""
        log, position = self.t.requests, dict(difference.facts).get("position")
        if log is None or position is None:
            return None
        log.refresh()
        return log.computed_by(self.resolver.server_rid(rid), int(position))

    def _evict_all(self) -> None:
        """Evict, don't flush: ask the observe plugin for SGLang's own eviction walk over the
        whole tree (``conformance/sglang_plugins/evict_all.py``), wait for its record, fail
        when the walk left evictable state, then the idle invariant.  The walk's per-node
        frees are read like any walk's.  A tree the release cannot drive so is noted once
        (``stats.evict_all_error``); a server without the per-request file has no such plugin."""
        log = self.t.requests
        if log is None or not log.started:
            return
        token = uuid.uuid4().hex
        path = Path(evict_all.request_path(str(log.path)))
        path.write_text(token)
        deadline = time.monotonic() + EVICT_ALL_DEADLINE_S
        while token not in log.evict_alls:
            if time.monotonic() > deadline:
                path.unlink(missing_ok=True)
                self.fail(Finding("kit_error", f"evict-all: the observe plugin did not answer in {EVICT_ALL_DEADLINE_S:.0f} s "
                                               "(no evict_all record: is the server idle, its plugin loaded?)"))
            time.sleep(0.1)
            log.refresh()
        record = log.evict_alls[token]
        if record.get("error"):
            self.stats.evict_all_error = self.stats.evict_all_error or f"{record.get('tree')}: {record['error']}"
            return
        self.stats.evict_alls += 1
        left = evict_all.left_held(record)
        if left:
            kind = "leak_mamba" if "mamba_evictable_size" in left else "leak_kv"
            self.fail(Finding(kind, f"evict-all: SGLang's eviction walk over the whole {record.get('tree')} left evictable {left} "
                                    f"(asked {record.get('before')}, freed {record.get('freed')})", {"left": left, "freed": record.get("freed")}))
        self._idle_checks()

    def _idle_checks(self) -> None:
        c = self.t.client
        locked = self.resolver.session_locks()
        t0 = time.monotonic()
        probe = idle_probe(c, f"program step {self.step_no}", requests=len(self._since_idle), deadline_s=self.t.idle_deadline_s,
                           flush=False, invariant=lambda v: idle_problems(v, locked=locked))
        self.stats.idle_s += time.monotonic() - t0
        self.stats.idle_checks += 1
        if probe.problems:
            self.fail(*(pool_finding(p, f"idle invariant: {p}") for p in probe.problems[:3]))
        reported = sum(s.cached_tokens for s in self._since_idle if s.answered and not s.abort_requested)
        aborted_max = sum(len(s.input_ids) for s in self._since_idle if s.abort_requested)
        now = probe.values.get(CACHED_TOKENS_TOTAL)
        metric_delta = None if now is None else now - self._counter0
        log_delta = None
        if self.t.log_text:
            text = self.t.log_text()
            log_delta = log_cached_tokens(text[self._log0:])
            self._log0 = len(text)
        if now is not None:
            self._counter0 = now
        retracted_max = retraction_allowance([(self.resolver.server_rid(s.rid), len(s.input_ids) + s.max_new) for s in self._since_idle],
                                             self.t.requests.retracted if self.t.requests is not None else ())
        problems = counter_problems(reported, metric_delta, log_delta, aborted_max=aborted_max, retracted_max=retracted_max)
        self._since_idle = []
        self._tree_audit(probe.values)
        if problems:
            self.fail(Finding("reuse_counter_mismatch", "reuse counters: " + "; ".join(problems),
                              {"reported": reported, "metric_delta": metric_delta, "log_delta": log_delta}))

    def _tree_audit(self, values: dict[str, float]) -> None:
        """Count the tree audits SGLang ran since the last idle check, and fail on each
        violation they recorded since (``conformance/sglang_plugins/tree_audit.py``)."""
        audits = values.get(KIT_TREE_AUDITS_TOTAL)
        if audits is not None:  # a server that audits publishes the counter from its first audit on
            self.stats.tree_audits = (self.stats.tree_audits or 0) + audits - (self._audits0 or 0)
        self._audits0 = audits
        found = self._new_violations()
        if found:
            self.fail(*found)

    def _new_violations(self) -> list[Finding]:
        """The tree audit's violations recorded since the last look, as findings (at most 5)."""
        log = self.t.requests
        if log is None:
            return []
        log.refresh()
        new, self._violations0 = log.tree_violations[self._violations0:], len(log.tree_violations)
        return tree_findings(new[:5])

    # ------------------------------------------------------------ liveness / cleanup
    def _late_death(self, failure: ProgramFailure) -> list[Finding]:
        """What SGLang's own checks reported once the failed program's requests were aborted
        and the scheduler went idle (its idle leak check fires there, seconds before the
        process exits), or the exception that ended the process: the death's findings from
        the log since the program started, added after the failure's own; none when the
        failure already names a death, or within :data:`LATE_DEATH_S` SGLang's idle check
        reported nothing and the process did not exit on an exception of SGLang's."""
        if self.t.log_text is None or any(f.kind.startswith("server_died") or f.facts.get("by") == "sglang_idle_check" for f in failure.findings):
            return []
        deadline = time.monotonic() + LATE_DEATH_S
        while True:
            text = self.t.log_text()[self._log_start:]
            exited = self._exited()
            crash = last_crash(text) if exited else None
            if "memory leak detected" in text or (crash is not None and crash.in_sglang):
                return death_findings(f"after the failure, with the program's requests aborted, SGLang stopped: {exited or 'its idle check fired'}", text)
            if time.monotonic() >= deadline:
                return []
            time.sleep(0.25)

    def _dead(self) -> str | None:
        return not_serving(self.t.client, self.t.alive, self.t.log_text)

    def _exited(self) -> str | None:
        """The per-step liveness check: has the server process exited?  SGLang's ``/health``
        runs a one-token generation and answers after >= 1 s, so it is asked only at a
        program's start and when an answer came back as an error (a scheduler that hangs
        instead shows as a request that does not answer within WAIT_S)."""
        return self.t.alive() if self.t.alive else None

    def _cleanup(self) -> None:
        """After a failure: abort what runs, close sessions, so the server is usable."""
        try:
            self.t.client.request("POST", "/abort_request", json={"abort_all": True}, ok=(200, 400, 404, 422), timeout=10)
        except KitError:
            pass
        end = time.monotonic() + 60
        for flight in self.pending:
            flight.done.wait(max(0.0, end - time.monotonic()))
        for sid in list(self.sessions.values()):
            try:
                self.t.client.close_session(sid)
            except KitError:
                pass
        self.sessions.clear()


def difference_finding(s: Served, differences: list[Any], *, retracted: int | None = None, admission: RecordedAdmission | None = None,
                       session_retracted: int | None = None) -> Finding:
    """A request that differs from its cold computation (``checks.differential.Difference``,
    the first of them naming the kind): its output on a hit or a miss, output logprobs it
    asked for and did not get, its input logprobs, or a cold side that does not line up with
    the served tokens.  ``retracted``: how often SGLang retracted it (a fact an entry's
    ``where`` can read, and said in the line), None where the server records no retractions.
    ``admission``: the admission that computed the first difference
    (facts ``admission_prefix`` and ``refused_match``: the prefix its prefill started from
    and the match a refusal gave it just before, per SGLang's records), said in the line.
    ``session_retracted``: for a session's turn, how often SGLang retracted the session's
    earlier turns (fact ``session_retracted``; said in the line when any was)."""
    first = differences[0]
    kind = {"output": "answer_differs_on_hit" if s.cached_tokens > 0 else "answer_differs_on_miss",
            "logprobs_missing": "logprobs_missing", "cold_misaligned": "cold_misaligned", "input": "input_logprobs_differ"}[first.part]
    again = f", retracted {retracted}x" if retracted else ""
    if admission is not None and (retracted or admission.refused_match or admission.prefix != s.cached_tokens):
        refused = f" after a refusal that had matched {admission.refused_match}" if admission.refused_match else ""
        again += f"; computed by its admission with prefix {admission.prefix}{refused}"
    if session_retracted:
        again += f"; its session's earlier turns retracted {session_retracted}x"
    line = (f"request {s.rid} ({len(s.input_ids)} input tokens, cached_tokens {s.cached_tokens}{again}) differs from the cold computation: "
            f"{'; '.join(d.line for d in differences[:2])}")
    facts = {"rid": s.rid, "cached_tokens": s.cached_tokens, "input": len(s.input_ids), **dict(first.facts)}
    if retracted is not None:
        facts["retracted"] = retracted
    if admission is not None:
        facts |= {"admission_prefix": admission.prefix, "refused_match": admission.refused_match}
    if session_retracted is not None:
        facts["session_retracted"] = session_retracted
    return Finding(kind, line, facts)


def run_program(program: Program, target: ProgramTarget) -> RunStats:
    return ProgramRun(program, target).run()
