"""The observe plugin's busy-side readers (conformance/sglang_plugins/observe.py), driven
with request objects shaped like SGLang's (``req.kv.mamba_ping_pong_*``); no server."""

from __future__ import annotations

import json
from types import SimpleNamespace

from conformance.sglang_plugins import observe
from conformance.token_digest import token_digest


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
    drain(8, 9, 3)  # 9 and 3 were never the tree's states
    observe.write_requests([{"ev": "prefill", "rid": "c", "prefix": 0, "extend": 70, "cut": False, "track": 64}])
    lines = [json.loads(l) for l in (tmp_path / "cell.requests.jsonl").read_text().splitlines()]
    assert [l for l in lines if l["ev"] == "state_evicted"] == [{"ev": "state_evicted", "len": 64, "key": token_digest(lost)}]
    assert observe._TREE_STATES == {7: (64, token_digest(kept))}
    assert observe.tree_reset(lambda c: "reset", cache) == "reset" and observe._TREE_STATES == {}  # a flush: slot 7 is no tree state now

    log = RequestLog(tmp_path / "cell.requests.jsonl")
    log.refresh()
    assert log.per_node and log.state_stored(kept) and log.state_stored(lost) and not log.state_stored(kept[:32])
    assert log.evicted_between(["a"], "c")  # old: the walk ran, so a's prefix "may have been evicted"
    assert log.state_evicted_between(kept, ["a"], "c") is False  # new: a's state is still in the tree
    assert log.state_evicted_between(lost, ["b"], "c") is True
    assert log.state_evicted_between(lost, ["b"], "a") is False  # freed after a's prefill, not before
    assert log.state_evicted_between(kept[:32], ["a"], "c") is None  # a prefix the tree never took a state for: no answer
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
