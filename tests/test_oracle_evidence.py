"""Issue 26, findings 1-6: the programs' oracle relaxes only on evidence seen in the same
run, compares every request it can, and a verdict that compared nothing is red.

Each test shows the old behaviour (a book without evidence judges on the bounds alone;
the old counter check was switched off by an abort) admitting what the new one refuses,
and the new one still admitting the same hit when the evidence is there.  No server.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from conformance.checks.differential import Cold, ServedLogprobs, Tolerance, differential_problems
from conformance.checks.hit_bounds import StrategyGrid
from conformance.errors import KitError
from conformance.programs.evidence import COUNTERS, Evidence, refuse_missing
from conformance.programs.explore import Exploration
from conformance.programs.oracle import HitBook, Limits, Served, counter_problems
from conformance.programs.program import Burst, SendOptions, Program, Root, Send, Turn
from conformance.programs.resolve import Resolver
from conformance.programs.runner import RunStats
from conformance.programs.strategies import GenSpec, programs
from conformance.suites.programs.test_programs import programs_verdict
from conformance.reference.metrics import render_metrics
from conformance.matrix.strategy import strategy_named

GRID = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
SPEC = GenSpec(vocab_size=500, chunk=64, checkpoint_grid=64, track_grid=256, page_size=1, context_len=4096)
EVICTIONS, CUTS = COUNTERS["evictions"], COUNTERS["prefill_cuts"]


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int, **kw) -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), {}, sent, done, response=resp, **kw)


def _evidence(*scrapes: tuple[int, float, float]) -> Evidence:
    ev = Evidence()
    ev.reset(0, {EVICTIONS: 0.0, CUTS: 0.0})
    for seq, evictions, cuts in scrapes:
        ev.note(seq, {EVICTIONS: evictions, CUTS: cuts})
    return ev


# ------------------------------------------------------------------ finding 1: eviction
def _lost_prefix_book(evidence: Evidence | None) -> tuple[HitBook, Served]:
    """A stored 320-token prefix, then a burst of ten other roots on a 3-slot pool (the
    bound says 'may have evicted' from then on), then the prefix again with hit 0."""
    book = HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=3), evidence)
    prompt = tuple(range(10, 330))
    first = _served("a", prompt, (1, 2), 0, 1, 2)
    burst = [_served(f"b.{i}", tuple(range(1000 + 400 * i, 1100 + 400 * i)), (5,), 0, 3, 4 + i) for i in range(10)]
    again = _served("c", prompt + (7,) * 5, (3,), 0, 20, 21)
    for s in (first, *burst, again):
        book.add(s)
    book.note_load(10, 0)
    book.ready([])
    for s in (first, *burst):
        assert book.judge(s) is None
    return book, again


def test_a_lost_prefix_needs_an_eviction_seen_after_it_was_stored() -> None:
    book, again = _lost_prefix_book(None)  # the old oracle: the bound alone
    assert book.judge(again) is None  # a lost hit passes unseen for the rest of the program
    book, again = _lost_prefix_book(_evidence((5, 0, 0), (22, 0, 0)))  # SGLang's eviction path never ran
    problem = book.judge(again)
    assert problem and "cached_tokens 0" in problem and "eviction counter did not move" in problem
    book, again = _lost_prefix_book(_evidence((1, 1, 0), (5, 1, 0), (22, 1, 0)))  # an eviction, but before the prefix was stored
    assert "eviction counter did not move" in book.judge(again)
    book, again = _lost_prefix_book(_evidence((5, 0, 0), (22, 2, 0)))  # evictions after it was stored
    assert book.judge(again) is None and again.permission == "eviction"


def test_the_eviction_bound_still_rules_out_evictions_it_can_rule_out() -> None:
    """Evidence is a second condition, never a wider one: a pool that never filled keeps
    the lost hit a finding whatever the counter says."""
    book = HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=1000), _evidence((22, 5, 0)))
    prompt = tuple(range(10, 330))
    first, again = _served("a", prompt, (1, 2), 0, 1, 2), _served("c", prompt + (7,), (3,), 0, 3, 4)
    for s in (first, again):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None
    assert "the pools never had to evict" in book.judge(again)


# ------------------------------------------------------------------ finding 2: cut prefill
def _cut_burst(evidence: Evidence | None) -> list[Served]:
    grid = StrategyGrid(64, 1, 256, strategy_named("extra_buffer_lazy"))
    book = HitBook(grid, Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=4096), evidence)
    prompt = tuple(range(10, 331))
    members = [_served(f"b.{i}", prompt + (1000 + i,) * 65, (), 0, 1, 2 + i) for i in range(20)]
    members[12].response["meta_info"]["cached_tokens"] = 192
    for m in members:
        book.add(m)
    book.ready([])
    members[0].judge_problem = [book.judge(m) for m in members]  # type: ignore[attr-defined]
    return members


def test_a_hit_at_a_cut_needs_a_cut_seen_in_sglangs_scheduling() -> None:
    old = _cut_burst(None)  # the budget bound alone: any page may be a cut
    assert not any(old[0].judge_problem)
    unseen = _cut_burst(_evidence((30, 0, 0)))  # the scheduler never cut a prefill
    assert any(p and "cached_tokens 192" in p for p in unseen[0].judge_problem)
    seen = _cut_burst(_evidence((30, 0, 1)))
    assert not any(seen[0].judge_problem)
    assert seen[12].permission == "cut_prefill" and seen[0].permission == ""


def test_an_overlapping_store_is_counted_as_concurrent() -> None:
    book = HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=1000), _evidence())
    prompt = tuple(range(10, 330))
    x, y = _served("x", prompt, (1,), 0, 1, 4), _served("y", prompt + (7,), (1,), 320, 2, 3)
    for s in (x, y):
        book.add(s)
    book.ready([])
    assert book.judge(y) is None and book.judge(x) is None
    assert y.permission == "concurrent" and x.permission == ""


# ------------------------------------------------------------------ finding 3: exact mode compares everything
def test_exact_mode_asks_logprobs_for_sends_bursts_and_turns() -> None:
    program = Program(forest=(tuple(range(5, 200)),), steps=())
    r = Resolver(program, GRID, Limits(context_len=4096), exact=True, tag="t")
    _, _, send, _ = r.send(Send("a", Root(0, 100), (), 3, SendOptions()), {})
    _, burst = r.burst(Burst("b", Root(0, 100), ((1,), (2,)), 1))
    r.open("s", False)
    _, turn, _ = r.turn(Turn("s", "t1", (4, 5), 2), "server-sid", {})
    for payload in (send, burst, turn):  # before: only a send whose options asked had any
        assert payload["return_logprob"] is True and payload["top_logprobs_num"] >= 5


def test_a_mixed_chunk_server_gets_bursts_it_can_mix() -> None:
    """SGLang mixes a prefill into running decodes only when no request returns logprobs:
    with logprobs on every burst, a programs run on a mixed-chunk cell never mixed (the
    nightly run missed mixed_chunk_track_dropped after 244 programs)."""
    program = Program(forest=(tuple(range(5, 200)),), steps=())
    mixed = Resolver(program, GRID, Limits(context_len=4096), exact=True, tag="t", mixed=True)
    _, burst = mixed.burst(Burst("b", Root(0, 100), ((1,), (2,)), 1))
    assert "return_logprob" not in burst and "top_logprobs_num" not in burst
    _, _, send, _ = mixed.send(Send("a", Root(0, 100), (), 3, SendOptions()), {})
    assert send["return_logprob"] is True  # the follow-ups that judge the mixed checkpoints still ask


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(SPEC))
def test_every_generated_request_decodes_at_least_one_token(p: Program) -> None:
    """Before, bursts and sends drew max_new 0: nothing of such an answer was compared."""
    news = [s.max_new for s in p.steps if isinstance(s, (Send, Burst, Turn))]
    assert all(n >= 1 for n in news), news


def test_missing_output_logprobs_are_a_finding() -> None:
    cold = Cold(1, ((-0.1, 7),), (((-0.1, 7), (-2.5, 9)),))
    none = ServedLogprobs(())
    tol = Tolerance.for_mode(True)
    assert differential_problems([1], [7], none, cold, tol) == []  # the old call: the token alone
    assert "served 0 output logprobs for 1 output tokens" in differential_problems([1], [7], none, cold, tol, expect_logprobs=True)[0]


# ------------------------------------------------------------------ finding 4: reuse counters with an abort
def test_an_abort_bounds_the_reuse_counters_instead_of_switching_them_off() -> None:
    # before: any abort in the window set both deltas to None, i.e. counter_problems(320, None, None) == []
    assert counter_problems(320, None, None) == []
    assert "grew by 0" in counter_problems(320, 0.0, None, aborted_max=100)[0]  # a lost count is still seen
    assert "grew by 900" in counter_problems(320, 900.0, None, aborted_max=100)[0]
    assert counter_problems(320, 380.0, 320, aborted_max=100) == []  # the aborted one counted 60, or nothing


# ------------------------------------------------------------------ finding 5: missing gauges
def test_missing_oracle_gauges_are_a_kit_error_on_real_sglang() -> None:
    partial = {"hybrid_conformance:mamba_total": 48.0, EVICTIONS: 0.0}
    with pytest.raises(KitError, match=r"lacks hybrid_conformance:prefill_cuts_total"):
        refuse_missing(partial, target="sglang-cpu")
    with pytest.raises(KitError, match=r"lacks hybrid_conformance:mamba_total"):
        refuse_missing({EVICTIONS: 0.0, CUTS: 0.0}, target="sglang-cpu")
    refuse_missing({**partial, CUTS: 0.0}, target="sglang-cpu")
    late = iter([{**partial, CUTS: 0.0}])
    refuse_missing(partial, target="sglang-cpu", attempts=[lambda: next(late)])  # published at the first idle moment
    refuse_missing({}, target="reference")  # a target without the kit's plugins: judged on the bounds


def test_the_reference_server_exports_the_evidence_counters() -> None:
    text = render_metrics({"evictions": 3, "mamba_total": 48}, "m")
    assert f'{EVICTIONS}{{model_name="m"}} 3.0' in text and f'{CUTS}{{model_name="m"}} 0.0' in text


def test_evidence_windows() -> None:
    ev = _evidence((5, 1, 0), (9, 4, 0))
    assert ev.grew("evictions", 0, 5) is True and ev.grew("evictions", 5, 9) is True
    assert ev.grew("evictions", 9, 12) is False  # nothing after the last scrape
    assert ev.grew("prefill_cuts", 0, 9) is False
    blind = Evidence()
    blind.reset(0, {})
    assert blind.grew("evictions", 0, 5) is None


# ------------------------------------------------------------------ finding 6: a verdict that compared nothing
def test_a_verdict_that_compared_nothing_is_red() -> None:
    refused_only = Exploration(examples=3, seconds=1.0, stats=[RunStats(requests=1, compared_tokens=0)])
    v = programs_verdict(refused_only, budget="premerge", seed=0)
    assert v.status == "fail" and "compared no token" in v.reason  # before: pass
    judged = Exploration(examples=3, seconds=1.0, stats=[RunStats(requests=4, compared_tokens=9, permissions={"eviction": 1}),
                                                          RunStats(requests=2, compared_tokens=3, permissions={"eviction": 2, "concurrent": 1})])
    v = programs_verdict(judged, budget="premerge", seed=0)
    assert v.status == "pass" and v.metrics["permitted_eviction"] == 3 and v.metrics["permitted_concurrent"] == 1
    json.dumps(v.to_json())
