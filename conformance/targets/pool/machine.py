"""The pool tier's hypothesis state machine, as library code.

``pool_machine(harness_factory, oracle_factory)`` returns a ``RuleBasedStateMachine``
class that drives a :class:`PoolHarness` (the system under test, passed in) against a
:class:`~conformance.checks.prefix_oracle.PrefixOracle` (the model).  Rules: arrivals whose
prompts branch off earlier prompts/outputs (small alphabet, cut points near chunk and
track boundaries so branching is frequent), chunked prefill, decode bursts that cross
track boundaries, finish, abort mid-decode, flush, explicit eviction; the pools are small
so allocations fail and SGLang evicts on its own.  An arrival refused for lack of room waits
and is retried, first come first served, as SGLang's scheduler keeps a refused request in its
waiting queue and matches it again at the next admission (what it matched may have been
evicted since).  After every step all invariants of
``invariants.check_all`` hold, and the tree's set of state keys equals the oracle's while
no eviction happened since the last flush (eviction is not modelled by the oracle; after
one, a hit must only be one of ``oracle.candidate_hits``).  Every arrival's matched length
is compared the same way.  On a driver whose lifecycle the oracle does not model
(``oracle_exact`` False: the older lifecycle) the oracle comparisons are off and every
pool invariant still runs.
"""

from __future__ import annotations

from typing import Callable

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conformance.sglang_api.pool_driver import PoolExhausted
from conformance.targets.pool import invariants


class OracleMismatch(AssertionError):
    """SGLang's cache disagrees with the prefix oracle."""


