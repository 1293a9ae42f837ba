"""The programs on a strip-thinking cell: reasoning requests drawn, sent with
``require_reasoning``, and judged by what SGLang keeps of them (conformance/checks/strip_thinking.py)."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings

from conformance.checks.hit_bounds import StrategyGrid, finish_store
from conformance.checks.strip_thinking import REASONING_FIELD, finish_store_of, possible_finish_stores_of, reasoning_finish_store
from conformance.programs.evidence import COUNTERS, Evidence
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.programs.program import SendOptions, Program, Root, Send, step_from_json
from conformance.programs.resolve import Resolver
from conformance.programs.strategies import GenSpec, programs
from conformance.matrix.strategy import strategy_named

BUFFERED = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
NO_BUFFER = StrategyGrid(64, 1, 256, strategy_named("no_buffer"))
PROMPT = tuple(range(10, 260))  # 250 tokens: a 16-token decode crosses the track boundary at 256
OUTPUT = tuple(range(600, 616))
SPEC = GenSpec(vocab_size=500, chunk=64, checkpoint_grid=64, track_grid=256, page_size=1, context_len=4096)


def test_a_reasoning_finish_is_keyed_by_its_prompt() -> None:
    assert len(finish_store(PROMPT, OUTPUT, BUFFERED)) == 256  # a plain finish: the decode track past the prompt
    assert reasoning_finish_store(PROMPT, BUFFERED) is None  # every decode track lies past the prompt key
    assert reasoning_finish_store(PROMPT, NO_BUFFER) == PROMPT  # the live state, under the prompt key
    assert finish_store_of(PROMPT, OUTPUT, BUFFERED, {REASONING_FIELD: True}) is None
    assert finish_store_of(PROMPT, OUTPUT, BUFFERED, {}) == finish_store(PROMPT, OUTPUT, BUFFERED)
    assert possible_finish_stores_of(PROMPT, OUTPUT, NO_BUFFER, {REASONING_FIELD: True}) == {PROMPT}
    assert all(len(k) > len(PROMPT) for k in possible_finish_stores_of(PROMPT, OUTPUT, BUFFERED, {}))
    assert reasoning_finish_store(PROMPT, dataclasses.replace(NO_BUFFER, page_size=64)) == PROMPT[:192]


def _book_judges_the_follow_up(options: dict) -> str | None:
    """A request on the prompt, then the prompt + its output + 5 hitting only the prefill
    checkpoint (192): lost unless the first request reasoned (nothing evicted)."""
    ev = Evidence()
    ev.reset(0, {COUNTERS["evictions"]: 0.0, COUNTERS["prefill_cuts"]: 0.0})
    ev.note(9, {COUNTERS["evictions"]: 0.0, COUNTERS["prefill_cuts"]: 0.0})
    book = HitBook(BUFFERED, Limits(context_len=100000, kv_total=1e6, mamba_total=1000), ev)
    fin = {"type": "length"}
    first = Served("a", 0, PROMPT, len(OUTPUT), options, 1, 2,
                   response={"output_ids": list(OUTPUT), "meta_info": {"cached_tokens": 0, "prompt_tokens": len(PROMPT), "finish_reason": fin}})
    follow_ids = PROMPT + OUTPUT + (7,) * 5
    follow = Served("c", 1, follow_ids, 1, {}, 3, 4,
                    response={"output_ids": [1], "meta_info": {"cached_tokens": 192, "prompt_tokens": len(follow_ids), "finish_reason": fin}})
    for s in (first, follow):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None
    return book.judge(follow)


def test_the_oracle_keeps_only_the_prompt_of_a_reasoning_request() -> None:
    assert _book_judges_the_follow_up({REASONING_FIELD: True}) is None
    plain = _book_judges_the_follow_up({})  # the same hit after a plain request: its decode-track state was lost
    assert plain and "cached_tokens 192" in plain


def test_a_reasoning_send_asks_for_reasoning_and_round_trips() -> None:
    r = Resolver(Program(forest=(tuple(range(3, 600)),), steps=()), BUFFERED, Limits(context_len=4096), exact=True, tag="t")
    _, _, payload, opts = r.send(Send("r1", Root(0, 100), (), 4, SendOptions(reasoning=True)), {})
    assert payload[REASONING_FIELD] is True and opts[REASONING_FIELD] is True
    _, _, payload, opts = r.send(Send("r2", Root(0, 100), (), 4, SendOptions()), {})
    assert REASONING_FIELD not in payload and REASONING_FIELD not in opts
    step = Send("r3", Root(0, 10), (), 2, SendOptions(reasoning=True))
    assert step_from_json(step.to_json(), "t").options.reasoning is True


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(SPEC))
def test_a_cell_without_strip_thinking_draws_no_reasoning_request(p: Program) -> None:
    assert not any(getattr(getattr(s, "options", None), "reasoning", False) for s in p.steps)


def test_a_strip_thinking_cell_draws_reasoning_requests() -> None:
    from hypothesis import find

    spec = dataclasses.replace(SPEC, reasoning_requests=True)
    found = find(programs(spec), lambda p: any(getattr(getattr(s, "options", None), "reasoning", False) for s in p.steps),
                 settings=settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None))
    assert found.steps
