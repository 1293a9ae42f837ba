"""Request programs without a server: the file format, the generator's validity, budgets,
and the pure checks the oracle is built from (each shown failing on a seeded defect and
refusing to pass vacuously)."""

from __future__ import annotations

from dataclasses import replace
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from conformance.checks.differential import Cold, Difference, ServedLogprobs, Tolerance, differential_problems
from conformance.checks.hit_bounds import (
    Prefix, StrategyGrid, allowed_hits, branch_candidates, cut_prefill_stores, finish_store, key_limit, may_have_evicted, possible_finish_stores, prefill_stores, trie_size,
)
from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError
from conformance.programs.explore import parse_budget
from conformance.programs.oracle import (
    HitBook, Limits, Served, answer_problems, counter_problems, idle_problems, lazy_checkpoint_may_drop, log_cached_tokens, retraction_allowance,
)
from conformance.programs.program import After, Burst, Gate, SendOptions, Program, Root, Send, Stop, Turn, load_program, program_from_json
from conformance.programs.resolve import cut_position
from conformance.programs.runner import difference_finding
from conformance.programs.strategies import GenSpec, programs
from conformance.matrix.strategy import strategy_named

SPEC = GenSpec(vocab_size=500, chunk=64, checkpoint_grid=64, track_grid=256, page_size=1, context_len=4096)
GRID = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))


# ------------------------------------------------------------------ the file format
def test_program_json_round_trip(tmp_path: Path) -> None:
    p = Program(
        forest=((3, 4, 5, 6), (4, 9)),
        steps=(
            Send("r1", Root(0, 3), (7,), 4, SendOptions(True, "half", 3, False, Stop("r0", 2, "text")), True, 1, Gate("r0", 2)),
            Send("r2", After("r1", "track-1"), (), 2),
            Burst("b3", Root(1, 2), ((1,), (2,)), 1),
            Turn("s1", "t4", (5, 6), 3, "t1", True, "half", True, True, None),
        ),
        cell={"id": "x"}, env={"HYBRID_CONFORMANCE_FAULT": "double_free"},
    )
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p.to_json()))
    assert load_program(path) == p
    assert "send rid=r1" in p.summary() and "<1 tokens>" in p.summary()


@pytest.mark.parametrize("bad, why", [
    ({"version": 2}, "not a version-1"),
    ({"version": 1, "steps": [{"op": "teleport"}]}, "unknown step"),
    ({"version": 1, "forest": [[1, -2]]}, "list of token ids"),
    ({"version": 1, "steps": [{"op": "send", "rid": "r", "base": {"rid": "x", "cut": "middle"}}]}, "unknown cut"),
    ({"version": 1, "steps": [{"op": "send"}]}, "bad send step"),
])
def test_bad_program_files_are_one_line(bad: dict, why: str) -> None:
    with pytest.raises(KitError, match=why) as err:
        program_from_json(bad)
    assert "\n" not in str(err.value)


def test_missing_program_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(KitError, match="does not exist"):
        load_program(tmp_path / "nope.json")


@pytest.mark.parametrize("text, examples, seconds", [("ci", 2, None), ("premerge", None, 25.0), ("40", 40, None), ("90s", None, 90.0), ("5m", None, 300.0)])
def test_budget_parses(text: str, examples: int | None, seconds: float | None) -> None:
    b = parse_budget(text)
    assert (b.examples, b.seconds) == (examples, seconds)


@pytest.mark.parametrize("text", ["", "0", "-3", "soon", "10h"])
def test_bad_budget_is_one_line(text: str) -> None:
    with pytest.raises(KitError, match="--budget"):
        parse_budget(text)


# ------------------------------------------------------------------ the generator
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(SPEC))
def test_generated_programs_are_valid_and_replayable(p: Program) -> None:
    assert program_from_json(json.loads(p.dumps())) == p
    sent: set[str] = set()
    open_sessions: dict[str, bool] = {}
    total_new = 0
    for step in p.steps:
        if isinstance(step, Send):
            assert step.rid not in sent
            if isinstance(step.base, After):
                assert step.base.rid in sent
            if step.gate:
                assert step.gate.rid in sent
            if step.abort_at is not None:
                assert step.stream
            total_new += 0 if step.overflow or step.max_new > 2 * SPEC.track_grid else step.max_new
            sent.add(step.rid)
        elif isinstance(step, Burst):
            assert 2 <= len(step.suffixes) <= SPEC.max_burst
            sent.update(step.rids())
        elif isinstance(step, Turn):
            assert step.sid in open_sessions
            if step.parent:
                assert not open_sessions[step.sid] and step.parent in sent
            sent.add(step.rid)
        elif step.op == "open":
            open_sessions[step.sid] = step.streaming
        elif step.op == "flush":
            assert True
    assert total_new <= SPEC.decode_budget + 12 * len(p.steps)
    assert all(len(r) <= SPEC.max_root_len for r in p.forest)


def test_interesting_lengths_straddle_the_grids() -> None:
    lengths = SPEC.interesting_lengths()
    for n in (63, 64, 65, 255, 256, 257, 511, 512, 513):
        assert n in lengths


@pytest.mark.parametrize("cut, expect", [("all", 600), ("prompt", 300), ("track", 512), ("track-1", 511), ("track+1", 513),
                                         ("chunk", 576), ("chunk+1", 577), ("half", 300)])
