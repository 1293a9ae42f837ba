"""Deterministic pool scenarios (the seed PRs' situations) and the state-machine runner.

Each scenario takes a fresh :class:`PoolHarness`, drives it, checks every invariant
after every operation and compares each arrival's hit with the prefix oracle; it raises
(``PoolInvariantError``, ``StateMismatch``, ``OracleMismatch``) on the first violation.

* ``branch_at_chunk_boundary``: branches exactly at a checkpoint boundary, one token
  before and one after it, then a request hitting the branch point.
* ``session_reuse`` (buffered strategies): a finished request's ``Req`` object is
  re-admitted with its output and a new turn appended, so any stale slot reference left
  on it after the tree took ownership (PR 26941's class) makes the next allocation skip.
  Not run for no_buffer: 0.5.23 leaves ``req.kv.mamba_pool_idx`` naming the donated slot
  after a no_buffer finish (harmless only while finished Reqs are never reused).
* ``lazy_boundary_full_pool``: fills the mamba pool so a lazy boundary allocation fails
  (tracking degrades in place) and the next checkpoint needs the evict-and-retry path.
* ``refused_after_match``: a request that matched (and copied) a cached state is refused
  for lack of KV room and must give its slot back.
"""

from __future__ import annotations

import os
from typing import Callable

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.sglang_api import pool
from conformance.sglang_api.pool_runtime import PoolKey
from conformance.matrix.strategy import BUFFERED, LAZY, NAMES
from conformance.targets.pool import invariants
from conformance.targets.pool.harness import PoolExhausted, PoolHarness, PoolSizes
from conformance.targets.pool.machine import OracleMismatch, pool_machine


def oracle_for(h: PoolHarness) -> PrefixOracle:
    return PrefixOracle(h.key.strategy, h.chunk, h.key.page_size, h.key.track_interval, h.key.lazy_alloc_fail)


def machine_settings(examples: int | None = None, steps: int | None = None, *, shrink: bool = True):
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=examples or int(os.environ.get("HYBRID_CONFORMANCE_POOL_EXAMPLES", "25")),
        stateful_step_count=steps or int(os.environ.get("HYBRID_CONFORMANCE_POOL_STEPS", "25")),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=list(Phase) if shrink else [p for p in Phase if p not in (Phase.shrink, Phase.explain)],
    )


def run_machine(
    key: PoolKey, sizes: PoolSizes = PoolSizes(), *, examples: int | None = None, steps: int | None = None, shrink: bool = True
) -> None:
    """Run the state machine for one pool key; raises with the (shrunk) steps on failure."""
    from hypothesis.stateful import run_state_machine_as_test

    machine = pool_machine(lambda: PoolHarness(key, sizes), oracle_for)
    run_state_machine_as_test(machine, settings=machine_settings(examples, steps, shrink=shrink))


class _Driver:
    """A harness + oracle pair that checks everything after every operation."""

    def __init__(self, key: PoolKey, sizes: PoolSizes = PoolSizes()):
        self.h = PoolHarness(key, sizes)
        self.h.activate()
        self.oracle = oracle_for(self.h)
        self.checker = invariants.make_sglang_checker(self.h)
        self.log: list[str] = []

    def check(self) -> None:
        invariants.check_all(self.h, self.checker)

    def arrive(self, rid: str, prompt, *, chunked: int | None = None, session=None):
        want = self.oracle.expected_hit(prompt) if self.h.evictions == 0 and self.h.oracle_exact and session is None else None
        kw = {"session": session} if session is not None else {}
        run = self.h.admit(rid, prompt, chunked_prefill_size=chunked, **kw)
        self.log.append(f"{rid}: {len(prompt)} tokens matched {run.matched}")
        if want is not None and run.matched != want:
            raise OracleMismatch(f"{rid}: matched {run.matched}, oracle expects {want} ({'; '.join(self.log)})")
        for _end, stored in self.oracle.prefill_plan(prompt, chunked_prefill_size=chunked):
            self.h.prefill_chunk(run)
            self.oracle.store(prompt, stored)
            self.check()
        return run

    def decode(self, run, steps: int) -> None:
        for _ in range(steps):
            self.h.decode(run)
        self.check()

    def finish(self, run, *, abort: bool = False, lookahead: bool = False) -> list[int]:
        self.h.finish(run, abort=abort, **({"lookahead": True} if lookahead else {}))
        seq = run.tokens
        self.oracle.record_finished(run.prompt, seq[len(run.prompt):], aborted=abort)
        self.check()
        return seq

    def drain(self) -> None:
        self.h.evict_all()
        invariants.back_to_totals(self.h)


