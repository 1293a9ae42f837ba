"""The eviction-order check (conformance/checks/eviction_order.py): the policy model, and the
verdict on observe-plugin records -- passing on the policy's victim, failing on another one,
and failing (never passing) when no KV walk freed a scenario state."""

from __future__ import annotations

import pytest

from conformance.matrix import axes
from conformance.checks.eviction_order import Tlru, eviction_order_verdict, first_victim, kv_walk_victims, path_splits, scenario, tlru_stored_len
from conformance.sglang_plugins.token_digest import token_digest
from conformance.workloads.prompts import token_prompts

STORED = scenario(8192, 1024)
SEQS = dict(zip((s.name for s in STORED), token_prompts([40] * len(STORED), vocab_size=500, seed=1)))


def _state(name: str, n: int = 32) -> dict:
    return {"ev": "state_evicted", "len": n, "key": token_digest(SEQS[name][:n])}


def _walk(kv: bool) -> dict:
    return {"ev": "evict", "num_tokens_evicted": 40, "mamba_num_evicted": 1, "asked_num_tokens": 1025 if kv else 0, "asked_mamba_num": 0 if kv else 1}


def test_scenario_runs_the_pool_short_and_orders_sends():
    assert sum(s.sends for s in STORED[1:]) * 1024 > 8192
    assert [s.last for s in STORED] == sorted(s.last for s in STORED)
    assert STORED[0].priority > max(s.priority for s in STORED[1:]) and STORED[0].hits >= 2


@pytest.mark.parametrize("policy, victim", [("lru", "held"), ("lfu", "stored-1"), ("slru", "stored-1"), ("priority", "stored-1")])
def test_each_policy_gives_up_its_lowest_ranked_leaf(policy, victim):
    assert first_victim(policy, STORED).name == victim


def test_every_ordered_policy_of_the_axis_is_modelled():
    for p in axes.ORDERED_POLICIES:
        assert first_victim(p, STORED, tlru=Tlru(512, 64), splits={}) is not None
    assert first_victim("tlru", STORED) is None  # tlru needs its configuration and the paths' splits


#: tlru at toy scale: a 40-token held path must keep 40 + 4 - 32 = 12 tokens cached above its leaf
TOY_TLRU = Tlru(32, 4)
TOY = scenario(400, 40, tlru_stored_len(TOY_TLRU))


def _stored(name: str, n: int) -> dict:
    return {"ev": "state_stored", "len": n, "key": token_digest(SEQS[name][:n])}


def test_tlru_gives_up_a_tel_safe_leaf_before_an_older_unsafe_one():
    assert TOY_TLRU.tel_safe((tlru_stored_len(TOY_TLRU),))  # the short stored prompts: safe however split
    assert not TOY_TLRU.tel_safe((40,)) and TOY_TLRU.tel_safe((16, 40)) and not TOY_TLRU.tel_safe((8, 40))
    # held in one node: unsafe, so the oldest safe leaf goes first (LRU would take held)
    assert first_victim("tlru", TOY, tlru=TOY_TLRU, splits={"held": (40,)}).name == "stored-1"
    # held split at 16 by a stored state: its 24-token leaf is safe and the oldest
    assert first_victim("tlru", TOY, tlru=TOY_TLRU, splits={"held": (16, 40)}).name == "held"


def test_tlru_reads_the_splits_from_sglangs_stored_states():
    records = [_stored("held", 16), _stored("held", 40), _stored("stored-1", 12), {"ev": "state_stored", "len": 5, "key": "elsewhere"}]
    splits = path_splits(SEQS, records)
    assert splits["held"] == (16, 40) and splits["stored-1"] == (12,) and splits["stored-2"] == ()


def test_tlru_verdict_judges_the_first_walk_against_the_tree_sglang_built():
    """As on real SGLang 0.5.23 (extra_buffer): every path is cut a chunk before its end, so
    each tail is free to evict and goes first whatever the policy; then tlru takes the other
    prompts' free nodes before held's unsafe rest, where LRU takes held's rest."""
    tree = [_stored("held", 36), _stored("held", 40), *(_stored(f"stored-{i}", n) for i in (1, 2) for n in (12, 14))]
    tlru_like = tree + [_state("held", 40), _state("stored-1", 14), _walk(kv=True)]
    v = eviction_order_verdict("tlru", TOY, SEQS, tlru_like, tlru=TOY_TLRU)
    assert v.status == "pass" and v.metrics["differs_from_lru"] == 1, v
    assert v.details["tlru_order"] == ["held", "stored-1"] and v.details["lru_order"] == ["held", "held"]
    lru_like = tree + [_state("held", 40), _state("held", 36), _walk(kv=True)]  # a tlru that behaves as plain LRU
    v = eviction_order_verdict("tlru", TOY, SEQS, lru_like, tlru=TOY_TLRU)
    assert v.status == "fail" and "['held', 'held']" in v.reason and "['held', 'stored-1']" in v.reason
    # held in one node (no state inside it): unsafe, so the first free leaf goes first
    unsplit = [_stored("held", 40), _stored("stored-1", 14), _state("stored-1", 14), _walk(kv=True)]
    v = eviction_order_verdict("tlru", TOY, SEQS, unsplit, tlru=TOY_TLRU)
    assert v.status == "pass" and v.metrics["differs_from_lru"] == 1
    # a state a Mamba walk already took frees nothing when its node goes
    mamba_first = tree + [_state("held", 40), _walk(kv=False), _state("stored-1", 14), _walk(kv=True)]
    assert eviction_order_verdict("tlru", TOY, SEQS, mamba_first, tlru=TOY_TLRU).status == "pass"


