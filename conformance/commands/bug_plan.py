"""A known bug's program file resolved into the plan a bug folder's standalone script plays
(``conformance/commands/repro_player.py``).

The kit's own :class:`~conformance.programs.resolve.Resolver` resolves every step, as the
runner does at play time, against a simulated run in which each answer is as long as it
asked (``ignore_eos``; an abort after ``abort_at`` tokens).  What depends on the server's
answers stays symbolic: an output token is a placeholder id that the plan writes as a slice
``{"output_of": rid, "start", "end"}`` of that answer, and rids and session ids are
``{tag}`` / ``{session:ID}`` templates.  The prefix oracle
(:class:`~conformance.programs.oracle.HitBook`) predicts ``cached_tokens`` for the requests
it can judge without the server's per-request evidence: sent with nothing else in flight,
after plain sends only (no burst, session, abort or gate before them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from conformance.checks.differential import Tolerance
from conformance.checks.hit_bounds import StrategyGrid
from conformance.client import GAUGE_STANDINS
from conformance.errors import KitError
from conformance.matrix import axes
from conformance.matrix.cells import DEFAULT_TARGET, Cell
from conformance.programs.bind import path_cap
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.programs.program import After, Burst, Close, Flush, Idle, Open, Program, Send, Turn, Wait
from conformance.programs.resolve import Resolver
from conformance.sglang_contract.metric_names import IDLE_TERMS
from conformance.targets.registry import target_for

#: Placeholder ids for output tokens: ``PLACEHOLDER + (request number << 20) + position``.
PLACEHOLDER = 1 << 40
TAG = "{tag}"


def session_ref(sid: str) -> str:
    return "{session:" + sid + "}"


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


@dataclass
class _Simulation:
    """The simulated run the resolver and the prefix oracle see."""

    program: Program
    cell: Cell
    argv: list[str]
    exact: bool
    served: dict[str, Served] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # rids by request number
    pending: set[str] = field(default_factory=set)
    plain: bool = True  # only plain sends so far: the oracle's hit is a prediction
    last_turn: dict[str, str] = field(default_factory=dict)
    seq: int = 0

    def __post_init__(self) -> None:
        info = {"disable_overlap_schedule": "--disable-overlap-schedule" in self.argv}
        g = self.cell.grid
        self.grid = StrategyGrid(g.chunk, g.page_size, g.track_interval, strategy=self.cell.strategy,
                                 lazy_alloc_fail=self.cell.fault.name == "lazy_alloc_fail",
                                 lookahead=target_for(DEFAULT_TARGET).engine.lookahead(self.cell, info))
        budget = int(_flag(self.argv, "--chunked-prefill-size") or 0)
        self.limits = Limits(context_len=int(_flag(self.argv, "--context-length") or 4096),
                             prefill_budget=budget if budget > 0 else None, path_cap=path_cap({}, self.cell))
        self.resolver = Resolver(self.program, self.grid, self.limits, exact=self.exact, tag=TAG,
                                 mixed=axes.enabled(self.cell, axes.MIXED_BATCHES))
        self.book = HitBook(self.grid, self.limits)

    # ------------------------------------------------------------ tokens
    def segments(self, ids: tuple[int, ...]) -> list[Any]:
        """Literal runs as lists, placeholder runs as slices of an earlier answer's output."""
        out: list[Any] = []
        for t in ids:
            if t < PLACEHOLDER:
                if not out or not isinstance(out[-1], list):
                    out.append([])
                out[-1].append(int(t))
                continue
            rid, pos = self.order[(t - PLACEHOLDER) >> 20], (t - PLACEHOLDER) & 0xFFFFF
            last = out[-1] if out else None
            if isinstance(last, dict) and last["output_of"] == rid and last["end"] == pos:
                last["end"] = pos + 1
            else:
                out.append({"output_of": rid, "start": pos, "end": pos + 1})
        return out

    def answered(self, s: Served, n_out: int, *, aborted: bool) -> None:
        """``s`` as the simulated server answers it: ``n_out`` placeholder tokens, the hit the
        oracle allows first (the one its certain stores give)."""
        number = len(self.order)
        self.order.append(s.rid)
        s.sent_seq, s.done_seq = self.seq + 1, self.seq + 2
        self.seq += 2
        hits = self.book.allowed(s)
        s.response = {"output_ids": [PLACEHOLDER + (number << 20) + i for i in range(n_out)],
                      "meta_info": {"cached_tokens": min(hits), "finish_reason": {"type": "abort" if aborted else "length"}}}
        s.abort_requested = aborted
        self.book.add(s)
        self.served[s.rid] = s
        self.resolver.finished(s)

    def quiet_hits(self, s: Served) -> list[int] | None:
        """The hits the oracle allows ``s`` when it can predict them (else None)."""
        return sorted(self.book.allowed(s)) if self.plain and not self.pending else None

    # ------------------------------------------------------------ steps
    def send(self, i: int, step: Send) -> dict[str, Any]:
        needs = [r for r in (step.base.rid if isinstance(step.base, After) else None, step.options.stop.rid if step.options.stop else None) if r]
        self.pending -= set(needs)
        ids, max_new, payload, opts = self.resolver.send(step, self.served)
        _literal(payload, "input_ids")
        aborted = step.abort_at is not None
        s = Served(step.rid, i, tuple(ids), max_new, opts, 0)
        hit = None
        if not (aborted or step.gate or step.overflow or step.options.stop):
            s.sent_seq, s.done_seq = self.seq + 1, self.seq + 2
            hit = self.quiet_hits(s)
        self.plain = self.plain and hit is not None
        self.answered(s, min(step.abort_at or max_new, max_new), aborted=aborted)
        self.pending.add(step.rid)
        return {"op": "send", "rid": step.rid, "input": self.segments(ids), "needs": needs, "max_new": max_new,
                "payload": {k: v for k, v in payload.items() if k != "input_ids"}, "stream": step.stream or aborted,
                "abort_at": step.abort_at, "gate": dataclasses.asdict(step.gate) if step.gate else None, "hit": hit}

    def burst(self, step: Burst) -> dict[str, Any]:
        prompts, payload = self.resolver.burst(step)
        for j, rid in enumerate(step.rids()):
            self.answered(Served(rid, 0, prompts[j], step.max_new, {}, 0, kind="burst"), step.max_new, aborted=False)
        self.plain = False
        self.pending |= set(step.rids())
        return {"op": "burst", "rids": step.rids(), "inputs": [list(p) for p in prompts], "payload": payload}

    def turn(self, step: Turn) -> dict[str, Any]:
        needs = list(dict.fromkeys(r for r in (self.last_turn.get(step.sid), step.parent) if r))
        self.pending -= set(needs)
        ids, payload, meta = self.resolver.turn(step, session_ref(step.sid), self.served)
        _literal(payload, "session_params")
        aborted = step.abort_at is not None
        self.answered(Served(step.rid, 0, tuple(ids), step.max_new, {}, 0, kind="turn", session=step.sid, **meta),
                      min(step.abort_at or step.max_new, step.max_new), aborted=aborted)
        self.plain = False
        self.pending.add(step.rid)
        self.last_turn[step.sid] = step.rid
        return {"op": "turn", "sid": step.sid, "rid": step.rid, "input": self.segments(ids), "needs": needs, "payload": payload,
                "stream": step.stream or aborted, "abort_at": step.abort_at}

    def step(self, i: int, step: Any) -> dict[str, Any]:
        if isinstance(step, Send):
            out = self.send(i, step)
        elif isinstance(step, Burst):
            out = self.burst(step)
        elif isinstance(step, Turn):
            out = self.turn(step)
        elif isinstance(step, Wait):
            self.pending.discard(step.rid)
            out = {"op": "wait", "rid": step.rid}
        elif isinstance(step, (Idle, Flush)):
            self.pending.clear()
            if isinstance(step, Flush):
                self.book.reset()
            out = {"op": step.op}
        elif isinstance(step, Open):
            self.resolver.open(step.sid, step.streaming)
            out = {"op": "open", "sid": step.sid, "streaming": step.streaming}
        elif isinstance(step, Close):
            self.resolver.close(step.sid)
            out = {"op": "close", "sid": step.sid}
        else:  # pragma: no cover - program.STEP_TYPES holds no other
            raise KitError(f"report-bug: step {i}: unknown op {step.op!r}")
        return {**out, "at": i}