def branch_at_chunk_boundary(key: PoolKey) -> None:
    d = _Driver(key)
    g = d.h.checkpoint_grid
    base = [1 + i % 5 for i in range(3 * g + 5)]
    a = d.arrive("A", base)
    d.decode(a, 3)
    a_seq = d.finish(a)
    for i, cut in enumerate((2 * g, 2 * g - 1, 2 * g + 1)):
        run = d.arrive(f"B{i}", base[:cut] + [7 + i] * (g + 3))
        d.finish(run)
    hit = d.arrive("C", base[: 2 * g] + [9] * 5)
    d.finish(hit)
    again = d.arrive("D", a_seq + [9] * 5)  # every lifecycle keeps a finished request's state
    if again.matched == 0:
        raise AssertionError(f"D extends A's finished {len(a_seq)} tokens but hit nothing: nothing was cached")
    d.finish(again)
    d.drain()


def session_reuse(key: PoolKey) -> None:
    d = _Driver(key)
    g = d.h.checkpoint_grid
    run = d.arrive("S", [2 + i % 3 for i in range(2 * g + 3)])
    d.decode(run, d.h.track_grid + 2)
    seq = d.finish(run)
    for turn in range(2):  # the same Req object carries the next turns
        prompt = seq + [40 + turn] * (g + 1)
        req = run.req
        d.h.reuse(req, prompt)
        want = d.oracle.expected_hit(prompt) if d.h.oracle_exact else None
        req.init_next_round_input(d.h.tree)
        run = d.h.adopt(f"S{turn}", req, prompt)
        if run.matched == 0:
            raise AssertionError(f"session turn {turn} hit nothing of its {len(seq)}-token history: nothing was cached")
        if want is not None and run.matched != want:
            raise OracleMismatch(f"session turn {turn}: matched {run.matched}, oracle expects {want}")
        while not run.prefill_done:
            d.oracle.store(prompt, d.h.prefill_chunk(run))
        d.check()
        other = d.arrive(f"O{turn}", [5] * (g + 2))  # competes for the slots the stale Req may reuse
        d.decode(run, 2)
        d.decode(other, 2)
        d.finish(other)
        seq = d.finish(run)
    d.drain()


def session_abort(key: PoolKey) -> None:
    """A streaming session (SGLang's own session slot): a finished turn's record stays with
    the session, the next turn borrows it and aborts (the abort hands record and lock back
    and is released like any request), a fresh first turn takes a new record, then the
    session closes.  Every step is checked with the session's slots accounted for."""
    d = _Driver(key)
    g = d.h.checkpoint_grid
    session = d.h.open_session("sess-1")
    first = d.arrive("T1", [6 + i % 2 for i in range(g + 5)], session=session)
    d.decode(first, 3)
    seq = d.finish(first)
    if not d.h.session_records():
        raise AssertionError("a finished streaming turn left no record with its session")
    second = d.arrive("T2", seq + [11] * (g + 2), session=session)
    if second.matched < len(seq) - 1:
        raise AssertionError(f"the second turn borrowed {second.matched} tokens of its session's {len(seq)}")
    d.decode(second, 2)
    d.finish(second, abort=True)
    if d.h.session_records():
        raise AssertionError("an aborted streaming turn left its record with the session")
    third = d.arrive("T3", seq + [12] * 3, session=session)
    d.decode(third, 2)
    d.finish(third)
    d.h.close_session(session)
    d.check()
    if d.h.session_records():
        raise AssertionError("closing the session left its record in the tree")
    d.drain()


def overlap_lookahead_finish(key: PoolKey) -> None:
    """Overlap's lookahead at finish: a request finishes one step before a track boundary
    while the next forward (the boundary one) was already launched; another finishes on
    the boundary with its lookahead one past it.  The dropped forward must not clobber
    the state the tree keeps, nor leak its KV or transient slot; later hits follow the oracle."""
    d = _Driver(key)
    grid = d.h.track_grid
    for i, finish_at in enumerate((grid - 1, grid)):
        run = d.arrive(f"A{i}", [20 + i] * (d.h.checkpoint_grid + 1))
        d.decode(run, finish_at - d.h.state(run.req).kv_committed_len)
        seq = d.finish(run, lookahead=True)
        hit = d.arrive(f"B{i}", seq + [30 + i] * 3)
        d.finish(hit)
    d.drain()


