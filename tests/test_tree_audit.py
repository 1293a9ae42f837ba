"""The tree audit's rules (``conformance/sglang_plugins/tree_audit.py``) on hand-built trees:
each rule passes a good tree and names its rule and the node's path on a seeded violation;
a rule whose inputs the view lacks (the Rust core gives no node) does not run."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace as NS

import pytest

from conformance.sglang_plugins.tree_audit import (RULE_NAMES, RULES, SGLANG_RULE, Auditor, NodeView, TreeView, _request_slots, _unowned, judge,
                                                 sglang_check, state_position)


def good(**changes) -> TreeView:
    """Root -> a (64 tokens, mamba slot 3) -> b (16 tokens, slot 5); root -> c (32, no state)."""
    nodes = (
        NodeView((64,), True, {"full": 0, "mamba": 0}, (3,), True),
        NodeView((64, 16), True, {"full": 0, "mamba": 0}, (5,), True),
        NodeView((32,), True, {"full": 0, "mamba": 0}, (), False),
    )
    view = TreeView("fake/python", 16, idle=True, nodes=nodes, lru_strays=0, tree_slots=(3, 5), free_slots=frozenset({1, 2, 4}),
                    request_slots={}, state_lens={3: 64, 5: 80}, protected={"full": 0, "mamba": 0},
                    unowned=frozenset({0}), reserved=frozenset({0}))
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
    "slot_owned": (good(unowned=frozenset({0, 4})), ""),
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
    assert found == [] and ran == ["protected_at_idle", "slot_used", "slot_once", "slot_owned"]
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
    assert sglang_check(NS()) is None  # no check: the rule does not run
    session_over_chunk_cache = NS(sanity_check=lambda: NS().sanity_check())  # SGLang's session wrapper forwarding to a ChunkCache
    assert sglang_check(session_over_chunk_cache) is None
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


def _scheduler(free, **groups) -> NS:
    """A scheduler whose mamba allocator has slots 1..8 (0: SGLang's padding slot) and ``free``."""
    pool = NS(mamba_allocator=NS(size=8, free_slots=list(free)))
    base = dict(running_batch=NS(reqs=[]), last_batch=None, cur_batch=None, chunked_req=None, waiting_queue=[], result_queue=[])
    return NS(req_to_token_pool=pool, **{**base, **groups})


def _req(rid: str, slot: int, pingpong=(-1, -1)) -> NS:
    return NS(rid=rid, kv=NS(mamba_pool_idx=[slot], mamba_ping_pong_track_buffer=list(pingpong), mamba_cow_src_index=None))


def test_a_used_slot_no_tree_node_and_no_request_holds_is_unowned() -> None:
    """Owners: the tree, and every request the scheduler holds anywhere (running with its ping-pong
    slots, the last batch awaiting its results, the result queue, the waiting queue)."""
    scheduler = _scheduler({6, 7}, running_batch=NS(reqs=[_req("r1", 1, (2, 3))]), last_batch=NS(reqs=[_req("r2", 4)]),
                           result_queue=[(NS(reqs=[_req("r3", 5)]), None)])
    assert _unowned(scheduler, None, (8,), frozenset({6, 7}), True) == frozenset({0})  # the padding only
    assert _unowned(scheduler, None, (), frozenset({6, 7}), True) == frozenset({0, 8})  # the tree let go of 8: nobody holds it
    assert _unowned(scheduler, None, (8,), frozenset({6, 7}), False) is None  # a session holds the tree: owners unseen


def test_the_auditor_takes_the_padding_at_the_first_idle_audit_and_names_a_later_leak(monkeypatch) -> None:
    import conformance.sglang_plugins.tree_audit as audit

    views = iter([good(reserved=None), good(reserved=None, idle=False, unowned=frozenset({0, 4}))])
    monkeypatch.setattr(audit, "read_tree", lambda *a, **k: next(views))
    auditor, tree = Auditor(), NS(tree_cache=NS())
    assert [v for v in auditor.run(tree, None, idle=True, state_lens={}) if hasattr(v, "rule")] == []
    (leak,) = [v for v in auditor.run(tree, None, idle=False, state_lens={}) if hasattr(v, "rule")]
    assert auditor.reserved == frozenset({0}) and leak.rule == "slot_owned" and "mamba slot 4" in leak.line


def test_sglangs_idle_only_check_refusing_a_busy_tree_is_not_a_violation() -> None:
    """``MambaRadixCache`` up to 0.5.18 raises a plain Exception on any lock: a finding at idle only."""
    def check() -> None:
        raise Exception("Mamba Radix tree sanity check failed: x_lru should not be locked when idle")

    assert sglang_check(NS(sanity_check=check), idle=False) is None
    (v,) = sglang_check(NS(sanity_check=check), idle=True)
    assert v.rule == SGLANG_RULE and "locked when idle" in v.line


def test_a_session_wrapper_that_is_the_tree_cache_holding_kv_hides_the_owners() -> None:
    """Up to 0.5.18 the streaming-session wrapper is the scheduler's tree cache itself: while it holds
    KV the tree is not idle and the slot owners are out of sight (slot_owned does not run)."""
    from conformance.sglang_plugins.tree_audit import read_tree

    class RustCore:  # a core the reader knows (its module names it)
        __module__ = "sglang.srt.mem_cache.rust_tree_core.core"

    def scheduler(holding: bool, core=RustCore) -> NS:
        cache = NS(any_holding_kv=lambda: holding, page_size=1, all_mamba_values_flatten=lambda: [3], tree_core=core())
        return _scheduler({1, 2, 4, 5, 6, 7, 8}, tree_cache=cache)

    held = read_tree(scheduler(True), None, idle=True, state_lens={})
    assert not held.idle and held.unowned is None
    free = read_tree(scheduler(False), None, idle=True, state_lens={})
    assert free.idle and free.unowned == frozenset({0})
    hicache = scheduler(False)
    hicache.tree_cache.cache_controller = object()  # a host tier stages slots the audit does not see
    assert read_tree(hicache, None, idle=True, state_lens={}).unowned is None
    unknown = read_tree(scheduler(False, core=type("OtherCore", (), {})), None, idle=True, state_lens={})
    assert unknown.unowned is None  # a tree of another shape (0.5.14's session wrapper): its owners are not known


class _Key(tuple):
    """A radix key: its tokens, and the first page its parent files it under."""

    def child_key(self, page_size: int) -> tuple:
        return tuple(self[:page_size])


def _older_unified_tree():
    """A tree shaped like 0.5.16's ``UnifiedRadixCache``: no core, its components named
    ``tree_components``; root -> a (2 tokens, mamba slot 7, in the mamba LRU list)."""
    ct = pytest.importorskip("sglang.srt.mem_cache.unified_cache.component_type").ComponentType
    root = NS(children={}, parent=None, key=_Key(), id=0)
    a = NS(children={}, parent=root, key=_Key((5, 6)), id=1,
           component_data={ct.FULL: NS(value=None, lock_ref=0), ct.MAMBA: NS(value=[7], lock_ref=0)})
    root.children[(5,)] = a
    return NS(root_node=root, tree_components=(ct.FULL, ct.MAMBA), lru_lists={ct.MAMBA: NS(cache={1: a})})


def test_the_reader_reads_an_older_unified_tree_that_names_its_components_tree_components() -> None:
    """0.5.16's tree names its components ``tree_components``: read as ``component_types``
    they were none, every node read as holding no mamba value, and ``lru_exact`` named the
    first stored state at once ("in the mamba LRU list without a mamba value")."""
    from conformance.sglang_plugins.tree_audit import _python_nodes

    nodes, strays = _python_nodes(_older_unified_tree(), 1)
    assert [(n.path, n.mamba, n.in_mamba_lru) for n in nodes] == [((2,), (7,), True)] and strays == 0
    view = replace(good(), page_size=1, nodes=nodes, lru_strays=strays, tree_slots=(7,), free_slots=frozenset({1, 2}), state_lens={7: 2})
    assert judge(view)[0] == []


def test_a_tree_naming_no_components_is_not_read_as_empty_nodes() -> None:
    from conformance.sglang_plugins.tree_audit import _python_nodes

    tree = _older_unified_tree()
    del tree.tree_components
    with pytest.raises(AttributeError, match="names no components"):
        _python_nodes(tree, 1)


def test_a_state_keyed_at_the_page_floor_of_its_tracked_length_breaks_state_position() -> None:
    """Rule ``state_position`` (judged at each insert): a state tracked at 199 tokens keyed at 192
    (page 64) names the rule, the key, the tracked length and the page floor."""
    v = state_position(192, "t3", (199,), 64)
    assert v is not None and v.rule == "state_position" and v.where() == "192"
    assert "tracked its state at 199 tokens" in v.line and "page floor of 199" in v.line
    other = state_position(100, "x", (128,), 16)  # keyed short of its tracked length, not its page floor
    assert other is not None and "page floor" not in other.line


def test_a_state_keyed_where_it_was_tracked_or_of_a_request_tracking_nothing_holds() -> None:
    assert state_position(192, "t3", (192,), 64) is None
    assert state_position(128, "r", (256, 128), 64) is None  # the finished request's previous checkpoint (overshoot)
    assert state_position(71, "r", (), 64) is None  # nothing tracked (no_buffer): the rule does not judge it


def test_a_rule_judged_at_an_insert_is_announced_once_per_tree() -> None:
    auditor = Auditor()
    (line,) = auditor.judged("UnifiedRadixCache/rust", "state_position")
    assert line.to_json()["rules"] == ["state_position"] and "state_position" not in line.to_json()["not_run"]
    assert auditor.judged("UnifiedRadixCache/rust", "state_position") == []