def _literal(payload: dict[str, Any], *keys: str) -> None:
    """A value taken from an answer other than the input itself (a stop token) cannot be
    resolved before the script runs: say so instead of sending a placeholder."""
    rest = {k: v for k, v in payload.items() if k not in ("input_ids", *keys)}
    if any(isinstance(v, int) and v >= PLACEHOLDER for v in _ints(rest)):
        raise KitError("report-bug: the program takes a value from an earlier answer (a stop condition); the standalone script cannot replay it")


def _ints(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _ints(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _ints(v)]
    return [value]


def tolerance(exact: bool) -> dict[str, float | None]:
    """The differential oracle's tolerance of this mode (``None``: not compared)."""
    tol = dataclasses.asdict(Tolerance.for_mode(exact))
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in tol.items() if k in ("tie_eps", "logprob_atol")}


def plan_for(program: Program, cell: Cell, argv: list[str], *, exact: bool, title: str) -> dict[str, Any]:
    """The plan of ``program`` on ``cell``'s server started with ``argv`` (JSON-ready)."""
    sim = _Simulation(program, cell, list(argv), exact)
    steps = [sim.step(i, s) for i, s in enumerate(program.steps)]
    return {
        "title": title,
        "cell": cell.id,
        "tolerance": tolerance(exact),
        "idle": {"deadline_s": target_for(DEFAULT_TARGET).engine.idle_deadline_s,
                 "pools": {pool: dataclasses.asdict(terms) for pool, terms in IDLE_TERMS.items()},
                 "standins": dict(GAUGE_STANDINS)},
        "steps": steps,
    }
