"""Prefix oracle: the ``cached_tokens`` SGLang 0.5.23 reports for a request, predicted
from the cache's history.  Pure Python, no sglang import; shared by the pool tier (which
validates it against the real ``UnifiedRadixCache``), the server-tier prefix-branching
check and the reference engine.

Grids (``chunk`` is SGLang's ``mamba_cache_chunk_size`` = max(model chunk, page); both
are :class:`conformance.matrix.grid.Grid`'s)::

    checkpoint_grid = lcm(chunk, page_size)                    # prefill checkpoints
    track_grid      = lcm(checkpoint_grid, track_interval)     # decode tracks

A request's token sequence is ``prompt + output`` where ``output`` holds every token the
server returned; the last one was sampled but never fed, so a finished request's state
covers ``len(prompt) + len(output) - 1`` tokens (its ``kv_committed_len``).

Where a mamba state snapshot lands (code: ``ScheduleBatch._mamba_radix_cache_v2_req_
prepare_for_extend``, ``MambaComponent.prepare_for_caching_req`` /
``_select_finished_checkpoint``, ``SchedulerBatchResultProcessor._mamba_prefix_cache_
update``):

* ``no_buffer`` (page 1 only): after every prefill chunk that does not finish the request,
  the state at the chunk end (``extend_end``; the prompt end for the last chunk) is copied
  into the tree.  At finish the request's own slot is donated at ``committed`` length.
  No decode tracking, no branch-point tracking.
* ``extra_buffer`` / ``extra_buffer_lazy``: a prefill chunk ``[prefix, end)`` with
  ``end - prefix >= checkpoint_grid`` tracks ``prefix + (end - prefix) // grid * grid``
  (prefix-relative, so chunked prefill can land off the absolute grid), or the branching
  point ``b`` instead when ``prefix < b < end`` and ``(b - prefix) % chunk == 0``.  The
  tracked state is donated at the checkpoint after the chunk.  During decode every
  ``seq_len`` in ``(len(prompt), committed]`` divisible by ``track_grid`` is tracked; only
  the latest one is donated at finish (nothing if no boundary was crossed).  The prefill
  track is already in the tree then and is not re-inserted.
* ``b`` (``mamba_branching_seqlen``) is fixed at admission: the full-KV hit (the longest
  cached token path, page-floored, within the key limit) floored to ``checkpoint_grid``,
  when that exceeds the mamba hit; else None.
* ``lazy_alloc_fail`` (``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1``): the boundary slot
  allocation fails and tracking degrades in place into the keep slot.  With a synchronous
  schedule (``lookahead=0``) the boundary state is still recorded and inserted, so hits
  are unchanged.  Under overlap (``lookahead=1``) a request that finishes while the
  in-flight step is an in-place boundary (``(committed + 1) % track_grid == 0``) sets
  ``mamba_lazy_checkpoint = False`` and inserts nothing at finish -- when the scheduler
  prepared that step; when it did not, the last state tracked in place is inserted (seen on
  0.5.23: a 247 + 521-token request stored 512; the programs oracle admits it only when
  SGLang's tree was seen taking it, ``hit_bounds.unprepared_boundary_finish_store``).  Only
  ``lookahead=0`` is validated against real SGLang by the pool tier.
* Aborted requests finish through the same path (one more forward, then
  ``release_kv_cache(checkpoint=True)``), so ``aborted`` does not change what is stored.

The hit for a new request ``tokens`` (``expected_hit``): the longest stored state whose key
is a prefix of ``tokens`` and whose length is at most ``len(tokens) - 1`` (SGLang's key
limit keeps one token to compute), page-floored.

Eviction is NOT modelled: after LRU eviction real hits can only be shorter.  Callers
compare exactly while no eviction happened since the last ``flush`` and otherwise check
``observed in oracle.candidate_hits(tokens)`` (positions that were stored at some point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from conformance.errors import KitError
from conformance.matrix.grid import Grid
from conformance.matrix.strategy import Strategy, strategy_named


class OracleError(ValueError):
    """The oracle was configured with a combination SGLang refuses."""


@dataclass(frozen=True)
class Admission:
    """What SGLang computes when it admits a request: the device hit and the branch point."""

    hit: int
    branching_seqlen: int | None
    full_kv_hit: int


def floor_to(n: int, grid: int) -> int:
    return n // grid * grid


def prefill_checkpoint_len(
    strategy: Strategy | str, prefix_len: int, extend_end: int, *, checkpoint_grid: int, chunk: int, branching_seqlen: int | None = None
) -> int | None:
    """Where the state computed by one prefill chunk ``[prefix_len, extend_end)`` lands in
    the tree at the checkpoint after it (None: nothing is stored)."""
    extend_len = extend_end - prefix_len
    if extend_len <= 0:
        return None
    if not strategy_named(strategy).has_buffer:
        return extend_end
    if extend_len < checkpoint_grid:
        return None
    tracked = prefix_len + floor_to(extend_len, checkpoint_grid)
    b = branching_seqlen
    if b is not None and prefix_len < b < extend_end and (b - prefix_len) % chunk == 0:
        tracked = b
    return tracked


def decode_track_positions(prompt_len: int, committed_len: int, track_grid: int) -> list[int]:
    """Every decode seq_len in ``(prompt_len, committed_len]`` at which the state is tracked."""
    first = floor_to(prompt_len, track_grid) + track_grid
    return list(range(first, committed_len + 1, track_grid))


def chunk_ends(prefix_len: int, prompt_len: int, chunked_prefill_size: int | None, page_size: int = 1) -> list[int]:
    """The ``extend_end`` of each prefill chunk (page-aligned cuts, as the PrefillAdder does)."""
    if not chunked_prefill_size or chunked_prefill_size <= 0:
        return [prompt_len] if prompt_len > prefix_len else []
    step = max(floor_to(chunked_prefill_size, page_size), page_size)
    ends, pos = [], prefix_len
    while prompt_len - pos > step:
        pos = floor_to(pos + step, page_size)
        ends.append(pos)
    if prompt_len > pos:
        ends.append(prompt_len)
    return ends


class PrefixOracle:
    """The set of mamba states the radix tree holds, keyed by token prefix (no eviction)."""

    def __init__(self, strategy: Strategy | str, chunk: int, page_size: int, track_interval: int, lazy_alloc_fail: bool = False,
                 branching: bool = True):
        try:
            s = strategy_named(strategy)
        except KitError as e:
            raise OracleError(str(e)) from None
        refusal = s.refuses_page_size(page_size)
        if refusal:
            raise OracleError(refusal)
        if lazy_alloc_fail and not s.lazy:
            raise OracleError(f"lazy_alloc_fail only applies to lazy strategies, not {s.name}")
        self.strategy = s
        self.grid = Grid(chunk, page_size, track_interval)
        self.lazy_alloc_fail = lazy_alloc_fail
        self.branching = branching  # False: the release stores no state at a branch point (HiCache on 0.5.13-0.5.16)
        self._states: set[tuple[int, ...]] = set()
        self._ever: set[tuple[int, ...]] = set()

    def __repr__(self) -> str:
        return (
            f"PrefixOracle({self.strategy.name!r}, chunk={self.grid.chunk}, page_size={self.grid.page_size}, "
            f"track_interval={self.grid.track_interval}, lazy_alloc_fail={self.lazy_alloc_fail})"
        )

    # ------------------------------------------------------------- queries
    @property
    def buffered(self) -> bool:
        return self.strategy.has_buffer

    def stored_keys(self) -> list[tuple[int, ...]]:
        """Token keys of every state the tree holds (shortest first)."""
        return sorted(self._states, key=lambda k: (len(k), k))

    def _limit(self, tokens: Sequence[int]) -> int:
        return floor_to(max(len(tokens) - 1, 0), self.grid.page_size)

    def _best(self, tokens: Sequence[int], keys: Iterable[tuple[int, ...]]) -> int:
        t, limit = tuple(tokens), self._limit(tokens)
        return max((len(k) for k in keys if len(k) <= limit and t[: len(k)] == k), default=0)

    def expected_hit(self, tokens: Sequence[int]) -> int:
        """``cached_tokens`` for a request with these input tokens, admitted now."""
        return self._best(tokens, self._states)

    def candidate_hits(self, tokens: Sequence[int]) -> set[int]:
        """Every hit a real cache could report after evictions: 0 or any length once stored."""
        t, limit = tuple(tokens), self._limit(tokens)
        return {0} | {len(k) for k in self._ever if len(k) <= limit and t[: len(k)] == k}

    def full_kv_hit(self, tokens: Sequence[int]) -> int:
        """Longest cached token path (every stored key carries its full KV), page-floored."""
        t, limit, best = tuple(tokens), self._limit(tokens), 0
        for k in self._states:
            n = min(len(k), limit)
            common = next((i for i in range(n) if k[i] != t[i]), n)
            best = max(best, common)
        return floor_to(best, self.grid.page_size)

    def admit(self, tokens: Sequence[int]) -> Admission:
        hit = self.expected_hit(tokens)
        full = self.full_kv_hit(tokens)
        aligned = floor_to(full, self.grid.checkpoint_grid)
        return Admission(hit, aligned if aligned > hit and self.branching else None, full)

    def prefill_plan(
        self, prompt: Sequence[int], *, chunked_prefill_size: int | None = None, admission: Admission | None = None
    ) -> list[tuple[int, int | None]]:
        """(extend_end, stored length or None) per prefill chunk for a request admitted now."""
        adm = admission or self.admit(prompt)
        plan, prefix = [], adm.hit
        for end in chunk_ends(adm.hit, len(prompt), chunked_prefill_size, self.grid.page_size):
            stored = prefill_checkpoint_len(
                self.strategy, prefix, end, checkpoint_grid=self.grid.checkpoint_grid, chunk=self.grid.chunk, branching_seqlen=adm.branching_seqlen
            )
            plan.append((end, stored))
            prefix = end
        return plan

    def finish_insert_len(self, prompt_len: int, committed_len: int, *, lookahead: int = 0) -> int | None:
        """The length donated to the tree when a request finishes (None: nothing)."""
        if committed_len <= 0:
            return None
        if not self.buffered:
            return committed_len
        if self.lazy_alloc_fail and lookahead == 1 and (committed_len + 1) % self.grid.track_grid == 0:
            return None
        tracks = decode_track_positions(prompt_len, committed_len, self.grid.track_grid)
        return tracks[-1] if tracks else None

    # ------------------------------------------------------------- updates
    def store(self, tokens: Sequence[int], length: int | None) -> None:
        """Record that the tree now holds the state of ``tokens[:length]`` (page-floored key)."""
        if length is None:
            return
        n = floor_to(length, self.grid.page_size)
        if n <= 0:
            return
        key = tuple(tokens[:n])
        self._states.add(key)
        self._ever.add(key)

    def record_prefill(self, prompt: Sequence[int], *, chunked_prefill_size: int | None = None) -> list[int]:
        """Admit ``prompt`` now and record what its prefill stores; returns the stored lengths."""
        out = []
        for _end, stored in self.prefill_plan(prompt, chunked_prefill_size=chunked_prefill_size):
            self.store(prompt, stored)
            if stored is not None:
                out.append(stored)
        return out

    def record_finished(
        self, prompt: Sequence[int], output: Sequence[int], *, aborted: bool = False, lookahead: int = 0
    ) -> int | None:
        """Record the insert at finish; ``output`` is every returned token (the last never fed)."""
        del aborted  # same release path as a normal finish in 0.5.23
        seq = list(prompt) + list(output)
        committed = len(seq) - 1 if output else len(prompt)
        n = self.finish_insert_len(len(prompt), committed, lookahead=lookahead)
        self.store(seq, n)
        return n

    def record_request(
        self, prompt: Sequence[int], output: Sequence[int], *, chunked_prefill_size: int | None = None, lookahead: int = 0
    ) -> int:
        """A whole request run alone (arrive, prefill, decode, finish); returns its hit."""
        hit = self.expected_hit(prompt)
        self.record_prefill(prompt, chunked_prefill_size=chunked_prefill_size)
        self.record_finished(prompt, output, lookahead=lookahead)
        return hit

    def flush(self) -> None:
        """``/flush_cache``: the tree is empty again."""
        self._states.clear()
        self._ever.clear()