def test_cut_positions(cut: str, expect: int) -> None:
    assert cut_position(cut, 600, 300, GRID) == expect


def test_cut_before_any_boundary_falls_back_to_all() -> None:
    assert cut_position("track", 100, 50, GRID) == 100


# ------------------------------------------------------------------ differential check
def _cold(start: int, tokens: list[int], best: list[float], chosen: list[float]) -> Cold:
    return Cold(start, tuple(zip(chosen, tokens)), tuple(((b, 99), (c, t)) for b, c, t in zip(best, chosen, tokens)))


def test_differential_passes_identical_and_flags_a_flip() -> None:
    inp, out = [1, 2, 3], [7, 8]
    cold = _cold(3, out, [-0.1, -0.2], [-0.1, -0.2])
    assert differential_problems(inp, out, ServedLogprobs((-0.1, -0.2)), cold, Tolerance()) == []
    flipped = _cold(3, out, [-0.1, -0.2], [-0.1, -0.9])  # token 8 is not the cold argmax
    assert "not the cold argmax" in differential_problems(inp, out, ServedLogprobs(), flipped, Tolerance())[0]


def test_differential_accepts_a_near_tie_and_catches_a_drift() -> None:
    inp, out = [1], [7]
    tie = _cold(1, out, [-0.30000], [-0.30004])
    assert differential_problems(inp, out, ServedLogprobs(), tie, Tolerance()) == []
    drift = ServedLogprobs((-0.29,))
    assert "output logprob 0" in differential_problems(inp, out, drift, _cold(1, out, [-0.3], [-0.3]), Tolerance())[0]


def test_differential_checks_input_logprobs_and_alignment() -> None:
    cold = Cold(0, ((None, 1), (-1.0, 2), (-2.0, 3)), ((), ((-1.0, 2),), ((-2.0, 3),)))
    ok = ServedLogprobs(input_start=1, input=((-1.0, 2), (-2.0, 3)))
    assert differential_problems([1, 2, 3], [], ok, cold, Tolerance()) == []
    bad = ServedLogprobs(input_start=1, input=((-1.0, 2), (-2.5, 3)))
    assert "input logprob at position 2" in differential_problems([1, 2, 3], [], bad, cold, Tolerance())[0]
    short = Cold(3, (), ())
    assert "no logprob" in differential_problems([1, 2, 3], [9], ServedLogprobs(), short, Tolerance())[0]


def _sglang_cold(seq: list[int], start: int) -> dict:
    """A cold prefill's meta_info the way SGLang shapes it from ``logprob_start_len=start``:
    the first position has no row before it (None), then position p's logprob of seq[p]."""
    lp = lambda p: -0.01 * (p + 1)  # noqa: E731 - a deterministic stand-in for the model
    rows = [[None if p == start else lp(p), seq[p], None] for p in range(start, len(seq))]
    return {"input_token_logprobs": rows, "input_top_logprobs": [[] if r[0] is None else [[r[0], r[1], None]] for r in rows]}


@pytest.mark.parametrize("served_start", [None, 0, 1, 2])
def test_cold_side_starts_one_position_before_what_was_served(served_start: int | None) -> None:
    """The runner's cold computation starts one position early (SGLang's first row is None);
    starting where the served logprobs start would leave the first compared position empty."""
    from conformance.checks.differential import cold_from_meta, served_logprobs
    from conformance.programs.runner import cold_logprob_start

    inp, out = [5, 6, 7], [8, 9]
    seq = inp + out
    served_meta = {"output_token_logprobs": [[-0.01 * (len(inp) + k + 1), t, None] for k, t in enumerate(out)]}
    if served_start is not None:
        served_meta["input_token_logprobs"] = [[None if p == 0 else -0.01 * (p + 1), inp[p], None] for p in range(served_start, len(inp))]
    served = served_logprobs(served_meta, served_start)
    start = cold_logprob_start(len(inp), served_start)
    assert start == max(0, (len(inp) if served_start is None else served_start) - 1)
    assert differential_problems(inp, out, served, cold_from_meta(_sglang_cold(seq, start), start), Tolerance()) == []
    late = start + 1  # the misalignment the runner once had: every sglang-cpu cell failed on it
    problems = differential_problems(inp, out, served, cold_from_meta(_sglang_cold(seq, late), late), Tolerance())
    assert problems and ("misaligned" in problems[0] or "no input logprob" in problems[0]), problems


def test_a_burst_may_be_followed_by_a_request_on_one_members_prefix() -> None:
    """A burst's prefills are packed and cut together: what they stored is judged only if a
    later request comes back to a member (cut_batch_checkpoint_dropped went unseen without)."""
    from hypothesis import find

    def member_follow_up(p: Program) -> bool:
        for a, b in zip(p.steps, p.steps[1:]):
            if isinstance(a, Burst) and isinstance(b, Send) and isinstance(b.base, After) and b.base.rid in a.rids():
                return True
        return False

    got = find(programs(SPEC), member_follow_up, settings=settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck)))
    assert member_follow_up(got)


