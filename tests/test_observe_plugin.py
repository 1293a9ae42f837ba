"""The observe plugin's busy-side readers (conformance/sglang_plugins/observe.py), driven
with request objects shaped like SGLang's (``req.kv.mamba_ping_pong_*``); no server."""

from __future__ import annotations

import json
from types import SimpleNamespace

from conformance.sglang_plugins import observe
from conformance.sglang_plugins.token_digest import token_digest


class Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


def req(*empty: bool):
    buf = None if not empty else object()
    return SimpleNamespace(kv=SimpleNamespace(mamba_ping_pong_track_buffer=buf, mamba_ping_pong_empty=list(empty) if empty else None))


def batch(reqs, decode=True):
    return SimpleNamespace(forward_mode=Mode(decode), reqs=reqs)


class Recorded:
    def __init__(self):
        self.value = None

    def set(self, v):
        self.value = v


def exporter(monkeypatch):
    ex = observe._Exporter()
    gauges: dict[str, Recorded] = {}
    monkeypatch.setattr(ex, "gauge", lambda name: gauges.setdefault(name, Recorded()))
    return ex, gauges


def test_track_slots_counts_held_ping_pong_slots():
    assert observe.track_slots(req(False, False)) == 2
    assert observe.track_slots(req(False, True)) == 1
    assert observe.track_slots(req()) == 0  # no buffer: no_buffer, or released


def test_decode_steps_accumulate_and_peaks_reset_after_an_idle_publish(monkeypatch):
    ex, g = exporter(monkeypatch)
    ex.step(batch([req(False, True), req(False, True)]))        # lazy between boundaries
    ex.step(batch([req(False, False), req(False, True)]))       # one request at its boundary
    ex.step(batch([req(False, False)], decode=False))           # a prefill batch is not counted
    assert g["decode_steps"].value == 2 and g["decode_req_steps"].value == 4 and g["track_slot_req_steps"].value == 5
    assert g["track_slots_req_peak"].value == 2 and g["track_slots_step_peak"].value == 3 and g["busy_periods"].value == 1
    ex.publish(SimpleNamespace())  # idle: readers of a bare object fail and publish nothing
    ex.step(batch([req(False, True)]))
    assert g["busy_periods"].value == 2 and g["track_slots_req_peak"].value == 1 and g["decode_running_peak"].value == 1
    assert g["track_slot_req_steps"].value == 6  # sums stay cumulative


class ExtendMode(Mode):
    def is_extend(self) -> bool:
        return True


def prefill(r, *, rid="a"):
    r.rid, r.prefix_len, r.extend_len = rid, 0, 300
    return observe.prefill_records(SimpleNamespace(chunked_req=None), SimpleNamespace(forward_mode=ExtendMode(False), reqs=[r]))


def test_a_prefill_record_reads_the_tracked_checkpoint_where_the_release_keeps_it():
    # 0.5.19+: the cache state, checkpoint included, lives on req.kv
    assert prefill(SimpleNamespace(kv=SimpleNamespace(mamba_last_track_seqlen=256)))[0]["track"] == 256
    # 0.5.16-0.5.18: req.kv is SGLang's ReqKvInfo of KV lengths only (set at allocation), the
    # checkpoint stays on the request (asking req.kv recorded every checkpoint as None)
    old = SimpleNamespace(kv=SimpleNamespace(kv_allocated_len=300, swa_evicted_seqlen=0), mamba_last_track_seqlen=256)
    assert prefill(old)[0]["track"] == 256
    assert prefill(SimpleNamespace(kv=None, mamba_last_track_seqlen=None))[0]["track"] is None  # 0.5.15: no kv; nothing tracked


def test_a_lazy_drop_is_seen_on_a_request_whose_kv_holds_only_kv_lengths(tmp_path, monkeypatch):
    monkeypatch.setattr(observe, "requests_path", lambda: str(tmp_path / "r.jsonl"))
    r = SimpleNamespace(rid="a", kv=SimpleNamespace(kv_allocated_len=300, swa_evicted_seqlen=0), mamba_last_track_seqlen=256)

    def prealloc(batch):
        r.mamba_last_track_seqlen = None  # SGLang dropped the kept checkpoint

    observe.lazy_prealloc_observed(prealloc, SimpleNamespace(reqs=[r], seq_lens_cpu=SimpleNamespace(tolist=lambda: [512])))
    assert [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()] == [
        {"ev": "lazy_drop", "rid": "a", "was": 256, "seq_len": 512}]