def lazy_boundary_full_pool(key: PoolKey) -> None:
    sizes = PoolSizes(mamba_slots=6, max_reqs=3, kv_tokens=4096)
    d = _Driver(key, sizes)
    grid, track = d.h.checkpoint_grid, d.h.track_grid
    a = d.arrive("A", [3] * (grid + 1))          # tree: 1 state; A: slot + track slot(s)
    b = d.arrive("B", [4] * (grid + 1))
    d.decode(a, track - (grid + 1) - 1)           # one step before A's boundary
    free_before = d.h.rtp.mamba_allocator.available_size()
    if free_before != 0:
        raise AssertionError(f"scenario set-up: {free_before} mamba slots still free before the boundary")
    d.decode(a, 2)                                # the boundary: the lazy allocation fails (no evict-retry)
    if d.h.evictions:
        raise AssertionError("the lazy boundary allocation evicted a cached state; 0.5.23 degrades in place")
    d.finish(a)
    c = d.arrive("C", [4] * grid + [6] * (grid + 1))  # checkpoint donation needs evict-and-retry
    if not d.h.evictions:
        raise AssertionError("the checkpoint donation with a full pool did not go through evict-and-retry")
    d.finish(c)
    d.finish(b)
    d.drain()


def refused_after_match(key: PoolKey) -> None:
    g = max(key.model_chunk, key.page_size)
    d = _Driver(key, PoolSizes(mamba_slots=12, max_reqs=3, kv_tokens=8 * g, max_context_len=8 * g))
    a = d.arrive("A", [1] * (2 * g + 1))
    d.finish(a)
    hog = d.arrive("H", [2] * (4 * g))             # holds half the KV
    try:
        d.h.admit("R", [1] * (2 * g) + [3] * (4 * g))  # matches A, then cannot get KV
        raise AssertionError("admission unexpectedly fitted; the scenario needs a smaller KV pool")
    except PoolExhausted:
        pass
    d.check()
    d.finish(hog)
    d.drain()


def lazy_alloc_fail_effects(key: PoolKey) -> None:
    """SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1: requests finish, no transient slot is ever taken,
    no leak, markers hold and hits follow the oracle (in-place tracking keeps them)."""
    d = _Driver(key)
    track = d.h.track_grid
    a = d.arrive("A", [8] * (d.h.checkpoint_grid + 1))
    allocator = d.h.rtp.mamba_allocator
    real_alloc, taken = allocator.alloc, []
    allocator.alloc = lambda n: taken.append(n) or real_alloc(n)  # counts decode-time allocations
    try:
        for _ in range(2 * track):
            d.h.decode(a)
    finally:
        del allocator.alloc
    transient = len(taken)
    d.check()
    seq = d.finish(a)
    if key.lazy_alloc_fail and transient:
        raise AssertionError(f"{transient} boundary steps took a second slot although every lazy allocation fails")
    if not key.lazy_alloc_fail and not transient:
        raise AssertionError("no boundary step took the transient second slot")
    b = d.arrive("B", seq + [9] * 3)
    d.finish(b)
    d.drain()


ALL = NAMES
# name -> (scenario, strategies it applies to, driver capability it needs)
SCENARIOS: dict[str, tuple[Callable[[PoolKey], None], tuple[str, ...]]] = {
    "branch_at_chunk_boundary": (branch_at_chunk_boundary, ALL),
    "session_reuse": (session_reuse, BUFFERED),
    "session_abort": (session_abort, BUFFERED),
    "overlap_lookahead_finish": (overlap_lookahead_finish, BUFFERED),
    "lazy_boundary_full_pool": (lazy_boundary_full_pool, LAZY),
    "refused_after_match": (refused_after_match, ALL),
    "lazy_alloc_fail_effects": (lazy_alloc_fail_effects, LAZY),
}
NEEDS = {"session_abort": "sessions", "overlap_lookahead_finish": "lookahead"}


def not_applicable(name: str, key: PoolKey) -> str | None:
    """Why scenario ``name`` does not apply to ``key`` on the installed SGLang (None: it runs).

    The kit's own applicability (strategies) first, then the release: a strategy it
    predates (its parser's own line) and what the driver that fits it cannot drive."""
    _fn, strategies = SCENARIOS[name]
    if key.strategy not in strategies:
        return f"scenario {name} applies to {', '.join(strategies)} only"
    return pool.driver_class().gap(pool.load(), key, NEEDS.get(name))