def test_cells_draw_different_programs_from_one_seed() -> None:
    from conformance.programs.explore import cell_seed

    a, b = cell_seed(0, "qwen3-next-80b-extra_buffer-p1-t256"), cell_seed(0, "qwen3-next-80b-no_buffer-p1-t0")
    assert a != b and a == cell_seed(0, "qwen3-next-80b-extra_buffer-p1-t256") and a != cell_seed(1, "qwen3-next-80b-extra_buffer-p1-t256")


def test_differential_non_exact_uses_topk_kl() -> None:
    tol = Tolerance.for_mode(False, kl_cap=0.005)
    cold = Cold(1, ((-0.1, 7),), (((-0.1, 7), (-2.5, 9)),))
    same = ServedLogprobs((-0.1,), (((-0.1, 7), (-2.5, 9)),))
    moved = ServedLogprobs((-0.6,), (((-0.6, 7), (-0.8, 9)),))
    assert differential_problems([1], [7], same, cold, tol) == []
    assert "top-k KL" in differential_problems([1], [7], moved, cold, tol)[0]


def test_one_walk_gives_the_verdict_and_the_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The programs' comparison measures a passing request's top-k KL and logprob gap in the
    walk that judges it (before: ``noise_samples`` and ``logprob_gap`` walked it again, every
    KL computed twice outside exact mode), with the same numbers ``noise_samples`` gives."""
    from conformance.checks import differential

    cold = Cold(1, ((-0.1, 7), (-0.2, 8)), (((-0.1, 7), (-2.5, 9)), ((-0.2, 8), (-1.9, 3))))
    served = ServedLogprobs((-0.12, -0.21), (((-0.12, 7), (-2.4, 9)), ((-0.21, 8), (-2.0, 3))))
    calls: list[int] = []
    real_kl = differential.topk_kl
    monkeypatch.setattr(differential, "topk_kl", lambda a, b: calls.append(1) or real_kl(a, b))
    for tol in (Tolerance.for_mode(False, kl_cap=0.05), Tolerance(True, logprob_atol=0.15)):
        calls.clear()
        seen = differential.compare_served([1], [7, 8], served, cold, tol)
        assert seen.problems == [] and len(calls) == 2  # one KL per compared token, once
        assert seen.topk_kls == pytest.approx(differential.noise_samples([1], [7, 8], served, cold)[0]) and all(k > 0 for k in seen.topk_kls)
        assert seen.logprob_gap == pytest.approx(0.02)
        # the greedy tie's noise too: the largest flip margin, as noise_samples measures it (token 0: top two moved 0.02 + 0.1 apart)
        assert seen.flip_margin == pytest.approx(max(differential.noise_samples([1], [7, 8], served, cold)[1])) == pytest.approx(0.12)
    bad = differential.compare_served([1], [7, 8], served, cold, Tolerance(True, logprob_atol=0.01))
    assert "output logprob 0" in bad.problems[0]


# ------------------------------------------------------------------ hit bounds
def test_allowed_hits_concurrent_and_evicted() -> None:
    t = tuple(range(300))
    certain, maybe = {t[:64]}, {t[:128], t[:256], (9,) * 64}
    assert allowed_hits(t, certain, maybe, limit=299, evicted=False) == {64, 128, 256}
    assert allowed_hits(t, certain, set(), limit=299, evicted=False) == {64}
    assert allowed_hits(t, certain, set(), limit=299, evicted=True) == {0, 64}
    assert allowed_hits(t, {t[:299]}, set(), limit=key_limit(300, 1, logprob_start=100), evicted=False) == {0}


def test_key_limit_pages_and_logprob_start() -> None:
    assert key_limit(300, 64) == 256
    assert key_limit(300, 1, logprob_start=10) == 10
    assert key_limit(1, 1) == 0


def test_stores_follow_the_prefix_oracle() -> None:
    """hit_bounds' stores agree with PrefixOracle.record_request for a lone request."""
    for strategy, page in (("no_buffer", 1), ("extra_buffer", 1), ("extra_buffer", 64), ("extra_buffer_lazy", 1)):
        g = StrategyGrid(64, page, 256, strategy_named(strategy))
        oracle = PrefixOracle(strategy, 64, page, 256)
        prompt, out = tuple(range(5, 300)), tuple(range(1000, 1230))
        oracle.record_request(prompt, out)
        mine = prefill_stores(prompt, {0}, {None}, g) | {finish_store(prompt, out, g)} - {None}
        assert mine == set(oracle.stored_keys()), strategy


def test_branch_candidates_and_irregular_finishes() -> None:
    prompt = tuple(range(400))
    other = prompt[:200] + (9,) * 100
    assert branch_candidates(prompt, {other}, GRID, hit=0) == {None, 192}
    assert prefill_stores(prompt, {0}, {None, 192}, GRID) == {prompt[:384], prompt[:192]}
    out = tuple(range(5000, 5130))
    assert possible_finish_stores(prompt, out, GRID) == {(prompt + out)[:512]}


def test_trie_and_eviction_bound() -> None:
    assert trie_size([(1, 2, 3), (1, 2, 4), (5,)]) == 5
    common = dict(max_in_flight=2, sessions=0, strategy="extra_buffer", tokens=100, reserved_tokens=10, kv_total=1000.0)
    assert not may_have_evicted(states=10, mamba_total=66.0, **common)
    assert may_have_evicted(states=60, mamba_total=66.0, **common)
    assert may_have_evicted(states=1, mamba_total=None, **common)


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int, **kw) -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), {}, sent, done, response=resp, **kw)