def test_the_before_hook_never_raises_into_sglang(monkeypatch):
    ex, _ = exporter(monkeypatch)
    monkeypatch.setattr(observe, "_EXPORTER", ex)
    assert observe.before_run_batch(object(), SimpleNamespace(forward_mode=Mode(True), reqs=None)) is None


def pool_scheduler(mamba: int | None, kv: int):
    stats = SimpleNamespace(mamba_num_used=mamba, full_num_used=kv)
    return SimpleNamespace(pool_stats_observer=SimpleNamespace(get_pool_stats=lambda: stats))


def test_pool_peaks_cover_prefill_batches_and_reset_with_the_window(monkeypatch):
    ex, g = exporter(monkeypatch)
    monkeypatch.setattr(observe, "_EXPORTER", ex)
    observe.before_run_batch(pool_scheduler(3, 300), batch([req(False, False)], decode=False))  # prefill of one request
    observe.before_run_batch(pool_scheduler(9, 900), batch([req(False, False)] * 3))            # decode of three
    observe.before_run_batch(pool_scheduler(6, 610), batch([req(False, False)] * 2))
    assert g["mamba_used_peak"].value == 9 and g["kv_used_peak"].value == 900 and g["busy_periods"].value == 1
    assert g["decode_steps"].value == 2  # the prefill batch opened the window but is no decode step
    ex.publish(SimpleNamespace())
    observe.before_run_batch(pool_scheduler(1, 40), batch([req(False, True)]))
    assert g["mamba_used_peak"].value == 1 and g["kv_used_peak"].value == 40 and g["busy_periods"].value == 2
    observe.before_run_batch(pool_scheduler(None, 50), batch([req(False, True)]))  # a pool without a mamba term
    assert g["mamba_used_peak"].value == 1 and g["kv_used_peak"].value == 50


def test_evidence_counters_count_cuts_and_evictions_and_change_nothing(monkeypatch):
    """The programs' oracle relaxes only on these (issue 26): an extend batch holding the
    scheduler's chunked request is a cut; an eviction walk that evicted anything counts."""
    ex, g = exporter(monkeypatch)
    monkeypatch.setattr(observe, "_EXPORTER", ex)
    cut, other = req(), req()
    sched = SimpleNamespace(chunked_req=cut)
    ex.cut(sched, batch([cut, other], decode=False))
    ex.cut(sched, batch([other], decode=False))  # the chunked request is not in this batch
    ex.cut(sched, batch([cut], decode=True))  # a decode batch cuts nothing
    ex.cut(SimpleNamespace(chunked_req=None), batch([cut], decode=False))
    assert g["prefill_cuts_total"].value == 1
    result = SimpleNamespace(num_tokens_evicted=0, swa_num_tokens_evicted=0, mamba_num_evicted=2)
    assert observe.evict_counted(lambda cache, params: result, object(), "params") is result
    nothing = SimpleNamespace(num_tokens_evicted=0, swa_num_tokens_evicted=0, mamba_num_evicted=0)
    observe.evict_counted(lambda cache, params: nothing, object(), "params")
    assert g["evictions_total"].value == 1
    ex.publish(SimpleNamespace())  # an idle publish exports both, so /metrics has them from the first idle moment
    assert g["evictions_total"].value == 1 and g["prefill_cuts_total"].value == 1


def test_idle_publish_carries_sglangs_pool_stats_mamba_terms_on_a_legacy_scheduler(monkeypatch):
    """0.5.11 computes PoolStats.mamba_* but exports only sglang:mamba_usage: the plugin
    publishes the terms from the scheduler mixin's get_pool_stats (no pool_stats_observer)."""
    ex, g = exporter(monkeypatch)
    stats = SimpleNamespace(mamba_num_used=3, mamba_available_size=40, mamba_evictable_size=5, full_num_used=0)
    ex.publish(SimpleNamespace(get_pool_stats=lambda: stats))
    assert (g["mamba_used"].value, g["mamba_available"].value, g["mamba_evictable"].value) == (3, 40, 5)
    ex2, g2 = exporter(monkeypatch)
    ex2.publish(pool_scheduler(None, 10))  # a pool without a mamba term publishes none
    assert "mamba_used" not in g2