def test_unmodelled_policy_is_a_stated_skip():
    for policy, kw in (("fifo", {}), ("tlru", {})):  # tlru without its configuration
        v = eviction_order_verdict(policy, STORED, SEQS, [], **kw)
        assert v.status == "skip" and "not modelled" in v.reason


def test_a_server_without_per_node_hooks_judges_nothing():
    records = [{"ev": "start", "state_evictions": False}, _state("stored-1"), _walk(kv=True)]
    v = eviction_order_verdict("priority", STORED, SEQS, records)
    assert v.status == "fail" and "state_evictions false" in v.reason


def test_a_tree_that_walks_its_own_lru_lists_is_not_applicable_to_another_policy():
    """MambaRadixCache (hybrid models' tree up to 0.5.15) has no eviction strategy: its walk
    records say so, and lfu there is not applicable with that line; on the LRU cell the same
    records are judged (LRU is the order it follows)."""
    walk = {**_walk(kv=True), "order": "lru_lists", "tree": "MambaRadixCache"}
    records = [{"ev": "start", "state_evictions": True}, _state("held"), walk]
    v = eviction_order_verdict("lfu", STORED, SEQS, records)
    assert v.status == "skip" and v.reason.startswith("not applicable: sglang served this cell with MambaRadixCache")
    assert "--radix-eviction-policy lfu does not reach them" in v.reason
    assert eviction_order_verdict("lru", STORED, SEQS, records).status == "pass"
    wrong = eviction_order_verdict("lru", STORED, SEQS, [records[0], _state("stored-1"), walk])
    assert wrong.status == "fail" and "took stored-1" in wrong.reason
    vacuous = eviction_order_verdict("lfu", STORED, SEQS, [records[0]])  # no walk ran: nothing says which tree
    assert vacuous.status == "fail" and "nothing was judged" in vacuous.reason


def test_states_a_mamba_walk_took_before_any_kv_walk_make_the_kv_order_unobservable():
    """Small chunks on no_buffer store a state per chunk: the Mamba pool runs short first and
    its walks (LRU whatever the policy) free the scenario's states before a KV walk could
    (measured on 0.5.23, chunked prefill 32: every prompt's states went by Mamba walks).  That
    is not applicable with the numbers; a KV walk freeing nothing with no Mamba walk freeing
    a scenario state either still fails as nothing judged."""
    start = {"ev": "start", "state_evictions": True}
    records = [start, _state("held"), _walk(kv=False), _state("stored-1"), _walk(kv=False), _walk(kv=True)]
    v = eviction_order_verdict("lfu", STORED, SEQS, records)
    assert v.status == "skip" and v.reason.startswith("not applicable on this cell") and "freed 2 of them (1 KV walks, 2 Mamba walks)" in v.reason
    v = eviction_order_verdict("lfu", STORED, SEQS, [start, _walk(kv=False), _walk(kv=True)])
    assert v.status == "fail" and "nothing was judged" in v.reason
    v = eviction_order_verdict("lfu", STORED, SEQS, [start, _state("held"), _walk(kv=False), _state("held"), _walk(kv=True)])
    assert v.status == "fail" and "took held" in v.reason  # a KV walk freed one: judged


def _stored(name: str, n: int = 32) -> dict:
    return {"ev": "state_stored", "len": n, "key": token_digest(SEQS[name][:n])}


def test_a_fill_whose_prompts_left_no_state_is_not_applicable_with_the_records():
    """tlru's TEL-safe prompts (224 tokens) end below a lazy t256 cell's first checkpoint: the
    tree takes no state on them, keeps none of their KV, and no walk runs (measured on 0.5.21
    and 0.5.23, Granite lazy p1 t256 tlru: 3 states stored, all on held).  That is not
    applicable, read off the per-node records; the same empty walks with a stored prompt's
    state taken still fail as nothing judged."""
    start = {"ev": "start", "state_evictions": True}
    none_kept = eviction_order_verdict("lfu", STORED, SEQS, [start, _stored("held")])
    assert none_kept.status == "skip" and "took no Mamba state on any of the" in none_kept.reason and "no eviction walk ran" in none_kept.reason
    # a chunked prefill below the Mamba chunk that tracks nothing (0.5.19, Nemotron-H p64 t128 sub-chunk: SGLang warns
    # it "can skip Mamba state checkpoints"): no state at all, not even held's
    prefills = [{"ev": "prefill", "rid": f"x-{n}", "prefix": 0, "extend": 64, "cut": False, "track": None} for n in range(3)]
    nothing = eviction_order_verdict("priority", STORED, SEQS, [start, *prefills])
    assert nothing.status == "skip" and "(nor on held)" in nothing.reason and "no eviction walk ran" in nothing.reason
    unseen = eviction_order_verdict("priority", STORED, SEQS, [start])  # the plugin recorded nothing of the fill
    assert unseen.status == "fail" and "nothing was judged" in unseen.reason
    kept = eviction_order_verdict("lfu", STORED, SEQS, [start, _stored("held"), _stored("stored-1")])
    assert kept.status == "fail" and "nothing was judged" in kept.reason
    walked = eviction_order_verdict("lfu", STORED, SEQS, [start, _stored("held"), _walk(kv=True)])
    assert walked.status == "fail" and "nothing was judged" in walked.reason