def test_hitbook_sequential_exact_and_concurrent_bounds() -> None:
    limits = Limits(context_len=100000, kv_total=1e6, mamba_total=1000)
    prompt = tuple(range(10, 330))
    book = HitBook(GRID, limits)
    first = _served("a", prompt, (1, 2), 0, 1, 2)
    follow = _served("b", prompt + (7,) * 5, (3,), 320, 3, 4)
    wrong = _served("c", prompt + (8,) * 5, (3,), 256, 5, 6)
    for s in (first, follow, wrong):
        book.add(s)
    assert [s.rid for s in book.ready([])] == ["a", "b", "c"]
    assert book.judge(first) is None
    assert book.judge(follow) is None
    assert "allows [320]" in book.judge(wrong)
    # overlapping requests: either order is allowed
    book = HitBook(GRID, limits)
    x = _served("x", prompt, (1,), 0, 1, 4)
    y = _served("y", prompt + (7,), (1,), 320, 2, 3)
    for s in (x, y):
        book.add(s)
    assert book.ready([3]) == []  # something sent before their answers is still running
    assert book.judge(y) is None and book.judge(x) is None


def test_hitbook_streaming_turn_may_hold_the_lookahead_token_only_under_overlap() -> None:
    """A streaming turn after a finished one holds the previous turn's committed tokens; under
    overlap also the last output token that ran in the step in flight (0.5.20: 5 in + 3 out,
    next turn cached 8); never more, and without overlap never that token."""
    import dataclasses

    limits = Limits(context_len=100000, kv_total=1e6, mamba_total=1000)
    history = (11, 12, 13, 14, 15, 21, 22, 23)
    for lookahead, allowed_hits in ((0, {7}), (1, {7, 8})):
        grid = dataclasses.replace(GRID, lookahead=lookahead)
        for hit in (7, 8, 9):
            book = HitBook(grid, limits)
            turn = _served("t3", history + (31, 32, 33, 34, 35), (41,), hit, 1, 2, streaming_turn=True, prev_committed=len(history) - 1)
            book.add(turn)
            problem = book.judge(turn)
            assert (problem is None) == (hit in allowed_hits), (lookahead, hit, problem)
            if problem is None:
                assert turn.permission == "streaming_session"


def test_hitbook_accepts_zero_for_a_request_aborted_before_its_prefill() -> None:
    """SGLang counts cached_tokens when it prepares the extend: a request aborted while it
    waited reports 0 although its prefix was cached (found by a clean nightly-size run)."""
    limits = Limits(context_len=100000, kv_total=1e6, mamba_total=1000)
    prompt = tuple(range(10, 330))
    book = HitBook(GRID, limits)
    first = _served("a", prompt, (1, 2), 0, 1, 2)
    aborted = _served("b", prompt + (7,) * 5, (), 0, 3, 4, abort_requested=True)
    aborted.response["meta_info"]["finish_reason"] = {"type": "abort"}
    served_late = _served("c", prompt + (8,) * 5, (3,), 0, 5, 6, abort_requested=True)  # decoded before the abort: it was prefilled
    served_late.response["meta_info"]["finish_reason"] = {"type": "abort"}
    for s in (first, aborted, served_late):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None and book.judge(aborted) is None
    assert "allows [320]" in book.judge(served_late)


@pytest.mark.parametrize("strategy,cut_hit", [("extra_buffer_lazy", 192), ("no_buffer", 256)])
def test_hitbook_allows_a_hit_where_sglang_cut_a_packed_prefill(strategy: str, cut_hit: int) -> None:
    """SGLang packs waiting requests into a prefill batch up to chunked_prefill_size and
    cuts the last one where the budget ends, caching the cut part: a burst whose members
    bring more tokens than the budget may hit there (seen on clean SGLang 0.5.23)."""
    grid = StrategyGrid(64, 1, 256, strategy_named(strategy))
    prompt = tuple(range(10, 331))

    def burst(budget: int | None) -> tuple[HitBook, list[Served]]:
        book = HitBook(grid, Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=budget))
        members = [_served(f"b.{i}", prompt + (1000 + i,) * 65, (), 0, 1, 2 + i) for i in range(20)]
        members[12].response["meta_info"]["cached_tokens"] = cut_hit
        for m in members:
            book.add(m)
        book.ready([])
        return book, members

    book, members = burst(4096)  # 20 x 386 tokens > 4096: SGLang may cut one of them anywhere
    assert all(book.judge(m) is None for m in members)
    book, members = burst(None)  # a server that never cuts: the hit is unexplained
    assert f"cached_tokens {cut_hit}" in "".join(str(f) for f in (book.judge(m) for m in members) if f)
    book, members = burst(100000)  # the burst fits one prefill batch: nothing is cut
    assert f"cached_tokens {cut_hit}" in "".join(str(f) for f in (book.judge(m) for m in members) if f)