def test_an_eviction_walk_is_recorded_in_the_per_request_file(tmp_path, monkeypatch):
    """Each counted walk is also a line among the prefill records, so the oracle can order it
    after a burst member's store (conformance/programs/evidence.py: RequestLog.evicted_between)."""
    from conformance.programs.evidence import RequestLog
    from conformance.sglang_plugins.activation import REPORT_ENV

    ex, g = exporter(monkeypatch)
    monkeypatch.setattr(observe, "_EXPORTER", ex)
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    observe.write_requests([{"ev": "start"}, {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 130, "cut": False, "track": 128}])
    walk = SimpleNamespace(num_tokens_evicted=127, swa_num_tokens_evicted=0, mamba_num_evicted=1)
    kv_short = SimpleNamespace(num_tokens=120, swa_num_tokens=0, mamba_num=0)  # the walk's EvictParams: a KV shortfall
    assert observe.evict_counted(lambda cache, params: walk, object(), kv_short) is walk
    observe.evict_counted(lambda cache, params: SimpleNamespace(num_tokens_evicted=0, swa_num_tokens_evicted=0, mamba_num_evicted=0), object(), "p")
    observe.write_requests([{"ev": "prefill", "rid": "b", "prefix": 0, "extend": 131, "cut": False, "track": 128}])
    lines = (tmp_path / "cell.requests.jsonl").read_text().splitlines()
    assert [l for l in lines if '"evict"' in l] == ['{"ev": "evict", "num_tokens_evicted": 127, "swa_num_tokens_evicted": 0, "mamba_num_evicted": 1, '
                                                   '"asked_num_tokens": 120, "asked_swa_num_tokens": 0, "asked_mamba_num": 0}']
    log = RequestLog(tmp_path / "cell.requests.jsonl")
    log.refresh()
    assert log.evicted_between(["a"], "b") and not log.evicted_between(["b"], "a")
    assert g["evictions_total"].value == 1


def test_a_walk_of_a_tree_that_follows_its_own_lru_lists_says_so(tmp_path, monkeypatch):
    """A tree with LRU lists and no eviction strategy (MambaRadixCache up to 0.5.15) marks its
    walk records ``order: lru_lists``; the unified tree (a core, a strategy) does not."""
    from conformance.sglang_plugins.activation import REPORT_ENV

    ex, _ = exporter(monkeypatch)
    monkeypatch.setattr(observe, "_EXPORTER", ex)
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    walk = SimpleNamespace(num_tokens_evicted=127, swa_num_tokens_evicted=0, mamba_num_evicted=1)

    class MambaRadixCache:
        full_lru_list = mamba_lru_list = ()

    class UnifiedRadixCache(MambaRadixCache):
        tree_core = object()

    observe.evict_counted(lambda cache, params: walk, MambaRadixCache(), "p")
    observe.evict_counted(lambda cache, params: walk, UnifiedRadixCache(), "p")
    records = [json.loads(line) for line in (tmp_path / "cell.requests.jsonl").read_text().splitlines()]
    assert [(r.get("order"), r.get("tree")) for r in records] == [("lru_lists", "MambaRadixCache"), (None, None)]


