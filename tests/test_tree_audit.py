"""The tree audit's rules (``conformance/sglang_plugins/tree_audit.py``) on hand-built trees:
each rule passes a good tree and names its rule and the node's path on a seeded violation;
a rule whose inputs the view lacks (the Rust core gives no node) does not run."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace as NS

import pytest

from conformance.sglang_plugins.tree_audit import RULE_NAMES, RULES, SGLANG_RULE, Auditor, NodeView, TreeView, _request_slots, judge, sglang_check


def good(**changes) -> TreeView:
    """Root -> a (64 tokens, mamba slot 3) -> b (16 tokens, slot 5); root -> c (32, no state)."""
    nodes = (
        NodeView((64,), True, {"full": 0, "mamba": 0}, (3,), True),
        NodeView((64, 16), True, {"full": 0, "mamba": 0}, (5,), True),
        NodeView((32,), True, {"full": 0, "mamba": 0}, (), False),
    )
    view = TreeView("fake/python", 16, idle=True, nodes=nodes, lru_strays=0, tree_slots=(3, 5), free_slots=frozenset({1, 2, 4}),
                    request_slots={}, state_lens={3: 64, 5: 80}, protected={"full": 0, "mamba": 0})
    return replace(view, **changes)


def with_node(i: int, **changes) -> TreeView:
    view = good()
    nodes = list(view.nodes)
    nodes[i] = replace(nodes[i], **changes)
    return replace(view, nodes=tuple(nodes))


def test_a_good_tree_passes_every_rule_and_every_rule_ran() -> None:
    found, ran = judge(good())
    assert found == []
    assert ran == [r.name for r in RULES]


SEEDED = {
    "key_pages": (replace(with_node(1, path=(64, 10)), state_lens={3: 64, 5: 74}), "64/10"),
    "child_key": (with_node(2, under_own_key=False), "32"),
    "lock_negative": (with_node(0, locks={"full": -1, "mamba": 0}), "64"),
    "lock_at_idle": (with_node(1, locks={"full": 1, "mamba": 0}), "64/16"),
    "protected_at_idle": (good(protected={"full": 0, "mamba": 1}), ""),
    "lru_exact": (with_node(1, in_mamba_lru=False), "64/16"),
    "slot_used": (good(free_slots=frozenset({1, 5})), "64/16"),
    "slot_once": (good(request_slots={"r1": (3,)}), "64"),
    "state_depth": (good(state_lens={3: 64, 5: 64}), "64/16"),
}


@pytest.mark.parametrize("rule", [r.name for r in RULES])
def test_each_rule_names_itself_and_the_node_on_a_seeded_violation(rule: str) -> None:
    view, path = SEEDED[rule]
    found, _ = judge(view)
    assert [(v.rule, "/".join(map(str, v.path))) for v in found] == [(rule, path)]


def test_locks_held_while_busy_are_no_violation() -> None:
    busy = replace(with_node(1, locks={"full": 1, "mamba": 1}), idle=False, protected={"full": 16, "mamba": 1})
    assert judge(busy)[0] == []


def test_an_lru_entry_naming_no_node_is_a_violation_of_the_tree() -> None:
    (v,), _ = judge(good(lru_strays=2))
    assert (v.rule, v.where()) == ("lru_exact", "tree")


def test_a_view_without_nodes_runs_only_the_rules_it_can_feed() -> None:
    rust = good(nodes=None, lru_strays=None, state_lens=None)
    found, ran = judge(rust)
    assert found == [] and ran == ["protected_at_idle", "slot_used", "slot_once"]
    found, _ = judge(replace(rust, tree_slots=(3, 3)))
    assert [v.rule for v in found] == ["slot_once"]


class _Tree:
    def __init__(self, error: str | None) -> None:
        self.error = error

    def sanity_check(self) -> None:
        if self.error:
            raise AssertionError(self.error)


def test_sglang_own_check_is_a_violation_when_it_asserts() -> None:
    assert sglang_check(_Tree(None)) == []
    (v,) = sglang_check(_Tree("Sanity check FAILED (1 violations across 3 nodes):\n  mamba device LRU: +tree={4}, +lru=set()"))
    assert v.rule == SGLANG_RULE and "mamba device LRU" in v.line
    assert SGLANG_RULE in RULE_NAMES


def test_the_auditor_writes_a_violation_once_per_tree_generation() -> None:
    auditor = Auditor()
    new = [v for v in auditor._new(judge(with_node(2, under_own_key=False))[0])]
    assert len(new) == 1 and auditor._new(judge(with_node(2, under_own_key=False))[0]) == []
    auditor.reset()
    assert len(auditor._new(judge(with_node(2, under_own_key=False))[0])) == 1


def test_violations_become_tree_structure_findings_and_no_audit_is_vacuous() -> None:
    from conformance.checks.tree_structure import audits_vacuous, tree_findings

    (f,) = tree_findings([{"rule": "child_key", "path": "64", "line": "its parent's children do not hold it"}])
    assert f.kind == "tree_structure" and f.catch and f.facts == {"rule": "child_key", "path": "64"} and "node 64" in f.line
    assert tree_findings([]) == []
    assert [g.kind for g in audits_vacuous(0)] == ["vacuous"]
    assert audits_vacuous(12) == [] and audits_vacuous(None) == []  # None: a target that audits nothing (reference)


def test_a_slot_held_twice_names_the_request_holding_it_and_where_it_sits() -> None:
    (v,), _ = judge(good(request_slots={"t3 (chunked)": (3,), "r4 (running)": (9,)}))
    assert v.line == "mamba slot 3 is held 2 times (tree nodes and running requests): 1 by the tree, by request t3 (chunked)"


def test_the_reader_leaves_out_finished_requests_whose_slot_sglang_donated_to_the_tree() -> None:
    def req(rid: str, slot: int, done: bool) -> NS:
        return NS(rid=rid, kv=NS(mamba_pool_idx=[slot]), finished=lambda: done)

    running = [req("r2", 5, True), req("r4", 7, False)]
    scheduler = NS(running_batch=NS(reqs=running), chunked_req=req("c1", 9, False))
    assert _request_slots(scheduler, None) == {"r4 (running)": (7,), "c1 (chunked)": (9,)}
