"""The programs' hit oracle: a request asking for input logprobs from token ``s`` makes SGLang
match at most ``s`` tokens -- its hit *and* the full-KV match its branch point is floored
from (``MambaComponent.finalize_match_result_in_tree_core``: ``mamba_branching_seqlen`` is
the full-KV hit floored to the checkpoint grid).  No server.

The case that raised it (``fuzz --seed 2`` on the standard cell
``qwen3-next-80b-extra_buffer-p1-t256-eviction-slru``, SGLang 0.5.23): a burst stored the
checkpoint 448 of root[:449]; r6 = root[:449] + 2 tokens with ``logprob_start_len`` 225 hit
0 (its match capped at 225) and tracked its branch point 192; r8 = root[:255] + 64 tokens
then hit 192.  The oracle computed r6's branch point from the uncapped match (448: no
branch point) and allowed r8 only 0.  Not an SGLang bug, not SLRU: the oracle's model.
"""

from __future__ import annotations

from conformance.checks.hit_bounds import StrategyGrid, branch_point
from conformance.programs.evidence import COUNTERS, Evidence
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.matrix.strategy import strategy_named

EVICTIONS, CUTS = COUNTERS["evictions"], COUNTERS["prefill_cuts"]
GRID = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
ROOT = tuple(range(3, 452))  # 449 tokens


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int, **options) -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), dict(options), sent, done, response=resp)


def _book(r6_logprob_start: int | None, r8_cached: int) -> tuple[HitBook, list[Served]]:
    ev = Evidence()
    ev.reset(1, {EVICTIONS: 0.0, CUTS: 0.0})
    for seq in (3, 5, 7):
        ev.note(seq, {EVICTIONS: 0.0, CUTS: 0.0})
    options = {} if r6_logprob_start is None else {"return_logprob": True, "logprob_start_len": r6_logprob_start}
    r1 = _served("r1", ROOT + (900,), (901,), 0, 2, 3)
    r6 = _served("r6", ROOT + (902, 903), (904,), 0 if r6_logprob_start is not None else 448, 4, 5, **options)
    r8 = _served("r8", ROOT[:255] + tuple(range(1000, 1064)), (905,), r8_cached, 6, 7)
    book = HitBook(GRID, Limits(context_len=4096, kv_total=8192, mamba_total=48, prefill_budget=None), ev)
    for s in (r1, r6, r8):
        book.add(s)
    book.ready([])
    return book, [r1, r6, r8]


def test_a_logprob_capped_match_tracks_its_branch_point_below_the_cap() -> None:
    """What SGLang did passes: r6 (logprobs from 225) hit 0 and stored its branch point 192,
    which r8 hits."""
    book, (r1, r6, r8) = _book(225, 192)
    assert [book.judge(s) for s in (r1, r6, r8)] == [None, None, None]
    assert branch_point(r6.input_ids, r1.input_ids, GRID, 0, 225) == 192
    assert branch_point(r6.input_ids, r1.input_ids, GRID, 0) == 448  # uncapped: what the oracle used


def test_without_the_cap_no_branch_point_and_192_is_refused() -> None:
    """Not vacuous: r6 without logprobs hits 448 and tracks no branch point; r8's 192 is then
    refused (nothing stored a state at 192)."""
    book, (r1, r6, r8) = _book(None, 192)
    assert book.judge(r1) is None and book.judge(r6) is None
    problem = book.judge(r8)
    assert problem and "cached_tokens 192, the prefix oracle allows [0]" in problem