def test_a_state_the_tree_took_and_an_eviction_step_freed_is_recorded_per_node(tmp_path, monkeypatch):
    """Per-node eviction evidence (issue 26, finding 1): the insert hook remembers which pool
    slot holds the state of which prefix; the eviction-step hook records the prefix whose state
    it freed.  The walk record alone (old evidence) says "an eviction ran" for every stored
    prefix; per node, only the prefix actually evicted is."""
    import torch
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from conformance.programs.evidence import RequestLog
    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setattr(observe, "_TREE_STATES", {})
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    cache = SimpleNamespace(disable=False)

    def insert(tokens, slot, exist=False):
        params = SimpleNamespace(key=SimpleNamespace(token_ids=list(tokens)), mamba_value=torch.tensor([slot]))
        result = SimpleNamespace(mamba_exist=exist)
        assert observe.state_stored(lambda c, p: result, cache, params) is result

    def drain(*slots):
        frees = {ComponentType.MAMBA: [torch.tensor([s]) for s in slots], ComponentType.FULL: [torch.tensor([900, 901])]}
        step = SimpleNamespace(device_frees=frees)

        def original(c, r):  # SGLang's drain consumes the frees
            r.device_frees.clear()
            return "drained"
        assert observe.state_freed(original, cache, step) == "drained"

    kept, lost = list(range(1, 65)), list(range(100, 164))
    observe.write_requests([{"ev": "start", "state_evictions": True}, {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 64, "cut": False, "track": 64}])
    insert(kept, 7)
    observe.write_requests([{"ev": "prefill", "rid": "b", "prefix": 0, "extend": 64, "cut": False, "track": 64}])
    insert(lost, 8)
    insert(lost, 9, exist=True)  # a state already there: slot 9 stays the request's, not the tree's
    observe.write_requests([{"ev": "evict", "num_tokens_evicted": 64, "swa_num_tokens_evicted": 0, "mamba_num_evicted": 1}])
    observe._within("walk", drain, 8, 9, 3)  # SGLang's eviction walk; 9 and 3 were never the tree's states
    elsewhere = list(range(200, 264))
    insert(elsewhere, 10)
    drain(10)  # freed outside any walk: no eviction
    observe.write_requests([{"ev": "prefill", "rid": "c", "prefix": 0, "extend": 70, "cut": False, "track": 64}])
    lines = [json.loads(l) for l in (tmp_path / "cell.requests.jsonl").read_text().splitlines()]
    assert [l for l in lines if l["ev"] == "state_evicted"] == [{"ev": "state_evicted", "len": 64, "key": token_digest(lost), "by": "walk"},
                                                               {"ev": "state_evicted", "len": 64, "key": token_digest(elsewhere), "by": "other"}]
    assert observe._TREE_STATES == {7: (64, token_digest(kept))}
    assert observe.tree_reset(lambda c: "reset", cache) == "reset" and observe._TREE_STATES == {}  # a flush: slot 7 is no tree state now

    log = RequestLog(tmp_path / "cell.requests.jsonl")
    log.refresh()
    assert log.per_node and log.state_stored(kept) and log.state_stored(lost) and not log.state_stored(kept[:32])
    assert log.evicted_between(["a"], "c")  # old: the walk ran, so a's prefix "may have been evicted"
    assert log.state_evicted_between(kept, ["a"], "c") is False  # new: a's state is still in the tree
    assert log.state_evicted_between(lost, ["b"], "c") is True
    assert log.state_evicted_between(lost, ["b"], "a") is None  # taken only after a's prefill: no state a could have missed
    assert log.state_evicted_between(kept[:32], ["a"], "c") is None  # a prefix the tree never took a state for: no answer
    assert log.state_evicted_between(elsewhere, ["b"], "c") is False  # freed, but not by an eviction walk
    assert log.state_evicted_between(elsewhere, ["b"], "c", by=("walk", "other")) is True
    legacy = RequestLog(tmp_path / "legacy.requests.jsonl")
    legacy.add({"ev": "start"})  # a server without the per-node hooks: no answer, not "not evicted"
    assert legacy.state_evicted_between(lost, ["b"], "c") is None and legacy.state_stored(lost) is None


def test_the_per_node_hooks_never_break_the_server(monkeypatch):
    """A value shaped unlike SGLang's makes no record and changes no result."""
    monkeypatch.setattr(observe, "_TREE_STATES", {})
    weird = SimpleNamespace(key=None, mamba_value=object())
    assert observe.state_stored(lambda c, p: "r", SimpleNamespace(), weird) == "r"
    assert observe.state_freed(lambda c, r: "d", SimpleNamespace(), SimpleNamespace()) == "d"
    assert observe._TREE_STATES == {}


