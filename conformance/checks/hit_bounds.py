"""Which ``cached_tokens`` the prefix oracle allows for a request of a concurrent program.

The prefix oracle (``prefix_oracle.py``) predicts the hit of a request admitted after a
known history.  With several requests in flight the admission order is the scheduler's,
so the stored states at a request's admission are bounded, not known:

* **certain** states: stored by requests whose answer arrived before this one was sent,
  through a path the oracle predicts exactly (a normal finish, a prefill whose admission
  was itself certain);
* **maybe** states: stored by requests that overlapped this one (sent before it
  finished, answered after it was sent), by aborted requests, by streaming sessions, or
  at a prefill checkpoint whose position depended on an uncertain admission.

The allowed hits are the best certain one plus every longer maybe one.  Once the pools
could have had to evict (more states and in-flight slots than the mamba pool holds, or
more tokens than the KV pool), a certain state may be gone: 0 and every stored length are
allowed (the oracle does not model eviction order).  Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from conformance.checks.prefix_oracle import chunk_ends, decode_track_positions, floor_to, prefill_checkpoint_len
from conformance.matrix.grid import Grid
from conformance.matrix.strategy import Strategy, strategy_named

Key = tuple[int, ...]


class Prefix(tuple):
    """A stored key: a token prefix that hashes once.  The oracle keeps thousands of keys
    of several hundred tokens in sets and dicts (a burst whose prefills may have been cut
    anywhere stores every page); a plain tuple rehashes every token on each lookup."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash


def _prefix(seq: Key, n: int) -> Prefix:
    return Prefix(seq[:n])

@dataclass(frozen=True)
class StrategyGrid(Grid):
    """A cell's :class:`~conformance.matrix.grid.Grid` under its strategy, with what the judge needs
    of its schedule (the lazy-alloc-fail fault, steps in flight)."""

    strategy: Strategy
    lazy_alloc_fail: bool = False
    lookahead: int = 0

    @property
    def buffered(self) -> bool:
        return self.strategy.has_buffer


@dataclass
class Stores:
    """States one finished request stored (``certain``) or may have stored (``maybe``)."""

    certain: set[Key] = field(default_factory=set)
    maybe: set[Key] = field(default_factory=set)

    def add(self, key: Key | None, *, sure: bool) -> None:
        if not key:
            return
        (self.certain if sure else self.maybe).add(key)


def key_limit(n_tokens: int, page_size: int, logprob_start: int | None = None) -> int:
    """SGLang's match limit: ``len - 1`` (one token left to compute), and not past a
    requested ``logprob_start_len``; page-floored."""
    limit = max(n_tokens - 1, 0)
    if logprob_start is not None and logprob_start >= 0:
        limit = min(limit, logprob_start)
    return floor_to(limit, page_size)


def _matching(tokens: Key, keys: Iterable[Key], limit: int) -> set[int]:
    return {len(k) for k in keys if len(k) <= limit and tokens[: len(k)] == k}


def allowed_hits(tokens: Sequence[int], certain: Iterable[Key], maybe: Iterable[Key], *, limit: int, evicted: bool) -> set[int]:
    t = tuple(tokens)
    sure = _matching(t, certain, limit)
    might = _matching(t, maybe, limit)
    best = max(sure, default=0)
    allowed = {best} | {n for n in might if n > best}
    if evicted:
        allowed |= {0} | sure | might
    return allowed