@pytest.mark.parametrize("hit,allowed", [(421, True), (446, True), (384, True), (300, False), (386, False)])
def test_hitbook_a_cut_request_continues_on_a_grid_relative_to_its_cut(hit: int, allowed: bool) -> None:
    """SGLang tracks a chunk's checkpoint at ``prefix_len + floor(extend_len, 64)``: a burst
    member cut at 37 continues from there and is cached at 421 (seen on a clean SGLang:
    40 members of 447 shared + 4 own tokens, 21 hit 0, then 19 hit 421).  Only the last
    grid window before the end is opened: 300 stays unexplained."""
    grid = StrategyGrid(64, 1, 256, strategy_named("extra_buffer_lazy"))
    base = tuple(range(10, 457))
    members = [_served(f"b.{i}", base + (1000 + i,) * 4, (7,), 0, 1, 2 + i) for i in range(40)]
    members[25].response["meta_info"]["cached_tokens"] = hit
    book = HitBook(grid, Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=4096))
    for m in members:
        book.add(m)
    book.ready([])
    verdicts = [book.judge(m) for m in members]
    assert (verdicts[25] is None) is allowed, verdicts[25]
    assert all(v is None for i, v in enumerate(verdicts) if i != 25)


def test_cut_prefill_stores_relative_grid_and_repeated_cuts() -> None:
    """With a buffer: the first chunk's grid from the hit and the continuation's last
    window; without one, or past the budget (cut again), every page."""
    prompt = tuple(range(451))
    lens = lambda keys: sorted(len(k) for k in keys)  # noqa: E731
    buffered = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
    got = lens(cut_prefill_stores(prompt, 0, buffered, budget=4096))
    assert got == [64, 128, 192, 256, 320, 384] + list(range(388, 452))
    assert lens(cut_prefill_stores(prompt, 0, buffered, budget=200)) == list(range(1, 452))
    assert lens(cut_prefill_stores(prompt, 0, StrategyGrid(64, 1, 256, strategy_named("no_buffer")))) == list(range(1, 452))
    paged = lens(cut_prefill_stores(prompt, 64, StrategyGrid(64, 16, 256, strategy_named("extra_buffer")), budget=4096))
    assert paged == [128, 192, 256, 320, 384, 400, 416, 432, 448] and all(n % 16 == 0 for n in paged)


def test_stored_keys_are_the_same_keys_as_plain_token_tuples() -> None:
    """Stored keys hash once (speed); as keys they must stay interchangeable with the
    token tuples the oracle compares them with."""
    prompt = tuple(range(300))
    stores = cut_prefill_stores(prompt, 0, StrategyGrid(64, 1, 256, strategy_named("no_buffer")))
    assert all(isinstance(k, Prefix) for k in stores)
    assert prompt[:128] in stores and tuple(range(129)) in stores and (1, 2) not in stores
    assert {prompt[:64]: "a"}[next(k for k in stores if len(k) == 64)] == "a"
    assert Prefix(prompt[:10]) == prompt[:10] and hash(Prefix(prompt[:10])) == hash(prompt[:10])
    assert prompt[:10] + (5,) == Prefix(prompt[:10]) + (5,)  # slicing and concatenation give plain tuples


def test_hitbook_lazy_alloc_fail_may_drop_the_prefill_checkpoint_at_a_boundary() -> None:
    """With every lazy boundary allocation failing, SGLang invalidates the kept prefill
    checkpoint when the decode reaches a track boundary: a follow-up may then hit 0."""
    limits = Limits(context_len=100000, kv_total=1e6, mamba_total=1000)
    prompt = tuple(range(10, 265))  # 255 tokens: prefill checkpoint at 192
    out = tuple(range(600, 1119))  # 519 tokens: the decode crosses 256, 512 and 768
    follow = prompt + out[:512] + (5,) * 5

    def judge(grid: StrategyGrid, follow_out: tuple) -> str | None:
        book = HitBook(grid, limits)
        first = _served("a", prompt, out, 0, 1, 2)
        second = _served("b", follow_out, (3,), 0, 3, 4)
        for s in (first, second):
            book.add(s)
        book.ready([])
        assert book.judge(first) is None
        return book.judge(second)

    failing = StrategyGrid(64, 1, 256, strategy_named("extra_buffer_lazy"), lazy_alloc_fail=True)
    assert judge(failing, follow) is None
    assert "allows" in (judge(StrategyGrid(64, 1, 256, strategy_named("extra_buffer_lazy")), follow) or "")  # the checkpoints survive without the fault
    short = _served("c", prompt[:200], (1, 2, 3), 0, 1, 2)  # a decode that reaches no boundary keeps its checkpoint
    assert not lazy_checkpoint_may_drop(short, failing) and lazy_checkpoint_may_drop(_served("d", prompt, out, 0, 1, 2), failing)


def test_answer_problems() -> None:
    limits = Limits(context_len=1000, max_input=990, kv_total=5000)
    ok = _served("a", (1,) * 10, (2, 3), 0, 1, 2)
    assert answer_problems(ok, limits) == []
    refused = Served("b", 0, (1,) * 10, 5, {}, 1, 2, error="Requested token count exceeds")
    assert "refused although it fits" in answer_problems(refused, limits)[0]
    big = Served("c", 0, (1,) * 10, 995, {}, 1, 2, error="too long", overflow=True)
    assert answer_problems(big, limits) == []
    served_big = _served("d", (1,) * 10, (2,) * 995, 0, 1, 2)
    assert "does not fit" in answer_problems(served_big, limits)[0]
    wrong_prompt = _served("e", (1,) * 10, (2,), 0, 1, 2)
    wrong_prompt.response["meta_info"]["prompt_tokens"] = 11
    assert "prompt_tokens 11" in answer_problems(wrong_prompt, limits)[0]
    stray_abort = _served("f", (1,) * 10, (2,), 0, 1, 2)
    stray_abort.response["meta_info"]["finish_reason"] = {"type": "abort"}
    assert "refused although it fits" in answer_problems(stray_abort, limits)[0]
    stray_abort.abort_requested = True
    assert answer_problems(stray_abort, limits) == []