class _Registry:
    """SGLang's hook registry as the per-node planner uses it: AROUND hooks patched onto class
    attributes at ``apply`` (``skip``: targets it fails to patch, as SGLang logs and carries on)."""

    def __init__(self, skip=()):
        self.hooks, self.skip = {}, set(skip)

    def register(self, target, hook, kind):
        assert kind == "around"
        self.hooks[target] = hook

    def apply(self):
        import pkgutil

        for target, hook in self.hooks.items():
            if target in self.skip:
                continue
            owner, attr = target.rsplit(".", 1)
            cls = pkgutil.resolve_name(owner)
            original = getattr(cls, attr)
            setattr(cls, attr, lambda *a, _o=original, _h=hook, **k: _h(_o, *a, **k))


def _trees(monkeypatch, **classes):
    import sys
    import types

    module = types.ModuleType("fake_trees")
    for name, cls in classes.items():
        setattr(module, name, cls)
        cls.__module__, cls.__qualname__ = "fake_trees", name
    monkeypatch.setitem(sys.modules, "fake_trees", module)
    monkeypatch.setattr(observe, "STATE_TREES", tuple(f"fake_trees.{n}" for n in (*classes, "Gone")))


def _start(tmp_path, monkeypatch, registry):
    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    start_line = observe.register_state_hooks(registry, "around")
    registry.apply()
    hooked = start_line()
    return hooked, json.loads((tmp_path / "cell.requests.jsonl").read_text().splitlines()[-1])


def test_per_node_plans_are_chosen_per_tree_class_by_what_the_release_has(tmp_path, monkeypatch):
    """Newest removal point first (the step result, then the frees drain, then the public walk
    with the tree's own state list); a subclass's inherited method is hooked where it is
    defined; a tree class the release lacks (``Gone``) asks for nothing."""
    class Mamba:  # MambaRadixCache up to 0.5.20: the walk plan
        def insert(self, params): ...
        def reset(self): ...
        def evict(self, params): ...
        def all_mamba_values_flatten(self): ...

    class HiMamba(Mamba):  # its own evict and reset, the parent's insert
        def evict(self, params): ...
        def reset(self): ...

    class Unified:  # 0.5.17-0.5.22: the drain plan (evict is there too, the drain is preferred)
        def insert(self, params): ...
        def reset(self): ...
        def evict(self, params): ...
        def all_mamba_values_flatten(self): ...
        def _drain_device_frees(self, frees): ...

    _trees(monkeypatch, Unified=Unified, Mamba=Mamba, HiMamba=HiMamba)
    hooks, plans, missing = observe.state_hook_plan()
    assert plans == {"Unified": "drain", "Mamba": "walk", "HiMamba": "walk"} and missing == []
    assert {t: h.__name__ for t, h in hooks.items()} == {
        "fake_trees.Unified.insert": "state_stored", "fake_trees.Unified.reset": "tree_reset",
        "fake_trees.Unified._drain_device_frees": "state_freed",
        "fake_trees.Mamba.insert": "state_stored", "fake_trees.Mamba.reset": "tree_reset", "fake_trees.Mamba.evict": "states_left",
        "fake_trees.HiMamba.reset": "tree_reset", "fake_trees.HiMamba.evict": "states_left",
    }
    hooked, start = _start(tmp_path, monkeypatch, _Registry())
    assert sorted(hooked) == sorted(hooks)
    assert start == {"ev": "start", "state_evictions": True, "state_plans": plans, "state_missing": []}


def test_each_releases_caching_entry_points_are_hooked_for_the_state_position_rule(monkeypatch):
    """0.5.21 caches a finished request through ``insert_req`` and a chunk through
    ``cache_unfinished_req``; 0.5.22 on through ``checkpoint_into_tree``: whichever a tree
    class has is hooked so an insert knows whose state it takes."""
    class Unified021:
        def insert(self, params): ...
        def reset(self): ...
        def _drain_device_frees(self, frees): ...
        def insert_req(self, req, *, up_to): ...
        def cache_unfinished_req(self, req, chunked=False): ...

    class Unified023:
        def insert(self, params): ...
        def reset(self): ...
        def _apply_eviction_result(self, result): ...
        def checkpoint_into_tree(self, req, *, up_to): ...

    _trees(monkeypatch, Unified021=Unified021, Unified023=Unified023)
    hooks, _, missing = observe.state_hook_plan()
    caching = sorted(t for t, h in hooks.items() if h is observe.caching_req)
    assert missing == [] and caching == ["fake_trees.Unified021.cache_unfinished_req", "fake_trees.Unified021.insert_req",
                                         "fake_trees.Unified023.checkpoint_into_tree"]


