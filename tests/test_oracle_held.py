"""Issue 43, piece 3: the hit SGLang owed a request is the longest state its tree held for
the prompt at the admission (the observe plugin's per-node ``state_stored`` /
``state_evicted`` records); a lower ``cached_tokens`` is ``hit_below_held``, settled by the
records, never by a permission, and excused only where SGLang's eviction walk freed that
very state.  Each test is a hit today's oracle passed (shown in the docstring) that the
records refuse, and the same program with the right hit passing.  No server."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.checks.hit_bounds import StrategyGrid
from conformance.matrix.strategy import strategy_named
from conformance.programs.evidence import COUNTERS, Evidence, RequestLog
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.sglang_plugins.token_digest import token_digest

GRID = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
T = tuple(range(10, 700))
EVICTIONS, CUTS = COUNTERS["evictions"], COUNTERS["prefill_cuts"]


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int, kind: str = "send") -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), {}, sent, done, response=resp, kind=kind)


def _prefill(rid: str, extend: int, track: int, prefix: int = 0) -> dict:
    return {"ev": "prefill", "rid": rid, "prefix": prefix, "extend": extend, "cut": False, "track": track}


def stored(tokens: tuple) -> dict:
    return {"ev": "state_stored", "len": len(tokens), "key": token_digest(tokens)}


def freed(tokens: tuple, by: str = "walk") -> dict:
    return {"ev": "state_evicted", "len": len(tokens), "key": token_digest(tokens), "by": by}


def _book(tmp_path: Path, records: list[dict], *, mamba_total: float = 1000, evictions: float = 0.0, path_cap: int | None = None) -> HitBook:
    path = tmp_path / "cell.requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"ev": "start", "state_evictions": True}, *records)))
    log = RequestLog(path)
    ev = Evidence(log)
    ev.reset(0, {EVICTIONS: 0.0, CUTS: 0.0})
    ev.note(100, {EVICTIONS: evictions, CUTS: 0.0})
    return HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=mamba_total, path_cap=path_cap), ev)


def _judge(book: HitBook, *served: Served) -> list:
    for s in served:
        book.add(s)
    book.note_load(max(1, sum(1 for s in served if s.kind == "burst")), 0)
    book.ready([])
    return [book.judge(s) for s in served]


# ------------------------------------------------------------------ a repeat of a stored prompt
def _repeat(tmp_path: Path, hit: int) -> tuple[object, Served]:
    """r0 (T[:300] + 100 others) stores its 384 checkpoint; a (T[:320]) meets r0's branch at
    256, so its checkpoint lies at 256 or 320 by what SGLang saw -- the model cannot tell, and
    gave a no certain store; SGLang's records say 256.  Then c, a's prompt + 5 tokens,
    answered alone with ``hit``."""
    p0 = T[:300] + tuple(range(2000, 2100))
    r0, a = _served("r0", p0, (1,), 0, 1, 2), _served("a", T[:320], (1,), 0, 3, 4)
    c = _served("c", T[:320] + (7,) * 5, (1,), hit, 5, 6)
    book = _book(tmp_path, [_prefill("r0", 400, 384), stored(p0[:384]), _prefill("a", 320, 256), stored(T[:256]), _prefill("c", 325, 320, prefix=hit)])
    *_, problem = _judge(book, r0, a, c)
    return problem, c


def test_a_repeat_of_a_stored_prompt_answered_with_a_shorter_hit_is_a_finding(tmp_path: Path) -> None:
    """Today's oracle: the candidate branch points always include "none met", so a's
    checkpoint is never certain and c's 0 passed as explained by a certain store (the best
    certain being 0), with no eviction and nothing in flight."""
    problem, c = _repeat(tmp_path, 0)
    assert problem is not None and problem.kind == "hit_below_held"
    assert "cached_tokens 0: SGLang held a state of 256 tokens for this prompt and reused 0; nothing freed it" in problem
    assert c.expected == "exact"
    (tmp_path / "right").mkdir()
    ok, c = _repeat(tmp_path / "right", 256)
    # the right hit passes, settled by the records: no permission (today: "concurrent", though nothing overlapped)
    assert ok is None and c.permission == "" and c.model_permission == "concurrent" and c.expected == "exact"


# ------------------------------------------------------------------ a burst member's follow-up
def _burst_follow_up(tmp_path: Path, hit: int) -> object:
    """Four burst members of 365 tokens sharing T[:300]; each stores its checkpoint at 320
    (the model: at 256 or 320, by the branch points of the others).  Then a follow-up of
    member 0's prompt + output + 2 tokens, with ``hit``."""
    members = [_served(f"b.{i}", T[:300] + (1000 + i,) * 65, (1,), 0, 1, 2, kind="burst") for i in range(4)]
    follow = _served("f", members[0].input_ids + (1, 5, 5), (1,), hit, 3, 4)
    records = [r for m in members for r in (_prefill(m.rid, 365, 320), stored(m.input_ids[:320]))] + [_prefill("f", 368, 320, prefix=hit)]
    *_, problem = _judge(_book(tmp_path, records), *members, follow)
    return problem