def test_a_turn_refused_because_its_session_closed_first_is_not_judged() -> None:
    """A turn sent before close_session can reach SGLang's scheduler after the close (two
    HTTP connections, no order): SGLang refuses it and reports a 1-token prompt with one
    token out.  Found by a clean sglang-cpu run; only that refusal is exempt."""
    limits = Limits(context_len=1000, max_input=990, kv_total=5000)
    refusal = {"type": "abort", "message": "Invalid request: session id 3f2a does not exist"}

    def turn(**kw) -> Served:
        s = _served("t1", (1,) * 130, (7,), 0, 1, 2, kind="turn", **kw)
        s.response["meta_info"].update(prompt_tokens=1, finish_reason=dict(refusal))
        return s

    assert turn(abort_requested=True).refused_for_closed_session
    assert answer_problems(turn(abort_requested=True), limits) == []
    closing = turn(abort_requested=True)
    closing.response["meta_info"]["finish_reason"]["message"] = "Invalid request: close was requested for session 3f2a"
    assert answer_problems(closing, limits) == []
    # the kit did not close the session: a refusal nobody asked for is a finding
    assert "refused although it fits" in answer_problems(turn(), limits)[0]
    # an abort for another reason still has its prompt judged
    other = turn(abort_requested=True)
    other.response["meta_info"]["finish_reason"]["message"] = "Abort requested"
    assert not other.refused_for_closed_session
    assert "prompt_tokens 1" in answer_problems(other, limits)[0]
    # a plain request is never a session refusal
    plain = turn(abort_requested=True)
    plain.kind = "send"
    assert not plain.refused_for_closed_session


def test_a_turn_refused_because_its_session_closed_first_has_no_hit_to_judge() -> None:
    """The refused turn reports cached_tokens 0 whatever the tree holds (seen on a clean
    sglang-cpu lazy_alloc_fail run: a turn whose parent's 64 tokens were cached); another
    abort with the same numbers is still judged."""
    prompt = tuple(range(10, 330))

    def judge(message: str) -> str | None:
        book = HitBook(GRID, Limits(context_len=100000, kv_total=1e6, mamba_total=1000))
        first = _served("a", prompt, (1, 2), 0, 1, 2)
        turn = _served("t", prompt + (7,) * 5, (3,), 0, 3, 4, kind="turn", abort_requested=True)
        turn.response["meta_info"]["finish_reason"] = {"type": "abort", "message": message}
        for s in (first, turn):
            book.add(s)
        book.ready([])
        assert book.judge(first) is None
        return book.judge(turn)

    assert judge("Invalid request: session id 3f2a does not exist") is None
    assert "allows [320]" in (judge("Abort requested") or "")


def test_counters_and_log_lines() -> None:
    assert counter_problems(320, 320.0, 320) == []
    assert "grew by 0" in counter_problems(320, 0.0, None)[0]
    assert "log lines count 256" in counter_problems(320, None, 256)[0]
    # a retracted request's second prefill from its own prefix: counted by the log only, up to its length
    assert counter_problems(0, 0.0, 1664, retracted_max=2077) == []
    assert "may count up to 100 more" in counter_problems(0, 0.0, 1664, retracted_max=100)[0]
    assert "grew by 1664" in counter_problems(0, 1664.0, 0, retracted_max=2077)[0]  # the counter counts once


def test_each_retraction_of_a_request_allows_one_more_prefill_of_its_length():
    # SGLang's forced retraction every 3rd decode step retracts a long request again and again
    assert retraction_allowance([("h6", 4022), ("r1", 300)], ["h6", "h6", "h6"]) == 3 * 4022
    assert retraction_allowance([("h6", 4022), ("r1", 300)], []) == 0  # nothing retracted: nothing allowed
    assert retraction_allowance([("r1", 300)], ["h6"]) == 0  # another window's request
    text = "Prefill batch. #new-seq: 1, #new-token: 5, #cached-token: 256, x\nDecode batch\nPrefill batch. #new-seq: 2, #new-token: 9, #cached-token: 64,"
    assert log_cached_tokens(text) == 320


def test_idle_problems_allow_session_locks_only() -> None:
    values = {"sglang:mamba_used_tokens": 1.0, "sglang:kv_used_tokens": 64.0, "hybrid_conformance:mamba_protected": 1.0,
              "hybrid_conformance:kv_protected": 64.0, "sglang:num_running_reqs": 0.0}
    assert idle_problems(values, locked={"mamba": 2, "kv": 100}) == []
    assert any("a lock was not released" in p for p in idle_problems(values, locked={}))
    leaked = {**values, "sglang:mamba_used_tokens": 3.0}
    assert any("leaked" in p for p in idle_problems(leaked, locked={"mamba": 2, "kv": 100}))