def test_a_tree_class_missing_a_hook_leaves_per_node_off_and_says_why(tmp_path, monkeypatch):
    """One tree class of the release without a removal point (here: a walk but no list of the
    tree's states), or one hook SGLang's registry did not apply: per_node stays False (the
    oracle's per-node permissions stay closed) and the start line names the gap."""
    class Mamba:
        def insert(self, params): ...
        def reset(self): ...
        def evict(self, params): ...  # no all_mamba_values_flatten: what a walk removed cannot be seen

    class Unified:
        def insert(self, params): ...
        def reset(self): ...
        def _drain_device_frees(self, frees): ...

    _trees(monkeypatch, Unified=Unified, Mamba=Mamba)
    hooks, plans, missing = observe.state_hook_plan()
    assert hooks == {} and plans == {"Unified": "drain"}
    assert missing == ["Mamba lacks a removal point (_apply_eviction_result, _drain_device_frees, or evict with all_mamba_values_flatten)"]
    hooked, start = _start(tmp_path, monkeypatch, _Registry())
    assert hooked == [] and start["state_evictions"] is False and start["state_missing"] == missing

    Mamba.all_mamba_values_flatten = lambda self: None  # now complete, but the registry fails one target
    (tmp_path / "cell.requests.jsonl").unlink()
    hooked, start = _start(tmp_path, monkeypatch, _Registry(skip={"fake_trees.Unified.reset"}))
    assert "fake_trees.Unified.reset" not in hooked and len(hooked) == 5
    assert start["state_evictions"] is False and start["state_missing"] == ["hook on fake_trees.Unified.reset was not applied"]


def test_a_walk_records_the_remembered_states_the_tree_no_longer_holds(tmp_path, monkeypatch):
    """The walk plan (no drain to read): after a walk that evicted anything, a remembered slot
    missing from the tree's own state list is recorded evicted; a walk that evicted nothing
    costs no tree scan and records nothing."""
    import torch

    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    monkeypatch.setattr(observe, "_TREE_STATES", {3: (64, "aa"), 5: (96, "bb")})
    scans = []
    tree = SimpleNamespace(all_mamba_values_flatten=lambda: scans.append(1) or torch.tensor([3, 7]))
    idle = SimpleNamespace(num_tokens_evicted=0, swa_num_tokens_evicted=0, mamba_num_evicted=0)
    assert observe.states_left(lambda c, p: idle, tree, "params") is idle and scans == []
    walk = SimpleNamespace(num_tokens_evicted=32, swa_num_tokens_evicted=0, mamba_num_evicted=1)
    assert observe.states_left(lambda c, p: walk, tree, "params") is walk
    assert observe._TREE_STATES == {3: (64, "aa")}
    assert [json.loads(l) for l in (tmp_path / "cell.requests.jsonl").read_text().splitlines()] == [{"ev": "state_evicted", "len": 96, "key": "bb", "by": "walk"}]
    broken = SimpleNamespace(all_mamba_values_flatten=lambda: 1 / 0)
    assert observe.states_left(lambda c, p: walk, broken, "params") is walk  # an observer never breaks the server


def test_a_walk_hook_shares_its_target_with_the_eviction_counter_as_one_hook(tmp_path, monkeypatch):
    """Where the walk plan and the eviction counter hook the same ``evict`` (MambaRadixCache,
    UnifiedRadixCache up to 0.5.16), one AROUND hook does both, the walk's ``state_evicted``
    records first, then its ``evict`` record (conformance/checks/eviction_order.py reads a
    walk's victims as the state records before its walk record)."""
    import torch

    from conformance.checks.eviction_order import kv_walk_victims

    class Mamba:
        def insert(self, params): ...
        def reset(self): ...
        def evict(self, params):
            self.held = [3]
            return SimpleNamespace(num_tokens_evicted=64, swa_num_tokens_evicted=0, mamba_num_evicted=1)
        def all_mamba_values_flatten(self):
            return torch.tensor(self.held)

    _trees(monkeypatch, Mamba=Mamba)
    monkeypatch.setattr(observe, "_EXPORTER", exporter(monkeypatch)[0])
    counters = {"fake_trees.Mamba.evict": observe.evict_counted}
    registry = _Registry()
    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    start_line = observe.register_state_hooks(registry, "around", outer=counters)
    assert counters == {} and list(registry.hooks) == ["fake_trees.Mamba.insert", "fake_trees.Mamba.reset", "fake_trees.Mamba.evict"]
    registry.apply()
    assert start_line() and observe._TREE_STATES == {}
    monkeypatch.setattr(observe, "_TREE_STATES", {3: (64, "aa"), 5: (96, "bb")})
    tree = Mamba()
    tree.evict(SimpleNamespace(num_tokens=50, swa_num_tokens=0, mamba_num=0))
    records = [json.loads(l) for l in (tmp_path / "cell.requests.jsonl").read_text().splitlines()]
    assert [r["ev"] for r in records] == ["start", "state_evicted", "evict"]
    assert kv_walk_victims(records) == ([(96, "bb")], 1, 0)


