"""The oracle a program is judged by, after every step (pure: records in, findings out).

* **outputs**: every answered request equals a cold computation of the same full input
  (``conformance.checks.differential``), hit or not;
* **hits**: where SGLang records per node which states its tree took and freed, the hit it
  owed each request -- its longest state the tree held at the admission (``checks.held.Expected``,
  exact) -- and no less (``hit_below_held``); and ``cached_tokens`` is one the prefix oracle
  allows given what overlapped (``conformance.checks.hit_bounds``), a state the release's
  storage rule stores for sure lost only to SGLang's eviction walk;
* **answers**: ``prompt_tokens`` is the input the program meant (sessions included), a
  request that was not aborted finished by length or a stop, and a refusal is explained
  by the pool's own numbers (context length, largest input, KV pool) -- as is the service
  of a request that does not fit;
* **idle**: SGLang's idle invariant over ``/metrics`` (``checks.leaks.idle_invariant``,
  judged by the idle probe before any flush) and the server's own reuse counters
  (``sglang:cached_tokens_total``, the ``#cached-token`` of its prefill log lines) equal
  the ``cached_tokens`` it reported since the last idle moment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

from conformance.checks.leaks import idle_invariant
from conformance.checks.findings import Finding
from conformance.programs.evidence import Evidence, RequestLog, owed_hit
from conformance.sglang_contract.metric_names import CACHED_TOKENS_TOTAL, IDLE_TERMS
from conformance.checks.hit_bounds import (
    Key,
    Stores,
    StrategyGrid,
    allowed_hits,
    branch_point,
    chunked_prefill_stores,
    cut_prefill_stores,
    key_limit,
    may_have_evicted,
    observed_cut_stores,
    prefill_must_be_cut,
    prefill_never_tracked,
    prefill_stores,
    seen_cut_stores,
    trie_size,
    in_flight_boundary_finish_store,
    unprepared_boundary_finish_store,
)
from conformance.checks.held import Expected
from conformance.checks.reuse import Reuse, kv_held
from conformance.checks.strip_thinking import finish_store_of, possible_finish_stores_of, reasoned

PREFILL_LINE = re.compile(r"Prefill batch.*?#cached-token:\s*(\d+)")

#: The ways a judged hit can be admitted other than by a certain store, each resting on
#: something seen in the same run: ``concurrent`` (a request that overlapped this one may
#: have stored it), ``cut_prefill`` (SGLang's scheduler was seen cutting a prefill while
#: the storing request ran), ``streaming_session`` (a streaming session's held prefix),
#: ``abort_waiting`` (aborted before its prefill: 0), ``eviction`` (SGLang's eviction path
#: was seen running after the lost prefix was stored).  A verdict counts each.
PERMISSIONS = ("concurrent", "cut_prefill", "streaming_session", "abort_waiting", "eviction")


@dataclass
class Served:
    """One request of a program, as sent and as answered."""

    rid: str
    step: int
    input_ids: Key
    max_new: int
    options: dict[str, Any]
    sent_seq: int
    done_seq: int = 0
    kind: str = "send"  # send | burst | turn
    session: str | None = None
    in_streaming_session: bool = False
    streaming_turn: bool = False  # a streaming session's turn after its first
    prev_committed: int | None = None  # streaming turn: what the session holds
    abort_requested: bool = False
    overflow: bool = False
    response: dict[str, Any] | None = None
    error: str = ""
    http_status: int | None = None
    judged: bool = False
    #: which relaxation of the oracle admitted the hit ("" = a certain store, or SGLang's per-node
    #: records settled it; see PERMISSIONS)
    permission: str = ""
    #: the relaxation the prefix model alone needed ("" = a certain store): the count before the records settle it
    model_permission: str = ""
    #: "exact" when SGLang's per-node records gave the hit it owed, else why only the model bounds it
    expected: str = ""
    held_seen: bool | None = None  # SGLang's per-node records showed the hit's state stored before admission
    #: what the tree held for it, what the storage rule allowed, what it returned (where the owed hit was exact)
    reuse: Reuse | None = None

    @property
    def meta(self) -> dict[str, Any]:
        return (self.response or {}).get("meta_info", {}) or {}

    @property
    def output_ids(self) -> Key:
        return tuple(int(t) for t in (self.response or {}).get("output_ids") or ())

    @property
    def cached_tokens(self) -> int:
        return int(self.meta.get("cached_tokens", 0) or 0)

    @property
    def finish_type(self) -> str:
        fin = self.meta.get("finish_reason")
        return (fin or {}).get("type", "none") if isinstance(fin, dict) else str(fin)

    @property
    def answered(self) -> bool:
        return self.response is not None

    @property
    def regular(self) -> bool:
        """Finished through the path the prefix oracle predicts exactly (not aborted, not
        held by a streaming session)."""
        return self.answered and not self.abort_requested and self.finish_type in ("length", "stop") and not self.in_streaming_session

    @property
    def refused_for_closed_session(self) -> bool:
        """A turn the kit raced with closing its session, which reached SGLang's scheduler
        after the close and was refused there (``Invalid request: session id ... does not
        exist`` / ``close was requested for session``): nothing of it was served, so its
        answer (SGLang reports a placeholder prompt) is neither a prompt nor an output to judge."""
        fin = self.meta.get("finish_reason")
        message = str(fin.get("message", "")) if isinstance(fin, dict) else ""
        return (self.kind == "turn" and self.abort_requested and self.finish_type == "abort" and "session" in message
                and ("does not exist" in message or "close was requested" in message))

    @property
    def logprob_start(self) -> int | None:
        if not self.options.get("return_logprob"):
            return None
        start = self.options.get("logprob_start_len")
        return start if start is not None and start >= 0 else None


@dataclass(frozen=True)
class Limits:
    """The numbers a refusal must be explained by."""

    context_len: int
    max_input: int | None = None  # SGLang's max_req_input_len
    kv_total: float | None = None
    mamba_total: float | None = None
    #: SGLang's ``chunked_prefill_size``: a prefill batch packs requests up to this many new
    #: tokens and cuts the last one where the budget ends (None: the server never chunks)
    prefill_budget: int | None = None
    #: SGLang's ``mamba_max_states_per_path`` (None: no cap): after each insert the tree drops
    #: interior states beyond it, with no pool running short
    path_cap: int | None = None

    def fits(self, input_len: int, max_new: int) -> tuple[bool, str]:
        if input_len + max_new > self.context_len:
            return False, f"input {input_len} + max_new {max_new} > context length {self.context_len}"
        if self.max_input is not None and input_len >= self.max_input:
            return False, f"input {input_len} >= the largest input {self.max_input}"
        if self.kv_total is not None and input_len + max_new > self.kv_total:
            return False, f"input {input_len} + max_new {max_new} > KV pool {self.kv_total:g}"
        return True, f"input {input_len} + max_new {max_new} fits (context {self.context_len}, KV pool {self.kv_total})"


class HitBook:
    """What the radix tree may hold, for judging ``cached_tokens`` (reset by a flush).

    A request is judged once every request sent before its answer arrived has answered
    too (``ready``): then everything that could have stored a state before its admission
    is known.  Where a prefill checkpoint lands depends on the branch point SGLang saw at
    admission, itself a function of what was stored; the candidates are iterated to a
    fixed point over the keys of those requests.
    """

    def __init__(self, grid: StrategyGrid, limits: Limits, evidence: Evidence | None = None,
                 server_rid: Callable[[str], str] = str) -> None:
        self.grid, self.limits = grid, limits
        #: counters seen during the program (None: judge on the bounds alone, unit tests)
        self.evidence = evidence
        #: the rid SGLang knew a program's request by (the per-request evidence is keyed by it)
        self.server_rid = server_rid
        self.records: list[Served] = []
        self.max_in_flight = 0
        self.max_sessions = 0
        self.evicted = False
        self._certain: dict[str, Stores] = {}
        #: (rid, hit) -> {key: the branch point it gives or None}: judging asks again with
        #: overlapping key sets, so each key is compared once per request
        self._branch_memo: dict[tuple[str, int], dict[Key, int | None]] = {}
        self._fixed: dict[tuple[str, bool], frozenset[Key]] = {}

    def reset(self) -> None:
        self.records.clear()
        self._certain.clear()
        self._branch_memo.clear()
        self._fixed.clear()
        self.max_in_flight = self.max_sessions = 0
        self.evicted = False

    def add(self, s: Served) -> None:
        self.records.append(s)

    def note_load(self, in_flight: int, sessions: int) -> None:
        self.max_in_flight = max(self.max_in_flight, in_flight)
        self.max_sessions = max(self.max_sessions, sessions)

    def ready(self, in_flight_sent: Iterable[int]) -> list[Served]:
        """Answered, unjudged requests such that every request sent before their answer
        arrived has answered too."""
        oldest = min(in_flight_sent, default=None)
        out = [s for s in self.records if not s.judged and s.done_seq and (oldest is None or s.done_seq < oldest)]
        return sorted(out, key=lambda s: s.done_seq)

    # ------------------------------------------------------------ stores
    def _hits(self, q: Served) -> set[int]:
        return {q.cached_tokens} if q.answered else {0}

    def _alternatives(self, q: Served, keys: set[Key], cut: bool = True) -> set[Key]:
        """Every key ``q`` may have stored (prefill checkpoint and finish); ``cut``: with
        the checkpoints of a prefill SGLang may have cut."""
        if not q.answered and not q.abort_requested or q.refused_for_closed_session:
            return set()  # refused: it never ran
        alts = set(self._fixed_alternatives(q, cut))
        for h in self._hits(q):
            alts |= self._whole_prefill_stores(q, h, keys)
        return alts

    def _whole_prefill_stores(self, q: Served, hit: int, keys: set[Key]) -> set[Key]:
        """Where ``q``'s prefill checkpoint lands if SGLang ran it in one extend: nowhere
        when it cannot have (more new tokens than the prefill budget, or a budget below the
        checkpoint grid: ``hit_bounds.prefill_must_be_cut``, ``prefill_never_tracked``)."""
        budget = self.limits.prefill_budget
        if prefill_never_tracked(self.grid, budget) or prefill_must_be_cut(len(q.input_ids), hit, budget):
            return set()
        return prefill_stores(q.input_ids, {hit}, self._branches(q, hit, keys), self.grid)

    def _fixed_alternatives(self, q: Served, cut: bool = True) -> frozenset[Key]:
        """The keys of ``_alternatives`` that do not depend on what else was stored: the
        checkpoints after a cut and the finish.  Fixed once ``q`` has answered (whatever is
        sent later cannot have overlapped it), so kept from then on."""
        if (q.rid, cut) in self._fixed:
            return self._fixed[(q.rid, cut)]
        alts: set[Key] = set()
        log = self._requests()
        if cut and log is not None:
            alts |= observed_cut_stores(q.input_ids, log.chunks(self.server_rid(q.rid)), self.grid)
        elif cut and self._could_be_cut(q):
            for h in self._hits(q):
                alts |= cut_prefill_stores(q.input_ids, h, self.grid, budget=self.limits.prefill_budget)
        kept = ahead = None
        if q.regular:
            if (mixed := self._untracked(q)) and (without := finish_store_of(q.input_ids, q.output_ids, self.grid, q.options, mixed)):
                alts.add(without)  # a release that keeps no boundary of a mixed step inserts the one before
            key = finish_store_of(q.input_ids, q.output_ids, self.grid, q.options)
            if key:
                alts.add(key)
            elif log is not None and (kept := unprepared_boundary_finish_store(q.input_ids, q.output_ids, self.grid)) is not None:
                if log.state_stored(kept):  # seen: SGLang did not prepare the boundary step after the finish
                    alts.add(kept)
            if log is not None and not reasoned(q.options) and (
                    ahead := in_flight_boundary_finish_store(q.input_ids, q.output_ids, self.grid)) is not None:
                if log.state_stored(ahead):  # seen: the step in flight at the finish tracked the boundary state
                    alts.add(ahead)
        else:
            alts |= possible_finish_stores_of(q.input_ids, q.output_ids, self.grid, q.options)
        out = frozenset(alts)
        if q.done_seq and (log is None or not self._prefill_unseen(q, log)) and all(k is None or k in alts for k in (kept, ahead)):
            self._fixed[(q.rid, cut)] = out
        return out

    def _prefill_unseen(self, q: Served, log: RequestLog) -> bool:
        """Has ``q`` answered with output while the log read so far lacks the end of its
        prefill (no chunk, or the last one cut)?  SGLang writes each prefill's record before
        it runs, so the next read has it: nothing is fixed from a partial read."""
        chunks = log.chunks(self.server_rid(q.rid))
        return bool(q.answered and q.output_ids) and (not chunks or chunks[-1].cut)

    def _branches(self, q: Served, hit: int, keys: set[Key]) -> set[int | None]:
        """``q``'s branch points against ``keys`` (and None): each key compared once per book."""
        memo = self._branch_memo.setdefault((q.rid, hit), {})
        for k in keys:
            if k not in memo:
                memo[k] = branch_point(q.input_ids, k, self.grid, hit, q.logprob_start)
        return {None} | {memo[k] for k in keys}

    def _overlap_tokens(self, q: Served) -> int:
        """Input tokens of the other requests in flight at some moment while ``q`` was."""
        end = q.done_seq or float("inf")
        return sum(len(x.input_ids) for x in self.records if x is not q and x.sent_seq < end and (not x.done_seq or x.done_seq > q.sent_seq))

    def _cut_alone(self, q: Served, keys: set[Key]) -> bool:
        """``q``'s prefill was cut at every budget's worth of new tokens where the oracle
        knows the cuts: nothing else was in flight, and it met no branch point."""
        return (prefill_must_be_cut(len(q.input_ids), q.cached_tokens, self.limits.prefill_budget) and not self._overlap_tokens(q)
                and self._branches(q, q.cached_tokens, keys) == {None})

    def _untracked(self, q: Served) -> frozenset[int]:
        """Lengths ``q``'s decode steps reached riding a mixed prefill's forward (SGLang's
        records), where no decode boundary is tracked: a boundary among them is not owed."""
        log = self._requests()
        return log.untracked_decodes(self.server_rid(q.rid)) if log is not None else frozenset()

    def _requests(self) -> RequestLog | None:
        """The per-request evidence, when the server writes it (real SGLang)."""
        return self.evidence.requests if self.evidence is not None else None

    def _lazy_drop(self, q: Served) -> bool:
        """May ``q``'s kept prefill checkpoint be gone at its finish?  With per-request
        evidence only when SGLang was seen dropping it; else the bound."""
        log = self._requests()
        if log is not None:
            return self.grid.lazy_alloc_fail and log.dropped(self.server_rid(q.rid))
        return lazy_checkpoint_may_drop(q, self.grid)

    def _could_be_cut(self, q: Served) -> bool:
        """Could SGLang have cut ``q``'s prefill at a point of its own choosing?  It packs the
        waiting requests into one prefill batch up to ``chunked_prefill_size`` new tokens and
        cuts the last one where the budget ends; the cut part is cached with its state (a
        hit there was seen on a clean SGLang: 40 requests of 386 tokens, 11 in the first
        batch, the 11th cut at 236 and cached at 192; without a buffer, 12 requests of 320
        and the 13th cut and cached at 256).  That needs the requests that
        overlapped ``q`` to bring more new tokens than the budget, and -- evidence, not
        permission -- SGLang's scheduler to have cut a prefill while ``q`` was in flight
        (its ``prefill_cuts`` counter grew; where it is not exported the bound alone).  With
        per-request evidence: SGLang cut exactly this request's prefill."""
        log = self._requests()
        if log is not None:
            return log.cut(self.server_rid(q.rid))
        budget = self.limits.prefill_budget
        if not budget:
            return False
        if any(prefill_must_be_cut(len(q.input_ids), h, budget) for h in self._hits(q)):
            return True  # alone past the budget: SGLang's PrefillAdder cuts it, whatever ran beside it
        if len(q.input_ids) + self._overlap_tokens(q) <= budget:
            return False
        seen = self.evidence.grew("prefill_cuts", q.sent_seq, q.done_seq or 10**18) if self.evidence else None
        return seen is not False

    def _keys(self, group: list[Served], cut: bool = True) -> set[Key]:
        """The keys ``group`` may have stored, branch points iterated to a fixed point."""
        keys: set[Key] = set()
        for _ in range(4):
            new = set().union(*(self._alternatives(q, keys, cut) for q in group)) if group else set()
            if new <= keys:
                break
            keys |= new
        return keys

    def _certain_stores(self, q: Served) -> Stores:
        """What ``q`` stored for sure: a regular finish, and its prefill checkpoint when the
        branch points it could have met all put it in one place."""
        if q.rid in self._certain:
            return self._certain[q.rid]
        out = Stores()
        if q.regular:
            before = [x for x in self.records if x is not q and x.done_seq and x.sent_seq < q.done_seq]
            keys = self._keys(before)
            prefill = self._whole_prefill_stores(q, q.cached_tokens, keys)
            if len(prefill) == 1 and not self._could_be_cut(q) and not self._lazy_drop(q):
                out.add(next(iter(prefill)), sure=True)
            elif self._cut_alone(q, keys) and not self._lazy_drop(q):
                for key in chunked_prefill_stores(q.input_ids, q.cached_tokens, self.grid, self.limits.prefill_budget or 0):
                    out.add(key, sure=True)
            elif (log := self._requests()) is not None and not self._lazy_drop(q):
                chunks = log.chunks(self.server_rid(q.rid))
                for key in seen_cut_stores(q.input_ids, chunks, self.grid, self._branches(q, q.cached_tokens, keys)):
                    out.add(key, sure=True)
            out.add(finish_store_of(q.input_ids, q.output_ids, self.grid, q.options, self._untracked(q)), sure=True)
        self._certain[q.rid] = out
        return out

    def _update_evicted(self) -> None:
        if self.evicted:
            return
        done = [q for q in self.records if q.done_seq]
        seqs = [q.input_ids + q.output_ids for q in done if q.answered or q.abort_requested]
        reserved = self.max_in_flight * max((len(q.input_ids) + q.max_new for q in done if not q.overflow), default=0)
        self.evicted = may_have_evicted(
            states=len(self._keys(done)), max_in_flight=self.max_in_flight, sessions=self.max_sessions, strategy=self.grid.strategy,
            mamba_total=self.limits.mamba_total, tokens=trie_size(seqs), reserved_tokens=reserved, kv_total=self.limits.kv_total,
        )

    # ------------------------------------------------------------ judging
    def judge(self, r: Served) -> Finding | None:
        """Judge ``r``'s hit; a finding or None (then ``r.permission`` says what admitted it,
        ``r.expected`` whether the hit SGLang owed was exact)."""
        r.judged = True
        if not answered_by_sglang(r):
            return None  # never ran: SGLang's placeholder answer says nothing about the tree
        owed = self._expected(r)
        r.expected = "exact" if owed.exact else owed.why
        r.reuse = self._reuse(r, owed.owed) if owed.exact else None
        return self._below_held(r, owed) or self._judge_hit(r, owed) or self._unheld_hit(r)

    def _reuse(self, r: Served, owed: int) -> Reuse:
        """Reported, not judged (``checks.reuse``): the KV tokens the tree held for ``r``'s
        prompt -- the prompt + output of each request answered before ``r`` was sent -- against
        the hit the storage rule allowed (``owed``) and the one SGLang returned."""
        inserted = [(q.rid, q.input_ids if reasoned(q.options) else q.input_ids + q.output_ids[:-1])
                    for q in self.records if q is not r and q.regular and q.done_seq and q.done_seq < r.sent_seq]
        kv, source = kv_held(r.input_ids, inserted, self.grid.page_size)
        log = self._requests()
        at_most = source is not None and log is not None and log.evicted_between([self.server_rid(source)], self.server_rid(r.rid))
        return Reuse(kv, owed, r.cached_tokens, at_most)

    def _expected(self, r: Served) -> Expected:
        """The hit SGLang owed ``r``, from its per-node records: the longest state of a prefix
        of ``r``'s input (within the match limit) its tree took before ``r``'s admission and did
        not free since.  Bounded (``why``) where the records cannot say it."""
        if r.in_streaming_session or r.kind == "turn":
            return Expected(False, why="a session's turn (the session may hold its prefix)")
        return owed_hit(self._requests(), r.input_ids, key_limit(len(r.input_ids), self.grid.page_size, r.logprob_start), self.server_rid(r.rid))

    def _below_held(self, r: Served, owed: Expected) -> Finding | None:
        """A hit below what SGLang's tree held: a state of a longer prefix taken before the
        admission and not freed since, or freed by something other than SGLang's eviction walk
        (with a per-path cap also an insert).  Settled by the records, never by a permission."""
        return owed.finding(r.cached_tokens, len(r.input_ids), path_cap=self.limits.path_cap is not None)

    def _unheld_hit(self, r: Served) -> Finding | None:
        """SGLang's own records against its answer: a hit of ``k`` tokens is a node of its
        tree holding a mamba state for exactly those ``k`` tokens, so the tree must have been
        seen taking one (``state_stored``) before ``r`` was admitted -- whatever the model
        allowed (a concurrent store, a cut).  A streaming session's turn is exempt (its
        prefix is held by the session, not the tree); so is a server without per-node
        records.  ``r.held_seen`` says whether the records vouched for the hit."""
        log = self._requests()
        if log is None or r.cached_tokens <= 0 or r.streaming_turn:
            return None
        key = tuple(r.input_ids[: r.cached_tokens])
        r.held_seen = log.stored_before_admission(key, self.server_rid(r.rid))
        if r.held_seen is False:
            return Finding("hit_above_stored", f"cached_tokens {r.cached_tokens}, but SGLang's tree took no mamba state for those "
                           f"{r.cached_tokens} tokens before it admitted the request (per-node state_stored records)",
                           {"cached_tokens": r.cached_tokens, "input": len(r.input_ids)})
        return None

    def _judge_hit(self, r: Served, owed: Expected | None = None) -> Finding | None:
        """The prefix model's verdict on ``r``'s hit (``judge``); where the records gave the
        hit SGLang owed and ``r`` got it, they settle what the model could only permit
        (``r.model_permission`` keeps what it needed)."""
        problem = self._model_hit(r)
        r.model_permission = r.permission
        if problem is None and owed is not None and owed.exact and r.cached_tokens == owed.owed and r.permission != "eviction":
            r.permission = ""
        return problem

    def _bounds(self, r: Served) -> tuple[list[Served], set[Key], list[tuple[Served, set[Key]]], set[Key], int]:
        """What ``r``'s hit is judged against: the requests that may have stored before it
        answered, the keys stored for sure before it was sent (and by whom), the others they
        may have stored, and SGLang's match limit."""
        self._update_evicted()
        universe = [q for q in self.records if q is not r and q.done_seq and q.sent_seq < r.done_seq]
        certain: set[Key] = set()
        stored_by: list[tuple[Served, set[Key]]] = []
        for q in universe:
            if q.done_seq < r.sent_seq:
                mine = self._certain_stores(q).certain
                certain |= mine
                stored_by.append((q, mine))
        return universe, certain, stored_by, self._keys(universe) - certain, key_limit(len(r.input_ids), self.grid.page_size, r.logprob_start)

    def allowed(self, r: Served) -> set[int]:
        """The hits the prefix model allows ``r`` before any relaxation (the first thing ``judge`` asks)."""
        _, certain, _, maybe, limit = self._bounds(r)
        return allowed_hits(r.input_ids, certain, maybe, limit=limit, evicted=False)

    def _model_hit(self, r: Served) -> Finding | None:
        """The prefix model alone: ``cached_tokens`` within what may have been stored."""
        universe, certain, stored_by, maybe, limit = self._bounds(r)
        hit = r.cached_tokens
        allowed = allowed_hits(r.input_ids, certain, maybe, limit=limit, evicted=False)
        if hit in allowed:
            r.permission = self._admitted_by(r, hit, certain, universe, limit)
            return None
        if r.streaming_turn and r.prev_committed is not None:
            # Under overlap (lookahead 1) the previous turn's last output token may already have
            # run in the step in flight when it finished: 0.5.20 keeps that token in the session
            # (t2 5 in + 3 out, next turn cached 8, its tokens the cold argmax), 0.5.23 re-extends it
            # (cached 7); the cold comparison judges the answer either way.
            top = max(len(r.input_ids) - 1, 0)
            ends = {min(r.prev_committed + extra, top) for extra in range(self.grid.lookahead + 1)}
            held = ends | {c // self.grid.page_size * self.grid.page_size for c in ends}
            allowed |= held
            if hit in held:
                r.permission = "streaming_session"
                return None
        if r.abort_requested and r.finish_type == "abort" and not r.output_ids:
            allowed.add(0)  # aborted while waiting: SGLang counts cached_tokens only when it prepares the extend
            if hit == 0:
                r.permission = "abort_waiting"
                return None
        seen = self._eviction_seen(r, hit, stored_by, limit)
        if seen.evicted:
            allowed |= allowed_hits(r.input_ids, certain, maybe, limit=limit, evicted=True)
            if hit in allowed:
                r.permission = "eviction"
                return None
        kind = "hit_above_allowed" if hit > max(allowed, default=0) else seen.kind
        return Finding(kind, f"cached_tokens {hit}, the prefix oracle allows {sorted(allowed)} (input {len(r.input_ids)} tokens; {seen.why})",
                       {"cached_tokens": hit, "input": len(r.input_ids), "allowed": sorted(allowed)})

    def _admitted_by(self, r: Served, hit: int, certain: set[Key], universe: list[Served], limit: int) -> str:
        """"" when a certain store explains ``hit``, else the relaxation that does."""
        t = tuple(r.input_ids)
        if hit == max((len(k) for k in certain if len(k) <= limit and t[: len(k)] == k), default=0):
            return ""
        if not any(self._could_be_cut(q) for q in universe):
            return "concurrent"
        plain = self._keys(universe, cut=False) - certain
        return "concurrent" if hit in allowed_hits(r.input_ids, certain, plain, limit=limit, evicted=False) else "cut_prefill"

    def _eviction_seen(self, r: Served, hit: int, stored_by: list[tuple[Served, set[Key]]], limit: int) -> Seen:
        """May a certain store longer than ``hit`` be gone at ``r``'s admission?  Only when
        the pools could have had to evict (the bound) and -- evidence, not permission --
        SGLang's eviction counter grew after the last request that stored such a prefix
        and before ``r`` answered, or (per-request evidence: a burst member answers only when
        the whole burst has) SGLang's eviction walk ran after the storers' prefills and
        before ``r``'s.  With a per-path cap SGLang drops states on insert, pools full or
        not: then, where the pools never had to evict, only SGLang's per-node record of that
        very state freed is evidence.  Where SGLang records per node, its records of those very
        states answer before any bound.  What was seen names the finding's kind when not."""
        capped = self.limits.path_cap is not None
        t = tuple(r.input_ids)
        owed = [(q, k) for q, keys in stored_by for k in keys if hit < len(k) <= limit and t[: len(k)] == k]
        storers = list({id(q): q for q, _ in owed}.values())
        if not self.evicted and not capped:
            never = self._never_stored(r, owed)  # what SGLang's records say names the finding
            return Seen(False, never, "state_not_stored") if never else Seen(False, "the pools never had to evict")
        if self.evidence is None and self.evicted:
            return Seen(True, "after possible evictions")
        per_node = self._state_evicted(r, owed)
        if per_node is not None:
            return per_node
        if not self.evicted:
            return Seen(False, f"the pools never had to evict, and no per-node record shows the per-path cap "
                               f"({self.limits.path_cap}) freeing the state")
        seen = self.evidence.grew("evictions", max((q.done_seq for q in storers), default=0), r.done_seq)
        if seen is None:
            return Seen(True, "after possible evictions (no eviction counter)")
        if seen:
            return Seen(True, "after evictions SGLang counted")
        log = self._requests()
        if storers and log is not None and log.evicted_between([self.server_rid(q.rid) for q in storers], self.server_rid(r.rid)):
            return Seen(True, "after evictions SGLang ran between the storing prefill and this one's")
        return Seen(False, "SGLang's eviction counter did not move since the prefix was stored")

    def _state_evicted(self, r: Served, owed: list[tuple[Served, Key]]) -> Seen | None:
        """Per node, where SGLang records which tree states it freed and by what: a certain
        store (``owed``: its storer and key, longer than the hit) may be gone only when SGLang's
        eviction walk (with a per-path cap, also an insert) freed exactly that state after its
        storer's prefill and before ``r``'s; when every such state was answered for and none was
        freed so, SGLang's tree still held them (a stored prefix not reused); when one was never
        taken before ``r`` was admitted, SGLang lost it (an eviction cannot explain it).  None:
        some state without a per-node answer (judge on the counters and walks)."""
        log = self._requests()
        if log is None or not log.per_node:
            return None
        rid = self.server_rid(r.rid)
        by = ("walk", "insert") if self.limits.path_cap is not None else ("walk",)
        answers = [(len(k), log.state_evicted_between(k, [self.server_rid(q.rid)], rid, by=by)) for q, k in owed]
        if any(a for _, a in answers):
            return Seen(True, "after SGLang's eviction freed the state stored for that prefix")
        never = self._never_stored(r, [o for o, (_, a) in zip(owed, answers) if a is None])
        if never:  # no eviction can have freed a state the tree never held: the checkpoint was lost
            return Seen(False, never, "state_not_stored")
        if not answers or any(a is None for _, a in answers):
            return None
        return Seen(False, f"SGLang's tree still held the state stored for the prefix of {max(n for n, _ in answers)} tokens "
                           "(no eviction step freed it)", "hit_below_held")


    def _never_stored(self, r: Served, owed: list[tuple[Served, Key]]) -> str:
        """Per node: the longest certain store SGLang's tree never took before ``r``'s
        admission, in words ("" when none, or no per-node records)."""
        log = self._requests()
        if log is None or not log.per_node:
            return ""
        rid = self.server_rid(r.rid)
        never = [len(k) for _, k in owed if log.stored_before_admission(k, rid) is False]
        return (f"SGLang's tree never took the state for the prefix of {max(never)} tokens before it admitted this request "
                "(per-node records)") if never else ""


@dataclass(frozen=True)
class Seen:
    """What the oracle saw of evictions for a hit below a certain store: whether it may have
    been evicted, the words for the finding, and the finding's kind when it may not."""

    evicted: bool
    why: str
    kind: str = "hit_below_certain"


def answered_by_sglang(r: Served) -> bool:
    """Did SGLang run ``r`` (not a placeholder answer for a turn refused after its session closed)?"""
    return r.answered and not r.refused_for_closed_session


def lazy_checkpoint_may_drop(q: Served, grid: StrategyGrid) -> bool:
    """With every lazy boundary allocation failing, SGLang invalidates a request's kept
    checkpoint when its decode reaches a track boundary (``mamba_lazy_prealloc_at_boundary``:
    "the in-flight write invalidates the keep slot's old checkpoint"), unless the overlap
    scheduler skipped that step -- so the prefill checkpoint of such a request may be gone
    at its finish (seen on a clean SGLang: a follow-up of a 255 + 519-token request hit 0)."""
    if not grid.lazy_alloc_fail:
        return False
    start, end = len(q.input_ids), len(q.input_ids) + len(q.output_ids)
    return any(m % grid.track_grid == 0 for m in range(start, end + 1))


def answer_problems(s: Served, limits: Limits) -> list[Finding]:
    """The answer's shape: refusal explained, prompt as meant, finish as expected."""
    fits, why = limits.fits(len(s.input_ids), s.max_new)
    facts = {"input": len(s.input_ids), "max_new": s.max_new}
    if not s.answered or s.finish_type == "abort" and not s.abort_requested:
        reason = s.error or str(s.meta.get("finish_reason"))
        if s.abort_requested and not s.error.startswith(("no answer", "ConnectError", "RemoteProtocol")):
            return []
        if fits:
            return [Finding("refused_fits", f"request {s.rid}: refused although it fits ({why}): {reason[:200]}", facts)]
        return []
    if s.refused_for_closed_session:
        return []
    problems = []
    if not fits:
        problems.append(Finding("served_unfit", f"request {s.rid}: served a request that does not fit ({why})", facts))
    prompt = s.meta.get("prompt_tokens")
    if prompt is not None and int(prompt) != len(s.input_ids):
        problems.append(Finding("prompt_mismatch", f"request {s.rid}: prompt_tokens {prompt}, the program's input has {len(s.input_ids)} tokens",
                                {**facts, "prompt_tokens": int(prompt)}))
    n = len(s.output_ids)
    if s.finish_type == "length" and n != s.max_new:
        problems.append(Finding("finish_wrong", f"request {s.rid}: finished by length after {n} tokens, max_new_tokens {s.max_new}", facts))
    if s.finish_type not in ("length", "stop", "abort"):
        problems.append(Finding("finish_wrong", f"request {s.rid}: unexpected finish reason {s.meta.get('finish_reason')!r}", facts))
    if n > s.max_new:
        problems.append(Finding("finish_wrong", f"request {s.rid}: {n} output tokens > max_new_tokens {s.max_new}", facts))
    return problems


def idle_problems(values: Mapping[str, float], *, locked: Mapping[str, float]) -> list[str]:
    """SGLang's idle invariant (``checks.leaks.idle_invariant``), except that an open
    streaming session keeps its prefix locked in the tree: up to ``locked[pool]`` protected
    is then expected, not a lock leak."""
    out = []
    for p in idle_invariant(values):
        pool = p.split(":", 1)[0]
        if "protected (locked) at idle" in p or "counted twice" in p:
            terms = IDLE_TERMS[pool]
            protected = values.get(terms.protected, 0.0)
            held = values.get(terms.session_held, 0.0)
            used = values.get(terms.used, 0.0)
            if protected <= locked.get(pool, 0.0) and used - protected - held >= 0:
                continue
            if protected > locked.get(pool, 0.0):
                p = f"{pool}: {protected:g} protected (locked) at idle, open streaming sessions lock at most {locked.get(pool, 0.0):g}: a lock was not released"
        out.append(p)
    return out


def counter_problems(reported: int, metric_delta: float | None, log_delta: int | None, *, aborted_max: int = 0,
                     retracted_max: int = 0) -> list[str]:
    """The server's own reuse counters against the ``cached_tokens`` it reported.

    ``reported`` sums the requests that were not aborted; an aborted request's reuse is
    counted (or not) by when it stopped, so up to ``aborted_max`` more (the aborted
    requests' inputs) is allowed -- a window holding an abort is bounded, not unchecked.
    A retracted request prefilled again from its own cached prefix is counted by the prefill
    log lines but not by its answer or the counter (SGLang computes ``cached_tokens`` once: "Once
    retracted, the 'retracted_stain' flag will always True", schedule_batch.py), so the log
    may count up to ``retracted_max`` more (:func:`retraction_allowance`: each retraction's
    prefill again, up to the request's input and decodes)."""
    out = []
    span = f"{reported}" if not aborted_max else f"{reported}..{reported + aborted_max} (aborted requests may count up to {aborted_max})"

    def off(value: float, extra: int = 0) -> bool:
        return not reported <= value <= reported + aborted_max + extra

    if metric_delta is not None and off(metric_delta):
        out.append(f"{CACHED_TOKENS_TOTAL} grew by {metric_delta:g}, the answers reported {span} cached tokens")
    if log_delta is not None and off(log_delta, retracted_max):
        again = f" (retracted requests' second prefills may count up to {retracted_max} more)" if retracted_max else ""
        out.append(f"the server's prefill log lines count {log_delta} cached tokens, the answers reported {span}{again}")
    return out


def retraction_allowance(requests: Sequence[tuple[str, int]], retracted: Sequence[str]) -> int:
    """How many more cached tokens the prefill log may count than the answers: each time
    SGLang retracted a request (``retracted`` names it once per retraction, from its own
    ``retract_decode``), its next prefill may hit up to the request's whole length so far
    (``requests``: server rid, input + max new tokens)."""
    times = Counter(retracted)
    return sum(length * times[rid] for rid, length in requests)


def log_cached_tokens(text: str) -> int:
    return sum(int(m.group(1)) for m in PREFILL_LINE.finditer(text))