# ------------------------------------------------------------------ exploration (a fake server)
def _fails_on_burst(p: Program):
    from conformance.checks.findings import Finding
    from conformance.programs.runner import RunStats, program_failure

    if any(isinstance(s, Burst) for s in p.steps):
        raise program_failure(len(p.steps), [Finding("unclassified", "a burst was sent")], [])
    return RunStats(requests=len(p.steps), steps=len(p.steps))


def test_explore_finds_shrinks_and_is_deterministic(tmp_path: Path) -> None:
    from conformance.programs.explore import Budget, explore

    budget = Budget("t", examples=300, shrink_s=60)
    spec = replace(SPEC, pressure_weight=0)  # a pressure shape's burst comes after the request it matches: not one step
    first = explore(_fails_on_burst, spec, budget, seed=3)
    again = explore(_fails_on_burst, spec, budget, seed=3)
    assert first.finding is not None and again.finding is not None
    assert first.finding.examples_to_failure == again.finding.examples_to_failure
    shrunk = first.finding.program
    # shrinking ran and left the burst with at most one step before it (hypothesis does not
    # always delete a whole leading step: its choices sit outside one span)
    assert first.finding.shrink_runs > 0 and len(shrunk.steps) <= 2 and isinstance(shrunk.steps[-1], Burst)
    assert len(shrunk.forest) == 1 and first.finding.shrunk_steps == len(shrunk.steps)
    assert first.finding.failure.what == "a burst was sent"
    # the database re-tries a found failure first
    db = tmp_path / "db"
    explore(_fails_on_burst, spec, budget, seed=3, db_dir=db)
    replayed = explore(_fails_on_burst, spec, budget, seed=99, db_dir=db)
    assert replayed.finding is not None and replayed.finding.examples_to_failure == 1


def test_explore_spends_the_budget_when_nothing_fails() -> None:
    from conformance.programs.explore import Budget, explore
    from conformance.programs.runner import RunStats

    seen: list[Program] = []

    def passes(p: Program) -> RunStats:
        seen.append(p)
        return RunStats(requests=1)

    ex = explore(passes, SPEC, Budget("t", examples=12), seed=0)
    assert ex.finding is None and ex.examples == 12 and len(seen) == 12 and ex.total.requests == 12
    assert len({s.dumps() for s in seen}) == 12  # a program is never run twice


def test_an_examples_budget_draws_on_until_a_request_was_judged() -> None:
    """``ci`` is 2 programs, the first always empty: when the second sends nothing judged
    either (it depends on the cell's seed), a few more are drawn instead of a vacuous run."""
    from conformance.programs.explore import VACUOUS_EXTRA, Budget, explore
    from conformance.programs.runner import RunStats

    runs: list[int] = []

    def judged_from_the_fourth(p: Program) -> RunStats:
        runs.append(1)
        return RunStats(requests=int(len(runs) >= 4))

    ex = explore(judged_from_the_fourth, SPEC, Budget("t", examples=2), seed=0)
    assert ex.examples == 4 and ex.total.requests == 1
    never = explore(lambda p: RunStats(), SPEC, Budget("t", examples=2), seed=0)
    assert never.examples == 2 + VACUOUS_EXTRA and never.total.requests == 0


def test_explore_stops_on_an_infrastructure_error() -> None:
    from conformance.programs.explore import Budget, explore

    def broken(p: Program):
        raise KitError("the cache-off twin failed a cold computation: connection refused")

    with pytest.raises(KitError, match="cache-off twin"):
        explore(broken, SPEC, Budget("t", examples=5), seed=0)


def test_landing_resolves_max_new_from_the_input_length() -> None:
    from conformance.programs.resolve import Resolver

    p = Program(forest=(tuple(range(3, 600)),), steps=())
    r = Resolver(p, GRID, Limits(context_len=4096), exact=True, tag="t")
    for land, length, expect in (("boundary", 250, 7), ("boundary-1", 250, 6), ("boundary+1", 250, 8), ("boundary", 100, 4)):
        ids, max_new, payload, _ = r.send(Send("r1", Root(0, length), (), 4, land=land), {})
        assert len(ids) == length and max_new == expect and payload["sampling_params"]["max_new_tokens"] == expect
        if max_new != 4:
            assert len(ids) + max_new - 1 == 256 + {"boundary": 0, "boundary-1": -1, "boundary+1": 1}[land]
    _, max_new, payload, _ = r.send(Send("r2", Root(0, 10), (), 4, overflow=True), {})
    assert 10 + max_new > 4096


