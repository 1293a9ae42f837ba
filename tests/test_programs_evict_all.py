"""Evict, don't flush (issue 44): a program ends, and a mid-program flush starts, with SGLang's
own eviction walk over the whole tree, asked of the observe plugin
(conformance/sglang_plugins/evict_all.py) and judged by the runner; no server."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from conformance.programs.evidence import RequestLog
from conformance.programs.runner import ProgramFailure, ProgramRun, RunStats
from conformance.sglang_plugins import evict_all, observe
from conformance.sglang_plugins.activation import REPORT_ENV


class Tree:
    """A tree core's sizes and its evict entry point; ``stuck`` tokens and states the walk cannot free (a seeded bug)."""

    def __init__(self, tokens: int, states: int, *, stuck: int = 0) -> None:
        self.tokens, self.states, self.stuck, self.asked = tokens, states, stuck, None

    def evictable_size(self) -> int:
        return self.tokens

    def mamba_evictable_size(self) -> int:
        return self.states

    def protected_size(self) -> int:
        return 0

    def evict(self, params):
        self.asked = params
        freed = max(0, min(params.num_tokens, self.tokens) - self.stuck)
        states = max(0, min(params.mamba_num, self.states) - (1 if self.stuck else 0))
        self.tokens, self.states = self.tokens - freed, self.states - states
        return SimpleNamespace(num_tokens_evicted=freed, mamba_num_evicted=states)


def _scheduler(tree, running=()):
    return SimpleNamespace(tree_cache=tree, running_batch=SimpleNamespace(reqs=list(running)), waiting_queue=[])


def test_the_plugin_answers_a_request_at_idle_with_sglangs_evict_over_the_whole_tree(tmp_path):
    pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
    log = str(tmp_path / "cell.requests.jsonl")
    assert evict_all.serve(_scheduler(Tree(300, 4)), log) is None  # nothing asked
    (tmp_path / ("cell.requests.jsonl" + evict_all.REQUEST_SUFFIX)).write_text("t1")
    tree = Tree(300, 4)
    assert evict_all.serve(_scheduler(tree, running=["r"]), log) is None  # not idle: asked again later
    record = evict_all.serve(_scheduler(tree), log)
    assert record["id"] == "t1" and (tree.asked.num_tokens, tree.asked.mamba_num) == (300, 4)
    assert record["freed"]["num_tokens_evicted"] == 300 and record["held"]["evictable_size"] == 0
    assert evict_all.left_held(record) == {} and evict_all.serve(_scheduler(tree), log) is None  # answered once


class OldMambaTree(Tree):
    """``MambaRadixCache`` up to 0.5.18: ``evictable_size`` / ``protected_size`` declared and raising,
    the full sizes under ``full_*``."""

    def evictable_size(self) -> int:
        raise NotImplementedError

    def protected_size(self) -> int:
        raise NotImplementedError

    def full_evictable_size(self) -> int:
        return self.tokens

    def full_protected_size(self) -> int:
        return 0


def test_a_tree_whose_size_readers_raise_is_read_by_the_ones_it_answers(tmp_path):
    """The walk over 0.5.14's MambaRadixCache: answered (it once raised inside the plugin, which
    never answered, and the kit waited 30 s for nothing)."""
    pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
    log = str(tmp_path / "cell.requests.jsonl")
    (tmp_path / ("cell.requests.jsonl" + evict_all.REQUEST_SUFFIX)).write_text("t3")
    tree = OldMambaTree(200, 3)
    record = evict_all.serve(_scheduler(tree), log)
    assert record["before"] == {"evictable_size": 200, "protected_size": 0, "mamba_evictable_size": 3}
    assert (tree.asked.num_tokens, tree.asked.mamba_num) == (200, 3) and record["held"]["evictable_size"] == 0


def test_a_request_taken_is_answered_whatever_raises():
    import os
    import tempfile

    class Unreadable(Tree):
        def evictable_size(self) -> int:
            raise RuntimeError("a reader that breaks")

    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "c.requests.jsonl")
        open(log + evict_all.REQUEST_SUFFIX, "w").write("t4")
        record = evict_all.serve(_scheduler(Unreadable(5, 1)), log)
    assert record["id"] == "t4" and "RuntimeError: a reader that breaks" in record["error"]


def test_a_tree_the_release_cannot_drive_says_why():
    broken = SimpleNamespace(evict=lambda params: (_ for _ in ()).throw(TypeError("evict() takes 2 positional arguments")))
    record = None
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "c.requests.jsonl")
        open(log + evict_all.REQUEST_SUFFIX, "w").write("t2")
        record = evict_all.serve(_scheduler(broken), log)
    assert record["id"] == "t2" and "TypeError" in record["error"] and record["tree"] == "SimpleNamespace"


def _run(tmp_path, monkeypatch, tree):
    """A runner at its program's end, its server's plugin answering from a thread."""
    pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    log = RequestLog(tmp_path / "cell.requests.jsonl")
    observe.write_requests([{"ev": "start", "state_evictions": True}])
    log.refresh()
    stop = threading.Event()

    def plugin():
        while not stop.is_set():
            record = evict_all.serve(_scheduler(tree), observe.requests_path())
            if record:
                observe.write_requests([record])
            time.sleep(0.02)

    idle = []
    run = SimpleNamespace(t=SimpleNamespace(requests=log), stats=RunStats(), _idle_checks=lambda: idle.append(1),
                          fail=lambda *f: ProgramRun.fail(SimpleNamespace(step_no=3, trace=[], _new_violations=lambda: []), *f))
    thread = threading.Thread(target=plugin, daemon=True)
    thread.start()
    try:
        ProgramRun._evict_all(run)
    finally:
        stop.set()
        thread.join()
    return run, idle


def test_a_program_ends_with_the_walk_and_then_the_idle_invariant(tmp_path, monkeypatch):
    run, idle = _run(tmp_path, monkeypatch, Tree(512, 6))
    assert run.stats.evict_alls == 1 and idle == [1]


def test_a_walk_that_leaves_evictable_state_is_a_leak_finding(tmp_path, monkeypatch):
    with pytest.raises(ProgramFailure) as e:
        _run(tmp_path, monkeypatch, Tree(512, 6, stuck=64))
    finding = e.value.findings[0]
    assert finding.kind == "leak_mamba" and "evict-all" in finding.line and finding.facts["left"]["evictable_size"] == 64


def test_a_server_without_the_per_request_file_is_not_asked():
    run = SimpleNamespace(t=SimpleNamespace(requests=None), stats=RunStats())
    ProgramRun._evict_all(run)
    assert run.stats.evict_alls == 0