def _common(a: Key, b: Key) -> int:
    """Length of the common prefix (bisection on slice equality: the comparisons run in C,
    which keeps judging a 40-request burst of 450-token prompts fast)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def branch_point(prompt: Key, key: Key, grid: StrategyGrid, hit: int, logprob_start: int | None = None) -> int | None:
    """SGLang's ``mamba_branching_seqlen`` for a request that met the tree holding ``key``:
    the full-KV match floored to the checkpoint grid, when that exceeds the hit.  The match
    is the one SGLang made: capped at the request's ``logprob_start_len`` like its hit (a
    request asking for logprobs from token 225 matches at most 225 tokens and tracks its
    branch point at 192, even where a longer state is stored)."""
    full = floor_to(min(_common(key, prompt), key_limit(len(prompt), grid.page_size, logprob_start)), grid.page_size)
    b = floor_to(full, grid.checkpoint_grid)
    return b if b > hit else None


def branch_candidates(prompt: Key, keys: Iterable[Key], grid: StrategyGrid, hit: int, logprob_start: int | None = None) -> set[int | None]:
    """:func:`branch_point` for each tree the request may have met, and None (none met)."""
    return {None} | {branch_point(prompt, k, grid, hit, logprob_start) for k in keys}


def prefill_stores(prompt: Key, hits: Iterable[int], branches: Iterable[int | None], grid: StrategyGrid) -> set[Key]:
    """Where the prefill checkpoint of ``prompt`` lands for each possible admission."""
    out = set()
    for h in hits:
        for b in branches:
            n = prefill_checkpoint_len(grid.strategy, h, len(prompt), checkpoint_grid=grid.checkpoint_grid, chunk=grid.chunk, branching_seqlen=b)
            if n is not None and floor_to(n, grid.page_size) > 0:
                out.add(_prefix(prompt, floor_to(n, grid.page_size)))
    return out


def prefill_must_be_cut(prompt_len: int, hit: int, budget: int | None) -> bool:
    """SGLang's PrefillAdder gives no request more than ``chunked_prefill_size`` new tokens
    in one extend (``chunk_fit_tokens > chunk_tokens_limit``: truncated to the budget), so a
    prompt with more new tokens than the budget past its hit is cut whatever else runs."""
    return budget is not None and prompt_len - hit > budget


def prefill_never_tracked(grid: StrategyGrid, budget: int | None) -> bool:
    """A buffered strategy tracks a prefill checkpoint only in an extend of at least one
    checkpoint grid (``_mamba_radix_cache_v2_req_prepare_for_extend``: ``mask =
    extend_len >= checkpoint_grid``); no extend is longer than the prefill budget, so with
    a budget below the grid no prefill ever stores a state (SGLang warns at start:
    "chunked_prefill_size ... smaller than mamba_cache_chunk_size ... skip Mamba state
    checkpoints")."""
    return grid.buffered and budget is not None and budget < grid.checkpoint_grid


def chunked_prefill_stores(prompt: Key, hit: int, grid: StrategyGrid, budget: int) -> set[Key]:
    """The checkpoints of a prefill SGLang cut at every ``budget`` new tokens with nothing
    else in its batches (``PrefixOracle.prefill_plan``): each chunk tracks ``start +
    floor(extend_len, grid)`` (buffered) or its end (no buffer), published at the hand-off."""
    out, start = set(), hit
    for end in chunk_ends(hit, len(prompt), budget, grid.page_size):
        n = prefill_checkpoint_len(grid.strategy, start, end, checkpoint_grid=grid.checkpoint_grid, chunk=grid.chunk)
        if n is not None and floor_to(n, grid.page_size) > 0:
            out.add(_prefix(prompt, floor_to(n, grid.page_size)))
        start = end
    return out


def cut_prefill_stores(prompt: Key, hit: int, grid: StrategyGrid, *, budget: int | None = None) -> set[Key]:
    """Where the state of a prefill that SGLang cut at a page ``c`` of its own choosing may
    land.  Without a buffer the request's own state is cached where the cut fell: every
    page.  With one, SGLang tracks each chunk's checkpoint on a grid relative to where
    that chunk started (``prefix_len + floor(extend_len, grid)``): the first chunk's at
    ``hit + k * grid``, the continuation's at ``c + floor(end - c, grid)``, which is any
    page of the last grid window before the end (seen on a clean SGLang: cut at 37, cached
    at 421 of 451).  A prompt longer than ``budget`` past the hit is cut again and each cut
    is cached: every page.  With a buffer and a budget below the grid: nothing
    (:func:`prefill_never_tracked`)."""
    if prefill_never_tracked(grid, budget):
        return set()
    end, page = len(prompt), grid.page_size
    every_page = not grid.buffered or (budget is not None and end - hit > budget)
    ends = set(range(hit + page, end + 1, page)) if every_page else set(range(hit + grid.checkpoint_grid, end, grid.checkpoint_grid))
    if not every_page:
        for c in range(floor_to(hit, page) + page, end - grid.checkpoint_grid + 1, page):
            ends.add(c + floor_to(end - c, grid.checkpoint_grid))
    return {_prefix(prompt, n) for n in (floor_to(e, page) for e in ends) if hit < n <= end}


def observed_cut_stores(prompt: Key, chunks: Sequence[Any], grid: StrategyGrid) -> set[Key]:
    """The states a prefill SGLang was seen cutting may have stored, at the observed places
    only: each chunk's tracked checkpoint (buffered strategies, ``Prefill.track``) or,
    without a buffer, the request's own state where each cut fell (``prefix + extend``) and
    where the last chunk completed the prompt (a no_buffer prefill stores its end,
    :func:`conformance.checks.prefix_oracle.prefill_checkpoint_len`; measured on 0.5.23: a
    251-token prompt cut at 192 logs ``state_stored`` 192, then 251 after its last chunk,
    before its first token is out).  Nothing for a request SGLang did not cut."""
    if not any(c.cut for c in chunks):
        return set()
    ends = ({c.track for c in chunks if c.track is not None} if grid.buffered
            else {c.prefix + c.extend for c in chunks if c.cut or c.prefix + c.extend == len(prompt)})
    return {_prefix(prompt, n) for n in (floor_to(e, grid.page_size) for e in ends) if 0 < n <= len(prompt)}


def seen_cut_stores(prompt: Key, chunks: Sequence[Any], grid: StrategyGrid, branches: Iterable[int | None]) -> set[Key]:
    """The checkpoints a prefill SGLang was seen cutting stores for sure: each chunk as its
    scheduler ran it (``Prefill.prefix`` and ``extend``, scheduling decisions), the checkpoint
    placed by SGLang's rule for a chunk (:func:`prefill_checkpoint_len`), not by what SGLang
    claims it tracked (a bug that loses a checkpoint also loses the claim); kept where every
    branch point the request may have met puts it.  Nothing unless the chunks were cut, run
    back to back, and end at the prompt's end (a retracted or unfinished prefill)."""
    chunks = list(chunks)
    if not chunks or not any(c.cut for c in chunks) or chunks[-1].cut:
        return set()
    pos = chunks[0].prefix
    for c in chunks:
        if c.prefix != pos:
            return set()
        pos = c.prefix + c.extend
    if pos != len(prompt):
        return set()
    page, per_branch = grid.page_size, []
    for b in set(branches) or {None}:
        keys = set()
        for c in chunks:
            n = prefill_checkpoint_len(grid.strategy, c.prefix, c.prefix + c.extend, checkpoint_grid=grid.checkpoint_grid,
                                       chunk=grid.chunk, branching_seqlen=b)
            if n is not None and floor_to(n, page) > 0:
                keys.add(_prefix(prompt, floor_to(n, page)))
        per_branch.append(keys)
    return set.intersection(*per_branch)


def _boundary_step_may_follow(committed: int, grid: StrategyGrid) -> bool:
    """Lazy, every boundary allocation failing, overlap: the step after a finish at
    ``committed`` is a track boundary, which drops the kept checkpoint if it was prepared."""
    return grid.lazy_alloc_fail and grid.lookahead == 1 and (committed + 1) % grid.track_grid == 0


def finish_store(prompt: Key, output: Key, grid: StrategyGrid, untracked: frozenset[int] = frozenset()) -> Key | None:
    """The state a normally finished request inserts (``PrefixOracle.finish_insert_len``);
    ``untracked``: lengths its decode steps reached in a mixed forward, whose boundary SGLang
    does not track (the last boundary tracked outside one is inserted)."""
    seq = prompt + output
    committed = len(seq) - 1 if output else len(prompt)
    if committed <= 0:
        return None
    if not grid.buffered:
        n: int | None = committed
    elif _boundary_step_may_follow(committed, grid):
        n = None
    else:
        tracks = [t for t in decode_track_positions(len(prompt), committed, grid.track_grid) if t not in untracked]
        n = tracks[-1] if tracks else None
    if n is None or floor_to(n, grid.page_size) <= 0:
        return None
    return _prefix(seq, floor_to(n, grid.page_size))


def unprepared_boundary_finish_store(prompt: Key, output: Key, grid: StrategyGrid) -> Key | None:
    """The state a lazy request with every boundary allocation failing, under overlap, inserts
    at a finish one token before a track boundary when SGLang did NOT prepare the boundary
    step after it: its last tracked state, still in the keep slot (``finish_store`` says None,
    the case where the prepared step dropped it).  Whether that step was prepared depends on
    the scheduler's timing, so the oracle admits this key only when SGLang's tree was seen
    taking it.  None outside that case."""
    seq = prompt + output
    committed = len(seq) - 1 if output else len(prompt)
    if not (grid.buffered and committed > 0 and _boundary_step_may_follow(committed, grid)):
        return None
    tracks = decode_track_positions(len(prompt), committed, grid.track_grid)
    n = floor_to(tracks[-1], grid.page_size) if tracks else 0
    return _prefix(seq, n) if n > 0 else None


def in_flight_boundary_finish_store(prompt: Key, output: Key, grid: StrategyGrid) -> Key | None:
    """The state a buffered request finishing under overlap may insert when the step in flight
    at its finish crossed a track boundary (``committed + 1``, i.e. prompt + every output token,
    on the track grid): that step ran the last output token and tracked the state after it,
    and the finish inserted that state, one token past ``finish_store``'s.  Whether the step
    ran before the finish was processed depends on the scheduler's timing, so the oracle admits
    this key only when SGLang's tree was seen taking it.  None outside that case (and under
    lazy_alloc_fail, where that boundary's allocation fails:
    :func:`unprepared_boundary_finish_store`)."""
    seq = prompt + output
    n = len(seq)
    if not (grid.buffered and output and grid.lookahead == 1 and not grid.lazy_alloc_fail and n % grid.track_grid == 0):
        return None
    n = floor_to(n, grid.page_size)
    return _prefix(seq, n) if n > 0 else None


def possible_finish_stores(prompt: Key, output: Key, grid: StrategyGrid, *, extra: int = 2) -> set[Key]:
    """Every state an irregular finish (abort, a session's hand-over) may insert: any decode
    track position up to ``extra`` tokens past what was returned, or (no_buffer) any
    committed length in that window."""
    seq = prompt + output
    committed = len(seq) - 1 if output else len(prompt)
    out: set[Key] = set()
    if not grid.buffered:
        for n in range(max(committed - 1, 1), committed + extra + 1):
            if floor_to(n, grid.page_size) > 0 and n <= len(seq):
                out.add(_prefix(seq, floor_to(n, grid.page_size)))
        return out
    for n in decode_track_positions(len(prompt), committed + extra, grid.track_grid):
        if n <= len(seq):
            out.add(_prefix(seq, floor_to(n, grid.page_size)))
    return out


def trie_size(seqs: Iterable[Key]) -> int:
    """Distinct token prefixes of ``seqs`` (the tokens a radix tree holding them keeps)."""
    ordered = sorted(set(seqs))
    total, prev = 0, ()
    for s in ordered:
        total += len(s) - _common(s, prev)
        prev = s
    return total


def may_have_evicted(*, states: int, max_in_flight: int, sessions: int, strategy: Strategy | str, mamba_total: float | None,
                     tokens: int, reserved_tokens: int, kv_total: float | None) -> bool:
    """Could the pools have had to evict since the last flush?  A bound: every state ever
    stored plus what the most requests ever in flight hold, against each pool's size (an
    unknown size counts as 'could')."""
    slots = states + (max_in_flight + sessions) * strategy_named(strategy).mamba_slots_per_request
    if mamba_total is None or slots + 1 > mamba_total:
        return True
    return kv_total is None or tokens + reserved_tokens > kv_total
