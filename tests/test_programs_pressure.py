"""The pressure shapes of the request programs (conformance/programs/strategies.py, issue 44):
drawn on every cell, weighted up on pressure cells, switched off by weight 0; no server."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from hypothesis import HealthCheck, find, given, settings

from conformance.programs.bind import PRESSURE_SHAPES_ENV, pressure_weight
from conformance.programs.explore import SIZES
from conformance.programs.program import After, Burst, Root, Send, Wait, program_from_json
from conformance.programs.strategies import GenSpec, kinds, programs

SPEC = GenSpec(vocab_size=500, chunk=64, checkpoint_grid=64, track_grid=256, page_size=1, context_len=4096)
LARGE = replace(SPEC, **SIZES["large"], pressure_weight=4)


def _holders(p) -> list[Send]:
    return [s for s in p.steps if isinstance(s, Send) and s.rid.startswith("h")]


def _refused_shape(p) -> bool:
    """A stored request, waited for, holders that decode long, then a follow-up of it gated on a holder."""
    holders = {h.rid for h in _holders(p) if h.stream and h.max_new >= LARGE.hold_new // 2}
    waited = {s.rid for s in p.steps if isinstance(s, Wait)}
    return any(isinstance(s, Send) and isinstance(s.base, After) and s.base.rid in waited and s.gate is not None
               and s.gate.rid in holders for s in p.steps)


def _matching_burst(p) -> bool:
    """A burst of more members than the small Mamba pool's slots over a prefix a finished request stored."""
    for i, s in enumerate(p.steps[2:], 2):
        seed, wait = p.steps[i - 2], p.steps[i - 1]
        if (isinstance(s, Burst) and len(s.suffixes) > 16 and isinstance(seed, Send) and seed.base == s.base
                and isinstance(wait, Wait) and wait.rid == seed.rid):
            return True
    return False


def test_each_pressure_shape_is_drawn_on_a_pressure_cell():
    for shape in (_refused_shape, _matching_burst, lambda p: any(s.gate and s.gate.rid.startswith("h") for s in p.steps if isinstance(s, Send))):
        p = find(programs(LARGE), shape, settings=settings(max_examples=3000, suppress_health_check=list(HealthCheck), database=None))
        assert program_from_json(p.to_json()) == p  # plain steps: a failure file replays it


def test_holders_decode_up_to_a_few_hundred_tokens_within_the_pressure_budget():
    p = find(programs(LARGE), lambda p: len(_holders(p)) >= 3, settings=settings(max_examples=3000, suppress_health_check=list(HealthCheck), database=None))
    assert max(h.max_new for h in _holders(p)) >= LARGE.hold_new // 2


@settings(max_examples=60, suppress_health_check=list(HealthCheck), database=None)
@given(programs(replace(LARGE, pressure_weight=0)))
def test_weight_zero_switches_the_shapes_off(p):
    assert not _holders(p) and not _refused_shape(p)


@settings(max_examples=60, suppress_health_check=list(HealthCheck), database=None)
@given(programs(LARGE))
def test_the_pressure_decodes_stay_within_their_budget(p):
    assert sum(h.max_new for h in _holders(p)) <= LARGE.pressure_budget + 2 * LARGE.max_holders


def test_pressure_cells_weigh_the_shapes_up_and_the_env_switches_them_off(monkeypatch):
    cell = lambda **o: SimpleNamespace(strategy=SimpleNamespace(overlap=True), options=tuple(o.items()))  # noqa: E731
    monkeypatch.delenv(PRESSURE_SHAPES_ENV, raising=False)
    assert pressure_weight(cell(), 1) == 1 and pressure_weight(cell(kv_pool="small"), 1) == 4 and pressure_weight(cell(), 16) == 4
    monkeypatch.setenv(PRESSURE_SHAPES_ENV, "off")
    assert pressure_weight(cell(kv_pool="small"), 16) == 0
    assert kinds(replace(SPEC, pressure_weight=0)).count("pressure") == 0 and kinds(LARGE).count("pressure") == 4


POOL = replace(SPEC, **SIZES["small"], pressure_weight=4, kv_total=1536)  # a small pool: cheap prompts to draw
FIND = settings(max_examples=400, suppress_health_check=list(HealthCheck), database=None)


def _pool_holders(p) -> list[Send]:
    """Holders on fresh prompts of their own (``Root(0, 0)``): the pool-sized ones."""
    return [h for h in _holders(p) if h.base == Root(0, 0)]


def _refusal(p):
    holders = _pool_holders(p)
    stored = next(s for s in p.steps if isinstance(s, Send) and s.rid.startswith("r") and len(s.suffix) == 2 * POOL.checkpoint_grid + 1)
    back = next(s for s in p.steps if isinstance(s, Send) and isinstance(s.base, After) and s.base.rid == stored.rid)
    return holders, stored, back, POOL.kv_total - sum(len(h.suffix) + h.max_new for h in holders) - (len(stored.suffix) + stored.max_new)


def _slack(p) -> int:
    return _refusal(p)[3] if any(h.options.ignore_eos for h in _pool_holders(p)) else 0


def test_a_pool_sized_refusal_leaves_the_follow_up_less_than_its_extend():
    """Holders charged their whole decode (ignore_eos) take all the pool but the stored request
    and a slack below the follow-up's extend, so it reaches the prefill adder and is refused for KV."""
    p = find(programs(POOL), lambda p: _slack(p) > 0, settings=FIND)
    holders, stored, back, slack = _refusal(p)
    assert 2 <= len(holders) <= 3 and 0 < slack < len(back.suffix) + back.max_new and back.gate.rid == holders[-1].rid


def test_a_pool_sized_refusal_may_overflow_so_the_holders_decodes_evict_the_matched_state():
    """The other half: the prompts and the stored state fit the pool until the follow-up came
    (gated on a holder's first tokens), the holders' whole decodes do not, so while the follow-up
    waits refused SGLang's eviction walk must free what it matched (``matched_then_evicted``)."""
    p = find(programs(POOL), lambda p: _slack(p) < 0, settings=FIND)
    holders, stored, back, slack = _refusal(p)
    prompts = sum(len(h.suffix) for h in holders)
    assert prompts + len(stored.suffix) + stored.max_new + back.gate.tokens * len(holders) < POOL.kv_total  # matched before any eviction
    assert slack < 0 and back.gate.rid == holders[-1].rid  # the whole decodes outgrow the pool


def test_pool_sized_retraction_holders_fit_sglangs_admission_but_not_the_pool():
    """SGLang charges the last arrival its whole decode and the running holders 0.7 of theirs:
    that fits; their prompts and whole decodes do not, so decode must retract."""
    p = find(programs(POOL), lambda p: any(not h.options.ignore_eos for h in _pool_holders(p)), settings=FIND)
    holders = _pool_holders(p)
    prompts, new = sum(len(h.suffix) for h in holders), holders[0].max_new
    assert prompts + new * len(holders) > POOL.kv_total  # the whole decodes overflow the pool
    assert prompts + new + 0.7 * new * (len(holders) - 1) < POOL.kv_total  # the last one is admitted while the others run


@settings(max_examples=40, suppress_health_check=list(HealthCheck), database=None)
@given(programs(replace(POOL, kv_total=0)))
def test_without_the_pools_size_no_holder_is_pool_sized(p):
    assert not _pool_holders(p)