def pool_machine(harness_factory: Callable[[], object], oracle_factory: Callable[[object], object]):
    """A state-machine class that builds a fresh harness and a fresh oracle per run."""

    class PoolMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.h = harness_factory()  # fresh pools per example (building them takes ~50 ms)
            self.h.activate()
            self.checker = invariants.make_sglang_checker(self.h)
            self.oracle = oracle_factory(self.h)
            self.history: list[tuple[int, ...]] = []
            self.counter = 0
            self.plans: dict[str, list] = {}
            #: arrivals refused for lack of room, oldest first: (rid, prompt, chunked prefill size)
            self.waiting: list[tuple[str, tuple[int, ...], int | None]] = []

        # ------------------------------------------------------------ helpers
        def _exact(self) -> bool:
            return self.h.oracle_exact and self.h.evictions == 0

        def _compare_hit(self, prompt, matched: int) -> None:
            want = self.oracle.expected_hit(prompt)
            if not self.h.oracle_exact:
                return
            if self._exact():
                if matched != want:
                    raise OracleMismatch(f"arrival of {len(prompt)} tokens matched {matched}, oracle expects {want}")
            elif matched not in self.oracle.candidate_hits(prompt):
                raise OracleMismatch(f"arrival of {len(prompt)} tokens matched {matched}, never a stored length ({sorted(self.oracle.candidate_hits(prompt))})")

        def _prefill(self, run) -> None:
            plan = dict(self.plans.get(run.rid, []))
            try:
                stored = self.h.prefill_chunk(run)
            except PoolExhausted as e:
                note(f"prefill of {run.rid} deferred: {e}")
                return
            end = run.req.prefix_len if self._exact() else None
            if self._exact() and plan.get(end, "n/a") != stored and end in plan:
                raise OracleMismatch(f"{run.rid} prefill chunk ending at {end} stored {stored}, oracle planned {plan[end]}")
            self.oracle.store(run.prompt, stored)

        # ------------------------------------------------------------ rules
        # Sizes are (multiple of the checkpoint grid, offset): the first (simplest) choice
        # of every draw is already an interesting one, so even short runs branch and cross.
        @rule(
            base=st.integers(0, 7),
            cut=st.sampled_from([(2, 0), (1, 0), (2, -1), (2, 1), (0, 0), (3, 0), (1, 7)]),
            size=st.sampled_from([(1, 1), (2, 3), (0, 5), (1, -1), (3, 5), (0, 1), (4, 2)]),
            seed=st.integers(0, 3),
            chunked=st.sampled_from([None, 1, None, 2]),
        )
        def arrive(self, base, cut, size, seed, chunked):
            grid = self.h.checkpoint_grid
            prefix: tuple[int, ...] = ()
            if self.history:
                src = self.history[-1 - base % len(self.history)]
                prefix = src[: max(0, cut[0] * grid + cut[1])]
            suffix_len = max(1, size[0] * grid + size[1])
            suffix = tuple(1 + (seed * 7 + i // (1 + seed)) % 3 for i in range(suffix_len))
            prompt = prefix + suffix
            chunk_size = None if chunked is None else chunked * grid
            self.counter += 1
            self._admit(f"r{self.counter}", prompt, chunk_size)

        @precondition(lambda self: bool(self.waiting))
        @rule()
        def retry_refused(self):
            """The oldest refused arrival tries again (matched anew), as the scheduler's next admission does."""
            rid, prompt, chunk_size = self.waiting.pop(0)
            self._admit(rid, prompt, chunk_size, retry=True)

        def _admit(self, rid: str, prompt: tuple[int, ...], chunk_size: int | None, retry: bool = False) -> None:
            """Admit an arrival (its match judged) or, refused for lack of room, keep it waiting:
            a new arrival at the queue's tail, a retried one back at its head."""
            try:
                run = self.h.admit(rid, prompt, chunked_prefill_size=chunk_size)
            except PoolExhausted as e:
                note(f"{rid} ({len(prompt)} tokens) refused, waits: {e}")
                self.waiting.insert(0 if retry else len(self.waiting), (rid, prompt, chunk_size))
                return
            note(f"{rid}: {len(prompt)} tokens, matched {run.matched}, chunked {chunk_size}")
            self._compare_hit(prompt, run.matched)
            self.plans[rid] = self.oracle.prefill_plan(prompt, chunked_prefill_size=chunk_size) if self._exact() else []
            self.history.append(prompt)
            self._prefill(run)

        @precondition(lambda self: any(not r.prefill_done for r in self.h.running.values()))
        @rule(data=st.data())
        def prefill_next_chunk(self, data):
            pending = sorted(r for r, run in self.h.running.items() if not run.prefill_done)
            self._prefill(self.h.running[data.draw(st.sampled_from(pending))])

        @precondition(lambda self: any(r.prefill_done for r in self.h.running.values()))
        @rule(data=st.data(), past_boundary=st.sampled_from([1, 0, 2, -1, -40]))
        def decode(self, data, past_boundary):
            """Decode to ``past_boundary`` tokens after the next track boundary."""
            ready = sorted(r for r, run in self.h.running.items() if run.prefill_done)
            run = self.h.running[data.draw(st.sampled_from(ready))]
            seq_len, grid = self.h.state(run.req).kv_committed_len, self.h.track_grid
            steps = max(1, (seq_len // grid + 1) * grid - seq_len + past_boundary)
            for i in range(steps):
                try:
                    self.h.decode(run)
                except PoolExhausted as e:
                    note(f"decode of {run.rid} stopped after {i} steps: {e}")
                    break

        @precondition(lambda self: bool(self.h.running))
        @rule(data=st.data(), abort=st.booleans())
        def finish(self, data, abort):
            run = self.h.running[data.draw(st.sampled_from(sorted(self.h.running)))]
            done = run.prefill_done
            self.h.finish(run, abort=abort)
            if done:
                seq = run.tokens
                self.history.append(tuple(seq))
                self.oracle.record_finished(run.prompt, seq[len(run.prompt):], aborted=abort)

        @precondition(lambda self: not self.h.running)
        @rule()
        def flush(self):
            self.h.evict_all()
            invariants.back_to_totals(self.h)
            self.h.flush()
            self.oracle.flush()

        @rule(tokens=st.sampled_from([0, 64, 512]), mamba=st.integers(0, 3))
        def evict(self, tokens, mamba):
            self.h.evict(tokens, mamba)

        # ------------------------------------------------------------ invariants
        @invariant()
        def pools_consistent(self):
            invariants.check_all(self.h, self.checker)

        @invariant()
        def tree_matches_oracle(self):
            if not self._exact():
                return
            real = set(invariants.tree_state_keys(self.h))
            model = set(self.oracle.stored_keys())
            if real != model:
                extra = sorted(len(k) for k in real - model)
                missing = sorted(len(k) for k in model - real)
                raise OracleMismatch(f"tree states differ from the oracle: in tree only (lengths)={extra}, in oracle only={missing}")

    PoolMachine.__name__ = "PoolMachine"
    return PoolMachine
