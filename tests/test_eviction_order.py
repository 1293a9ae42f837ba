"""The eviction-order check (conformance/checks/eviction_order.py): the policy model, and the
verdict on observe-plugin records -- passing on the policy's victim, failing on another one,
and failing (never passing) when no KV walk freed a scenario state."""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.checks.eviction_order import eviction_order_verdict, first_victim, kv_walk_victims, scenario
from conformance.token_digest import token_digest
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
        assert first_victim(p, STORED) is not None
    assert first_victim("tlru", STORED) is None


def test_policy_victim_passes_and_another_fails():
    records = [_state("held"), _walk(kv=False), _state("stored-1"), _walk(kv=True), _state("held"), _walk(kv=True)]
    assert eviction_order_verdict("priority", STORED, SEQS, records).status == "pass"
    lru = eviction_order_verdict("lru", STORED, SEQS, records)
    assert lru.status == "fail" and "stored-1" in lru.reason and "held" in lru.reason
    assert lru.metrics["kv_walks"] == 2 and lru.metrics["mamba_walks"] == 1


def test_a_mamba_walk_victim_is_not_the_policys():
    victims, kv, other = kv_walk_victims([_state("held"), _walk(kv=False), _state("stored-2"), _walk(kv=True)])
    assert (kv, other) == (1, 1) and len(victims) == 1


def test_no_kv_walk_is_a_failure_not_a_pass():
    v = eviction_order_verdict("lru", STORED, SEQS, [_state("held"), _walk(kv=False)])
    assert v.status == "fail" and "nothing was judged" in v.reason
    assert eviction_order_verdict("lru", STORED, SEQS, []).status == "fail"


def test_unmodelled_policy_is_a_stated_skip():
    v = eviction_order_verdict("tlru", STORED, SEQS, [])
    assert v.status == "skip" and "not modelled" in v.reason


def test_a_server_without_per_node_hooks_judges_nothing():
    records = [{"ev": "start", "state_evictions": False}, _state("stored-1"), _walk(kv=True)]
    v = eviction_order_verdict("priority", STORED, SEQS, records)
    assert v.status == "fail" and "state_evictions false" in v.reason