def test_a_burst_members_follow_up_below_the_members_held_state_is_a_finding(tmp_path: Path) -> None:
    """Today's oracle: the member's checkpoint is only "maybe" (the other members may have
    met it first), so the follow-up's 0 passed; SGLang's records show the member's 320
    state stored and never freed."""
    problem = _burst_follow_up(tmp_path, 0)
    assert problem is not None and problem.kind == "hit_below_held" and "SGLang held a state of 320 tokens" in problem
    (tmp_path / "right").mkdir()
    assert _burst_follow_up(tmp_path / "right", 320) is None


# ------------------------------------------------------------------ eviction names the state it excuses
def _partial_free(tmp_path: Path, hit: int, *, by: str = "walk") -> tuple[object, Served]:
    """r1 (T[:300]) stores 256, r2 (T[:530], hitting it) stores 512; SGLang's eviction walk
    frees the 512 state (the pools were full, its counter grew); then c (T[:600]) with ``hit``."""
    r1, r2 = _served("r1", T[:300], (1,), 0, 1, 2), _served("r2", T[:530], (1,), 256, 3, 4)
    c = _served("c", T[:600], (1,), hit, 5, 6)
    records = [_prefill("r1", 300, 256), stored(T[:256]), _prefill("r2", 274, 512, prefix=256), stored(T[:512]),
               {"ev": "evict", "num_tokens_evicted": 256, "mamba_num_evicted": 1}, freed(T[:512], by), _prefill("c", 600 - hit, 576, prefix=hit)]
    *_, problem = _judge(_book(tmp_path, records, mamba_total=2, evictions=1.0), r1, r2, c)
    return problem, c


def test_a_partial_free_does_not_excuse_a_zero(tmp_path: Path) -> None:
    """Today's oracle: once anything was evicted, every stored length and 0 were allowed
    (``allowed_hits(evicted=True)``): with the 512 state freed and the 256 state held, a hit of
    0 passed as ``eviction``."""
    problem, _ = _partial_free(tmp_path, 0)
    assert problem is not None and problem.kind == "hit_below_held" and "SGLang held a state of 256 tokens" in problem
    (tmp_path / "256").mkdir()
    ok, c = _partial_free(tmp_path / "256", 256)  # the freed state excuses exactly its own shortfall
    assert ok is None and c.permission == "eviction" and c.expected == "exact"


def test_a_state_freed_outside_the_eviction_walk_excuses_nothing(tmp_path: Path) -> None:
    """A ``state_evicted`` record used to be any free the tree made, so a wrong free was its
    own evidence; the observe plugin now says what freed it."""
    problem, _ = _partial_free(tmp_path, 256, by="other")
    assert problem is not None and problem.kind == "hit_below_held"
    assert "freed it outside its eviction walk (by other)" in problem and problem.facts["freed"] == 512


def test_without_per_node_records_the_hit_is_bounded_and_says_why(tmp_path: Path) -> None:
    book = _book(tmp_path, [])
    book.evidence.requests.per_node = False
    a, c = _served("a", T[:300], (1,), 0, 1, 2), _served("c", T[:300] + (7,), (1,), 256, 3, 4)
    assert _judge(book, a, c) == [None, None]
    assert c.expected == "the server records no per-node states"
    no_log = HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=1000))
    c2 = _served("c", T[:300] + (7,), (1,), 256, 3, 4)
    assert _judge(no_log, _served("a", T[:300], (1,), 0, 1, 2), c2) == [None, None] and c2.expected == "no per-node records on this target"


def test_a_flush_forgets_every_state_the_tree_held(tmp_path: Path) -> None:
    """Seen on 0.5.23 (the first run of the new rule, lazy_alloc_fail cell): a program's first
    request was owed a 448 state a previous program stored before the flush that starts
    every program; the plugin now records the tree's reset."""
    p = T[:578]
    records = [_prefill("old", 578, 448), stored(p[:448]), {"ev": "tree_reset"}, _prefill("r1", 578, 448)]
    r1 = _served("r1", p, (1, 2), 0, 1, 2)
    assert _judge(_book(tmp_path, records), r1) == [None] and r1.expected == "exact"
    (tmp_path / "kept").mkdir()  # not vacuous: without the reset the same state is owed
    r1 = _served("r1", p, (1, 2), 0, 1, 2)
    (problem,) = _judge(_book(tmp_path / "kept", [r for r in records if r["ev"] != "tree_reset"]), r1)
    assert problem is not None and "SGLang held a state of 448 tokens" in problem