def test_a_pressure_record_hooks_every_target_the_release_has(monkeypatch):
    """0.5.18 carries ``MambaRadixCache`` beside the unified tree it runs: hooking only the first
    split target found watched a tree the server never built, and splits read 0 there."""
    registered = []
    registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
    targets = ("json.NoSuchClass.method", "json.JSONEncoder.encode", "json.JSONDecoder.decode")
    monkeypatch.setattr(observe, "PRESSURE_TARGETS", {"split": (observe.split_observed, targets)})
    chosen = observe.register_pressure_hooks(registry, "around")
    assert registered == ["json.JSONEncoder.encode", "json.JSONDecoder.decode"]
    assert [t for t, _ in chosen["split"]] == registered


def _insert_once(monkeypatch, tmp_path, req, key_len: int, page_size: int) -> list[dict]:
    """Cache ``req`` through the caching hook, inside which the tree's insert takes a state
    under a ``key_len``-token key; the per-request records written."""
    monkeypatch.setattr(observe, "requests_path", lambda: str(tmp_path / "r.jsonl"))
    monkeypatch.setattr(observe, "_AUDITOR", observe.Auditor())
    monkeypatch.setattr(observe, "_TREE_STATES", {})
    cache = type("UnifiedRadixCache", (), {"page_size": page_size})()
    params = SimpleNamespace(mamba_value=SimpleNamespace(reshape=lambda *_: SimpleNamespace(tolist=lambda: [7])),
                             key=SimpleNamespace(token_ids=list(range(key_len))))

    def caching(cache, req):
        return observe.state_stored(lambda c, p: SimpleNamespace(mamba_exist=False), cache, params)

    observe.caching_req(caching, cache, req)
    return [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]


def test_an_insert_keyed_at_the_page_floor_of_the_tracked_length_is_a_violation(tmp_path, monkeypatch):
    """0.5.23 on page 64: a streaming turn starting at 71 tokens tracks its state at 199 and the
    tree keys it at 192 -- the insert names rule ``state_position`` (and announces the rule ran)."""
    req = SimpleNamespace(rid="t3", kv=SimpleNamespace(mamba_last_track_seqlen=199, mamba_prev_track_seqlen=None))
    records = _insert_once(monkeypatch, tmp_path, req, 192, 64)
    assert [r["ev"] for r in records] == ["state_stored", "tree_audit_rules", "tree_violation"]
    assert records[2]["rule"] == "state_position" and records[2]["path"] == "192" and "page floor of 199" in records[2]["line"]
    assert "state_position" in records[1]["rules"]


def test_an_insert_keyed_where_the_state_was_tracked_only_announces_the_rule(tmp_path, monkeypatch):
    req = SimpleNamespace(rid="r1", mamba_last_track_seqlen=256)  # up to 0.5.18 the field sits on the request
    records = _insert_once(monkeypatch, tmp_path, req, 256, 64)
    assert [r["ev"] for r in records] == ["state_stored", "tree_audit_rules"]
    (tmp_path / "n").mkdir()
    untracked = _insert_once(monkeypatch, tmp_path / "n", SimpleNamespace(rid="n"), 71, 1)
    assert [r["ev"] for r in untracked] == ["state_stored"]  # no tracked length (no_buffer): the rule does not run
