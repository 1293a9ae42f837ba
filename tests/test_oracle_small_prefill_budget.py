"""The programs' hit oracle under a small ``--chunked-prefill-size`` (issue 25, axis
``chunked_prefill``), modelled from SGLang 0.5.23's code, and the evidence scrape that
judging a follow-up's base needs.

The case that raised it (standard cell ``qwen3-next-80b-extra_buffer-p1-t256-chunked_prefill-sub-chunk``,
``--chunked-prefill-size 32``, checkpoint grid 64): r1 (578 tokens) and r2 (577, same root)
sent together, r3 = r2's input and outputs (579).  SGLang reports ``cached_tokens`` 0 for
r3; the oracle demanded 576 as if r2's prefill had run in one extend.  It cannot have:
SGLang's PrefillAdder gives no request more than the budget in one extend, and
``_mamba_radix_cache_v2_req_prepare_for_extend`` tracks a checkpoint only in an extend of at
least one grid, so no prefill stores a state (SGLang warns so at start).  No server.
"""

from __future__ import annotations

from conformance.checks.hit_bounds import StrategyGrid, chunked_prefill_stores, cut_prefill_stores, prefill_must_be_cut, prefill_never_tracked

from conformance.programs.evidence import COUNTERS, Evidence
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.matrix.strategy import strategy_named

EVICTIONS, CUTS = COUNTERS["evictions"], COUNTERS["prefill_cuts"]
BUFFERED = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int) -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), {}, sent, done, response=resp)


def _evidence(*scrapes: tuple[int, float]) -> Evidence:
    ev = Evidence()
    ev.reset(1, {EVICTIONS: 0.0, CUTS: 0.0})
    for seq, cuts in scrapes:
        ev.note(seq, {EVICTIONS: 0.0, CUTS: cuts})
    return ev


def _finding_book(budget: int, r3_cached: int, evidence: Evidence) -> tuple[HitBook, list[Served]]:
    """The replayed program: r1 and r2 together, r3 after r2 (sequence numbers as recorded)."""
    root = tuple(range(3, 581))
    r1 = _served("r1", root, (900, 901), 0, 2, 4)
    r2 = _served("r2", root[:577], (902, 903), 0, 3, 5)
    r3 = _served("r3", root[:577] + (902, 903), (904, 905), r3_cached, 6, 7)
    book = HitBook(BUFFERED, Limits(context_len=4096, kv_total=8192, mamba_total=48, prefill_budget=budget), evidence)
    for s in (r1, r2, r3):
        book.add(s)
    book.ready([])
    return book, [r1, r2, r3]


def test_a_budget_below_the_grid_stores_no_prefill_checkpoint() -> None:
    """What SGLang did (r3 hit 0) passes, also when no scrape followed the answers (the
    recorded run: the counter read before r2 was sent stood in for one after it)."""
    book, (r1, r2, r3) = _finding_book(32, 0, _evidence())
    assert [book.judge(s) for s in (r1, r2, r3)] == [None, None, None]
    # the hit the old model demanded is now refused: no prefill can have stored 576
    book, (r1, r2, r3) = _finding_book(32, 576, _evidence((8, 40.0)))
    assert book.judge(r1) is None and book.judge(r2) is None
    problem = book.judge(r3)
    assert problem and "cached_tokens 576, the prefix oracle allows [0]" in problem


def test_a_budget_at_the_grid_still_demands_the_checkpoint_of_an_uncut_prefill() -> None:
    """Not vacuous: with the budget above the prompts, r2's prefill runs whole and its
    checkpoint at 576 is certain; 0 is a finding."""
    book, (r1, r2, r3) = _finding_book(4096, 0, _evidence((8, 0.0)))
    assert book.judge(r1) is None and book.judge(r2) is None
    problem = book.judge(r3)
    assert problem and "cached_tokens 0, the prefix oracle allows [576]" in problem


def test_cut_and_never_tracked_rules() -> None:
    assert prefill_must_be_cut(577, 0, 32) and not prefill_must_be_cut(577, 576, 32) and not prefill_must_be_cut(577, 0, None)
    assert prefill_never_tracked(BUFFERED, 32) and not prefill_never_tracked(BUFFERED, 64) and not prefill_never_tracked(BUFFERED, None)
    no_buffer = StrategyGrid(64, 1, 256, strategy_named("no_buffer"))
    assert not prefill_never_tracked(no_buffer, 32)  # without a buffer each cut caches its own state
    prompt = tuple(range(451))
    assert cut_prefill_stores(prompt, 0, BUFFERED, budget=32) == set()
    assert len(cut_prefill_stores(prompt, 0, no_buffer, budget=32)) == 451
    assert cut_prefill_stores(prompt, 0, BUFFERED, budget=128)  # at or above the grid the cut stores stay


def test_a_window_past_the_last_scrape_is_stale() -> None:
    ev = _evidence((5, 1.0))
    assert not ev.stale(5) and not ev.stale(3) and ev.stale(6)


def _alone_book(budget: int, follow_cached: int) -> tuple[HitBook, list[Served]]:
    """A 300-token prompt prefilled alone on a server that cuts at ``budget``, then a
    follow-up sharing 290 of its tokens."""
    prompt = tuple(range(3, 303))
    a = _served("a", prompt, (900,), 0, 2, 3)
    b = _served("b", prompt[:290] + (7, 8, 9), (901,), follow_cached, 4, 5)
    book = HitBook(BUFFERED, Limits(context_len=4096, kv_total=8192, mamba_total=48, prefill_budget=budget), _evidence((3, 3.0), (5, 3.0)))
    for s in (a, b):
        book.add(s)
    book.ready([])
    return book, [a, b]


def test_a_prefill_cut_alone_stores_each_chunks_checkpoint_for_sure() -> None:
    """Off the grid (96, grid 64) SGLang tracks 64, 160, 256 (each chunk from its own start):
    the follow-up must hit 256 or more; below, a lost checkpoint is a finding, not a cut."""
    assert chunked_prefill_stores(tuple(range(300)), 0, BUFFERED, 96) == {tuple(range(n)) for n in (64, 160, 256)}
    assert chunked_prefill_stores(tuple(range(300)), 0, BUFFERED, 32) == set()
    book, (a, b) = _alone_book(96, 256)
    assert book.judge(a) is None and book.judge(b) is None
    for lost in (0, 160):
        book, (a, b) = _alone_book(96, lost)
        assert book.judge(a) is None
        assert f"cached_tokens {lost}, the prefix oracle allows [256, " in (book.judge(b) or "")  # and any later page a cut may hold
    book, (a, b) = _alone_book(32, 0)  # below the grid nothing was stored
    assert book.judge(a) is None and book.judge(b) is None