def test_the_cache_off_twin_never_loads_the_seeded_sglang_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mutants`` sets the fault in the caller's environment; the twin blanks it in its
    cell env, and a blank must win over the caller's (it did not: the twin of a double_free
    run loaded the fault and died at start-up)."""
    from conformance.programs.bind import FAULT_SWITCHES
    from conformance.matrix.faults import SGLANG_FAULT_ENV
    from conformance.sglang_plugins.faults import fault_for_launch

    monkeypatch.setenv(SGLANG_FAULT_ENV, "double_free")
    assert SGLANG_FAULT_ENV in FAULT_SWITCHES
    assert fault_for_launch({SGLANG_FAULT_ENV: ""}) is None
    assert fault_for_launch({}) == "double_free"


def test_a_plain_run_above_premerge_spends_the_standard_budget() -> None:
    """Issue 26: the standard tier ran two small programs per cell (the first one empty)."""
    from conformance.programs.explore import default_budget

    assert default_budget("premerge") == "ci" and default_budget("standard") == default_budget("nightly") == "standard"
    assert parse_budget("standard").examples > parse_budget("ci").examples


def test_a_server_that_dies_mid_program_is_the_program_failure_not_a_kit_error() -> None:
    """SGLang 0.5.12's scheduler dies on its own idle leak check: the next call on the server
    is a connection error, which the runner reports as the program's failure naming the
    death (exit + log line), not as a kit error."""
    from types import SimpleNamespace

    from conformance.checks.hit_bounds import StrategyGrid
    from conformance.programs.oracle import Limits
    from conformance.programs.program import Open
    from conformance.programs.runner import ProgramFailure, ProgramTarget, run_program

    death = "server process exited with code -9; log tail: ValueError: pool memory leak detected! [mamba] total=48, available=45"

    class Dying:
        base_url = "http://127.0.0.1:9"
        dead = False

        def request(self, *a, **kw):
            return SimpleNamespace(status_code=200, json=lambda: {})

        def flush_cache(self, **kw):
            return None

        def metrics(self):
            return {}

        def open_session(self, *a, **kw):
            self.dead = True
            raise KitError("POST http://127.0.0.1:9/open_session: ReadError: [Errno 104] Connection reset by peer")

        def close_session(self, *a, **kw):
            raise KitError("POST /close_session: ConnectError")

    client = Dying()
    target = ProgramTarget(client=client, cold=client, grid=StrategyGrid(64, 1, 256, strategy=strategy_named("extra_buffer")),
                    limits=Limits(context_len=4096), tol=Tolerance.for_mode(True, kl_cap=1.0), exact=True,
                    alive=lambda: death if client.dead else None)
    with pytest.raises(ProgramFailure, match="server died: server process exited with code -9.*pool memory leak detected"):
        run_program(Program(forest=((5, 6, 7),), steps=(Open("s1", streaming=True),)), target)
    client.dead = False  # a connection error from a server that still lives stays a kit error
    target.alive = lambda: None
    with pytest.raises(KitError, match="open_session"):
        run_program(Program(forest=((5, 6, 7),), steps=(Open("s1", streaming=True),)), target)


def test_a_difference_says_how_often_sglang_retracted_the_request():
    """The retraction count from SGLang's per-request records is a fact of the finding (an
    entry's ``where`` reads it) and said in its line; without records it is absent."""
    s = Served(rid="t3", step=4, input_ids=tuple(range(11)), max_new=12, options={}, sent_seq=1,
               response={"meta_info": {"cached_tokens": 5}})
    d = [Difference("output", "output logprob 2 (position 13): served -0.0638751, cold -0.0209934", (("position", 13),))]
    again = difference_finding(s, d, retracted=2)
    assert again.kind == "answer_differs_on_hit" and again.facts["retracted"] == 2 and "cached_tokens 5, retracted 2x)" in again.line
    never = difference_finding(s, d, retracted=0)
    assert never.facts["retracted"] == 0 and "retracted" not in never.line
    unknown = difference_finding(s, d)
    assert "retracted" not in unknown.facts and "retracted" not in unknown.line


def test_an_abort_sent_after_its_request_finished_is_said_not_passed_silently():
    """A loaded machine can let a streamed request finish before the client's abort after
    ``abort_at`` tokens goes out; the run then did not play the program as written. The run
    names the request (``late_aborts``, the trace, replay's PASS line) and sends no abort;
    an abort that lands in time is no late one."""
    from types import SimpleNamespace

    from conformance.checks.hit_bounds import StrategyGrid
    from conformance.programs.flights import Flight
    from conformance.programs.oracle import Limits
    from conformance.programs.replay import _late
    from conformance.programs.runner import ProgramRun, ProgramTarget

    class Deck:
        def __init__(self, finished: bool) -> None:
            self.finished, self.aborted = finished, []

        def launch(self, rids, payload, *, stream):
            f = Flight(rids, payload, stream, sent_seq=1)
            if self.finished:
                f.tokens_seen = 16
                f.done.set()
            else:
                f.tokens_seen = 2
            return f

        def abort(self, flight):
            self.aborted.append(flight.rids)

    client = SimpleNamespace(base_url="http://127.0.0.1:9")
    target = ProgramTarget(client=client, cold=client, grid=StrategyGrid(64, 1, 256, strategy=strategy_named("extra_buffer")),
                           limits=Limits(context_len=4096), tol=Tolerance.for_mode(True, kl_cap=1.0), exact=True)
    seen = {}
    for finished in (True, False):
        run = ProgramRun(Program(forest=((5, 6, 7),), steps=()), target)
        run.deck.close()
        run.deck = Deck(finished)
        run._launch("t3", (5, 6, 7), 16, {}, {}, stream=True, kind="send", abort_at=2)
        seen[finished] = (run.stats.late_aborts, run.deck.aborted, run.served["t3"].abort_requested, run.trace)
    late, aborted, requested, trace = seen[True]
    assert late == ["t3"] and aborted == [] and not requested and "t3: finished before its abort after 2 tokens" in trace[-1]
    assert "not played as written: t3 finished before its abort was sent" in _late(late)
    late, aborted, requested, _ = seen[False]
    assert late == [] and len(aborted) == 1 and requested and _late(late) == ""
