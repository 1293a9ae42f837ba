"""Issue 26, per-request evidence: the oracle's cut and lazy-drop relaxations are granted
to the request SGLang was seen cutting (or dropping the checkpoint of), at the observed
place only (``evidence.RequestLog``, written by the observe plugin).  Each test shows the
window/bound behaviour admitting what the per-request one refuses, and the per-request
one admitting the same hit when the record is there.  No server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance.checks.hit_bounds import StrategyGrid, observed_cut_stores, seen_cut_stores
from conformance.errors import KitError
from conformance.programs.evidence import COUNTERS, Evidence, Prefill, RequestLog, request_log
from conformance.programs.oracle import HitBook, Limits, Served
from conformance.sglang_plugins import observe
from conformance.matrix.strategy import strategy_named
from test_oracle_evidence import _cut_burst as shared_cut_burst

LAZY = strategy_named("extra_buffer_lazy")
CUTS, EVICTIONS = COUNTERS["prefill_cuts"], COUNTERS["evictions"]


def _served(rid: str, prompt: tuple, out: tuple, cached: int, sent: int, done: int) -> Served:
    resp = {"output_ids": list(out), "meta_info": {"cached_tokens": cached, "prompt_tokens": len(prompt), "finish_reason": {"type": "length"}}}
    return Served(rid, 0, prompt, len(out), {}, sent, done, response=resp)


def _log(tmp_path, *records: dict) -> RequestLog:
    path = tmp_path / "cell.requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"ev": "start"}, *records)))
    log = RequestLog(path)
    log.refresh()
    return log


def _evidence(log: RequestLog | None, cuts: float = 0.0) -> Evidence:
    ev = Evidence(log)
    ev.reset(0, {EVICTIONS: 0.0, CUTS: 0.0})
    ev.note(100, {EVICTIONS: 0.0, CUTS: cuts})
    return ev


# ------------------------------------------------------------------ cuts
def _cut_burst(evidence: Evidence) -> list[str | None]:
    """test_oracle_evidence's burst of 20 members of a 386-token prompt sharing 321 tokens;
    member 12 hits 192 (here the per-request log names members by their program rid)."""
    return shared_cut_burst(evidence)[0].judge_problem


def test_a_cut_is_granted_to_the_request_sglang_cut_at_the_place_it_tracked(tmp_path) -> None:
    window = _cut_burst(_evidence(None, cuts=1))  # the window counter: some prefill was cut, any member may be
    assert not any(window)
    uncut = _cut_burst(_evidence(_log(tmp_path, {"ev": "prefill", "rid": "b.3", "prefix": 0, "extend": 386, "cut": False, "track": 384}), cuts=1))
    assert any(p and "cached_tokens 192" in p for p in uncut)  # the counter moved (another program's cut), no member was cut
    tmp = tmp_path / "other"
    tmp.mkdir()
    wrong_place = _cut_burst(_evidence(_log(tmp, {"ev": "prefill", "rid": "b.3", "prefix": 0, "extend": 236, "cut": True, "track": 128})))
    assert any(p and "cached_tokens 192" in p for p in wrong_place)  # tracked at 128, not 192
    tmp = tmp_path / "seen"
    tmp.mkdir()
    seen = _cut_burst(_evidence(_log(tmp, {"ev": "prefill", "rid": "b.3", "prefix": 0, "extend": 236, "cut": True, "track": 192},
                                     {"ev": "prefill", "rid": "b.3", "prefix": 236, "extend": 150, "cut": False, "track": 320})))
    assert not any(seen)


def test_observed_cut_stores_are_the_tracked_lengths_or_the_cut_points() -> None:
    prompt = tuple(range(400))
    chunks = [Prefill(0, 236, True, 192), Prefill(236, 150, False, 320)]
    assert {len(k) for k in observed_cut_stores(prompt, chunks, StrategyGrid(64, 1, 256, LAZY))} == {192, 320}
    assert {len(k) for k in observed_cut_stores(prompt, chunks, StrategyGrid(64, 1, 256, strategy_named("no_buffer")))} == {236}
    assert observed_cut_stores(prompt, [Prefill(0, 400, False, 384)], StrategyGrid(64, 1, 256, LAZY)) == set()  # not cut: nothing
    # without a buffer the last chunk stores the prompt's end once it completes it (not a chunk short of it, above)
    done = [Prefill(0, 192, True, None), Prefill(192, 59, False, None)]
    assert {len(k) for k in observed_cut_stores(prompt[:251], done, StrategyGrid(1, 1, 128, strategy_named("no_buffer")))} == {192, 251}


def test_a_seen_cut_stores_where_sglangs_rule_puts_each_chunk_not_where_it_claims() -> None:
    """The chunks are SGLang's scheduling (prefix, extend); the checkpoint of each is placed
    by SGLang's tracking rule, so a claim lost with the state (track None) loses no key."""
    prompt, eb = tuple(range(300)), StrategyGrid(64, 1, 256, strategy_named("extra_buffer"))
    chunks = [Prefill(0, 128, True, 128), Prefill(128, 128, True, None), Prefill(256, 44, False, None)]
    assert {len(k) for k in seen_cut_stores(prompt, chunks, eb, {None})} == {128, 256}
    assert {len(k) for k in seen_cut_stores(prompt, chunks, eb, {None, 192})} == {128}  # a branch point at 192 moves chunk 2's
    assert seen_cut_stores(prompt, chunks[:2], eb, {None}) == set()  # the prefill never ended
    assert seen_cut_stores(prompt, [chunks[0], Prefill(0, 300, False, 256)], eb, {None}) == set()  # retracted and run again
    assert seen_cut_stores(prompt, [Prefill(0, 300, False, 256)], eb, {None}) == set()  # never cut: the whole-prefill rule's


def _cut_request_follow_up(evidence: Evidence | None, hit: int) -> str | None:
    """A 300-token request SGLang cut at 128 and 256 (budget 128) beside a 100-token one, then
    its prompt + 5 hitting ``hit``."""
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")),
                   Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=128), evidence, server_rid=lambda rid: f"tag-{rid}")
    first, beside = _served("a", tuple(range(10, 310)), (5,), 0, 1, 3), _served("b", tuple(range(1000, 1100)), (5,), 0, 2, 4)
    follow = _served("f", first.input_ids + (7,) * 5, (3,), hit, 5, 6)
    for s in (first, beside, follow):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None and book.judge(beside) is None
    return book.judge(follow)


def test_a_checkpoint_lost_by_a_request_sglang_cut_is_a_finding(tmp_path) -> None:
    """cut_batch_checkpoint_dropped on the chunked-prefill cell: a request finishing its last
    chunk in a batch SGLang cut loses its checkpoint, and SGLang's own claim of it with it."""
    chunks = ({"ev": "prefill", "rid": "tag-a", "prefix": 0, "extend": 128, "cut": True, "track": 128},
              {"ev": "prefill", "rid": "tag-a", "prefix": 128, "extend": 128, "cut": True, "track": 256},
              {"ev": "prefill", "rid": "tag-a", "prefix": 256, "extend": 44, "cut": False, "track": None})
    assert _cut_request_follow_up(_evidence(None, cuts=1), 128) is None  # the window: cut beside another request, any page
    problem = _cut_request_follow_up(_evidence(_log(tmp_path, *chunks)), 128)
    assert problem and "cached_tokens 128" in problem and "256" in problem
    (tmp_path / "kept").mkdir()
    assert _cut_request_follow_up(_evidence(_log(tmp_path / "kept", *chunks)), 256) is None


def test_a_partial_read_of_the_log_fixes_nothing(tmp_path) -> None:
    """Seen on real SGLang (off-grid cell): a request was judged while the log read so far
    held only the first chunk of a burst member SGLang cut, and the member's alternatives
    were kept from that read: a later hit at its tracked 253 was refused."""
    path = tmp_path / "cell.requests.jsonl"
    first = [{"ev": "start"}, {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 189, "cut": True, "track": 128}]
    path.write_text("".join(json.dumps(r) + "\n" for r in first))
    log = RequestLog(path)
    log.refresh()
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")),
                   Limits(context_len=100000, kv_total=1e6, mamba_total=1000), _evidence(log, cuts=1))
    base = tuple(range(1000, 1255))
    a, b = _served("a", base + (1, 2, 3, 4), (5,), 0, 1, 3), _served("b", base + (6, 7, 8, 9), (5,), 253, 2, 4)
    for s in (a, b):
        book.add(s)
    book.ready([])
    assert book.judge(a) is None  # judged on the partial read: a's alternatives not kept
    with open(path, "a") as f:
        f.write(json.dumps({"ev": "prefill", "rid": "a", "prefix": 189, "extend": 70, "cut": False, "track": 253}) + "\n")
    log.refresh()
    assert book.judge(b) is None and b.permission == "cut_prefill"


def _evicted_follow_up(tmp_path, *between: dict, stored_at: str = "a") -> str | None:
    """Request a (130 tokens, its prefill checkpoint at 128 certain) beside a second root
    on a 1-slot pool, SGLang's eviction counter grown since, then a's first 128 tokens + 3
    hitting 0.  The log records per-node states (``state_stored`` / ``state_evicted``); a's
    state is taken after a's prefill (``stored_at="a"``), after c's, or never (``""``)."""
    from conformance.sglang_plugins.token_digest import token_digest

    a, other = _served("a", tuple(range(1000, 1130)), (5,), 0, 1, 2), _served("o", tuple(range(3000, 3130)), (5,), 0, 3, 4)
    again = _served("c", a.input_ids[:128] + (7, 8, 9), (3,), 0, 5, 6)
    stored = {"ev": "state_stored", "len": 128, "key": token_digest(a.input_ids[:128])}
    at = {k: [stored] if stored_at == k else [] for k in ("a", "c")}
    log = _log(tmp_path, {"ev": "start", "state_evictions": True}, {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 130, "cut": False, "track": 128},
               *at["a"], {"ev": "prefill", "rid": "o", "prefix": 0, "extend": 130, "cut": False, "track": 128}, *between,
               {"ev": "prefill", "rid": "c", "prefix": 0, "extend": 131, "cut": False, "track": 128}, *at["c"])
    ev = Evidence(log)
    ev.reset(0, {EVICTIONS: 0.0, CUTS: 0.0})
    ev.note(5, {EVICTIONS: 2.0, CUTS: 0.0})
    ev.note(7, {EVICTIONS: 2.0, CUTS: 0.0})
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")), Limits(context_len=100000, kv_total=1e6, mamba_total=1), ev)
    for s in (a, other, again):
        book.add(s)
    book.note_load(2, 0)
    book.ready([])
    assert book.judge(a) is None and book.judge(other) is None
    return book.judge(again)


def test_a_lost_hit_is_an_eviction_only_when_sglang_freed_that_state(tmp_path) -> None:
    """Review finding 1: "may have evicted" rested on any eviction after the store; per node
    it rests on SGLang freeing exactly the state the hit fell short of."""
    from conformance.sglang_plugins.token_digest import token_digest

    held = _evicted_follow_up(tmp_path)  # the counter grew (the other root's state), a's state never freed
    assert held and held.kind == "hit_below_held" and "SGLang held a state of 128 tokens for this prompt and reused 0" in held
    (tmp_path / "freed").mkdir()
    freed = {"ev": "state_evicted", "len": 128, "key": token_digest(tuple(range(1000, 1128)))}
    assert _evicted_follow_up(tmp_path / "freed", freed) is None
    (tmp_path / "other").mkdir()
    other = {"ev": "state_evicted", "len": 128, "key": token_digest(tuple(range(3000, 3128)))}
    assert "SGLang held a state of 128 tokens" in (_evicted_follow_up(tmp_path / "other", other) or "")  # a walk freed the other root's, not a's


def test_a_checkpoint_the_tree_never_took_before_the_hit_is_lost_not_held(tmp_path) -> None:
    """Seen on 0.5.15 (p16 lead): the state of a's prefix was first taken by the follow-up
    itself, after its admission; "still held" rested on that later record.  No eviction can
    explain a miss of a state the tree never held: the checkpoint was lost, and said so."""
    for where in ("c", ""):
        (tmp_path / f"at-{where}").mkdir()
        lost = _evicted_follow_up(tmp_path / f"at-{where}", stored_at=where)
        assert lost and "never took the state for the prefix of 128 tokens before it admitted this request" in lost, (where, lost)


# ------------------------------------------------------------------ lazy drops
def _lazy_followup(evidence: Evidence | None) -> str | None:
    """Under lazy_alloc_fail, a 200-token request decoding across the 256 boundary, then
    the same prompt again hitting 0 (its prefill checkpoint at 192 gone)."""
    grid = StrategyGrid(64, 1, 256, LAZY, lazy_alloc_fail=True)
    book = HitBook(grid, Limits(context_len=100000, kv_total=1e6, mamba_total=1000), evidence, server_rid=lambda rid: f"tag-{rid}")
    prompt = tuple(range(10, 210))
    return _judge_follow_up(book, _served("a", prompt, tuple(range(70)), 0, 1, 2), _served("c", prompt + (7,), (3,), 0, 3, 4))


def _judge_follow_up(book: HitBook, first: Served, follow: Served) -> str | None:
    """``first`` answers and passes, then ``follow``: its problem (None: none)."""
    for s in (first, follow):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None
    return book.judge(follow)


def test_a_lazy_drop_is_granted_only_to_the_request_sglang_dropped(tmp_path) -> None:
    assert _lazy_followup(None) is None  # the bound: any request crossing a track boundary may lose it
    unseen = _lazy_followup(_evidence(_log(tmp_path)))
    assert unseen and "cached_tokens 0" in unseen
    tmp = tmp_path / "seen"
    tmp.mkdir()
    assert _lazy_followup(_evidence(_log(tmp, {"ev": "lazy_drop", "rid": "tag-a", "was": 192, "seq_len": 256}))) is None


# ------------------------------------------------------------------ the file and the plugin
def test_a_server_without_the_plugins_start_line_is_a_kit_error(tmp_path) -> None:
    log = tmp_path / "cell.log"
    with pytest.raises(KitError, match="no per-request evidence"):
        request_log(log, target="sglang-cpu", attempts=2, pause_s=0.01)
    assert request_log(log, target="reference") is None  # the reference engine writes none
    (tmp_path / "cell.requests.jsonl").write_text('{"ev": "start"}\n{"ev": "prefill", "rid": "x", "prefix": 0, "ext')
    got = request_log(log, target="sglang-cpu", attempts=1)
    assert got is not None and got.started and not got.prefills  # a half-written line waits for its end


class Mode:
    def __init__(self, decode: bool):
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


def test_the_plugin_records_prefills_and_lazy_drops_and_changes_nothing(tmp_path, monkeypatch) -> None:
    from types import SimpleNamespace

    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    assert observe.REQUESTS_SUFFIX == ".requests.jsonl" and observe.requests_path() == str(tmp_path / "cell.requests.jsonl")
    cut = SimpleNamespace(rid="r1", prefix_len=0, extend_len=236, kv=SimpleNamespace(mamba_last_track_seqlen=192))
    plain = SimpleNamespace(rid="r2", prefix_len=64, extend_len=10, kv=SimpleNamespace(mamba_last_track_seqlen=None))
    sched = SimpleNamespace(chunked_req=cut)
    observe.write_requests(observe.prefill_records(sched, SimpleNamespace(forward_mode=Mode(False), reqs=[cut, plain])))
    assert observe.prefill_records(sched, SimpleNamespace(forward_mode=Mode(True), reqs=[cut])) == []  # decode: no prefill

    def prealloc(batch, interval):  # SGLang's failed allocation at the boundary
        batch.reqs[0].kv.mamba_last_track_seqlen = None
        return "result"

    class Lens:
        def tolist(self):
            return [256, 74]

    batch = SimpleNamespace(reqs=[cut, plain], seq_lens_cpu=Lens())
    assert observe.lazy_prealloc_observed(prealloc, batch, 256) == "result"
    log = RequestLog(tmp_path / "cell.requests.jsonl")
    log.refresh()
    assert log.cut("r1") and not log.cut("r2") and log.chunks("r1") == [Prefill(0, 236, True, 192)]
    assert log.dropped("r1") and not log.dropped("r2")  # r2 had nothing to drop
    assert observe.lazy_prealloc_observed(lambda b, i: 1, SimpleNamespace(reqs=None), 1) == 1  # unreadable batch: SGLang's result, no raise


def test_prefill_records_read_every_releases_request_shape():
    """0.5.22 on: prefix_len/extend_len; 0.5.15-0.5.21: extend_range; 0.5.14 and older: extend_input_len;
    before 0.5.22 the prefix is ``prefix_indices``, a tensor (truth-testing it raised, so no record was written
    and the oracle saw no cut on those releases: a fuzz program on 0.5.15 hit a cut checkpoint it then refused)."""
    from types import SimpleNamespace

    import torch

    from conformance.sglang_plugins import observe

    class Mode:
        def is_decode(self):
            return False

    span = SimpleNamespace(start=0, end=311)  # SGLang's Range(start, end) NamedTuple
    new = SimpleNamespace(rid="a", prefix_len=256, extend_len=40, kv=SimpleNamespace(mamba_last_track_seqlen=None))
    mid = SimpleNamespace(rid="b", prefix_indices=torch.empty((0,), dtype=torch.int64), extend_range=span, mamba_last_track_seqlen=256)
    old = SimpleNamespace(rid="c", prefix_indices=torch.arange(576), extend_input_len=3, mamba_last_track_seqlen=None)
    records = observe.prefill_records(SimpleNamespace(chunked_req=mid), SimpleNamespace(forward_mode=Mode(), reqs=[new, mid, old]))
    assert [(r["rid"], r["prefix"], r["extend"], r["cut"], r["track"]) for r in records] == [
        ("a", 256, 40, False, None), ("b", 0, 311, True, 256), ("c", 576, 3, False, None)]


# ------------------------------------------------------------------ a dropped state where nothing was cut
def _cut_batch_follow_up(evidence: Evidence) -> str | None:
    """The scenario of fixtures/programs/cut_batch_checkpoint_dropped.json on the book: twelve 400-token
    requests in one prefill batch (one of them cut), then member 0's prompt + 5 hits 0."""
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")),
                   Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=4096), evidence, server_rid=lambda rid: f"tag-{rid}")
    members = [_served(f"b.{i}", tuple(range(10, 18)) + tuple(range(1000 * (i + 1), 1000 * (i + 1) + 392)), (5,), 0, 1, 2 + i) for i in range(12)]
    follow = _served("f0", members[0].input_ids + (7,) * 5, (3, 4), 0, 20, 21)
    for s in (*members, follow):
        book.add(s)
    book.ready([])
    assert not any(book.judge(m) for m in members)
    return book.judge(follow)


def test_a_dropped_checkpoint_of_an_uncut_request_is_a_finding(tmp_path) -> None:
    assert _cut_batch_follow_up(_evidence(None, cuts=1)) is None  # the window: a cut while member 0 ran, so its checkpoint "may" be elsewhere
    log = _log(tmp_path, *({"ev": "prefill", "rid": f"tag-b.{i}", "prefix": 0, "extend": 400, "cut": False, "track": 384} for i in range(10)),
               {"ev": "prefill", "rid": "tag-b.10", "prefix": 0, "extend": 96, "cut": True, "track": 64})
    problem = _cut_batch_follow_up(_evidence(log, cuts=1))
    assert problem and "cached_tokens 0" in problem and "384" in problem


REPLAY = Path(__file__).resolve().parents[1] / "fixtures" / "programs" / "cut_batch_checkpoint_dropped.json"


@pytest.mark.fault_probe
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", [True, False], ids=["fault", "clean"])
def test_real_sglang_a_state_dropped_where_nothing_was_cut_is_caught(fault: bool, tmp_path) -> None:
    """The replay above on real SGLang (qwen3-next extra_buffer): with the seeded
    ``cut_batch_checkpoint_dropped`` the follow-up's lost hit is a finding (the window
    oracle admitted it); the same program on a clean server passes."""
    import os
    import subprocess

    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    argv = ["hybrid-conformance", "replay", str(REPLAY), "--target", "sglang-cpu", "--log-dir", str(tmp_path)]
    out = subprocess.run(argv + ([] if fault else ["--no-recorded-env"]), capture_output=True, text=True, timeout=850, env={**os.environ, "COLUMNS": "300"})
    text = out.stdout + out.stderr
    if fault:
        assert out.returncode == 1, text[-3000:]
        assert re.search(r"request f\d: cached_tokens 0, the prefix oracle allows \[[^]]*448", text), text[-3000:]
        records = [json.loads(line) for p in tmp_path.glob("*.plugins.jsonl") for line in p.read_text().splitlines() if line.strip()]
        assert any(r.get("status") == "fired" and r.get("fault") == "cut_batch_checkpoint_dropped" for r in records), "the fault never fired"
    else:
        assert out.returncode == 0, text[-3000:]
        assert "PASS" in text


# ------------------------------------------------------------------ evictions inside a burst
def _burst_then_again(tmp_path, *between: dict) -> str | None:
    """A burst of 12 roots of 130 tokens on a 3-state pool, answered together (done 30),
    then member 9's first 128 tokens + 3 hitting 0.  The counter was scraped mid-burst (an
    unrelated answer at 20) after SGLang's walks evicted member 9's checkpoint, and never
    moved after the burst answered: the client's clock places the store too late.  ``between``:
    records written after member 9's prefill and before the follow-up's (None: no log)."""
    members = [_served(f"b.{i}", tuple(range(1000 + 200 * i, 1130 + 200 * i)), (5,) * 16, 0, 1, 30) for i in range(12)]
    again = _served("c", members[9].input_ids[:128] + (7, 8, 9), (3,), 0, 31, 32)
    log = None
    if between != (None,):
        prefill = [{"ev": "prefill", "rid": m.rid, "prefix": 0, "extend": 130, "cut": False, "track": 128} for m in members]
        log = _log(tmp_path, *prefill[:10], *between, *prefill[10:], {"ev": "prefill", "rid": "c", "prefix": 0, "extend": 131, "cut": False, "track": 128})
    ev = Evidence(log)
    ev.reset(0, {EVICTIONS: 0.0, CUTS: 0.0})
    ev.note(20, {EVICTIONS: 5.0, CUTS: 0.0})
    ev.note(33, {EVICTIONS: 5.0, CUTS: 0.0})
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")), Limits(context_len=100000, kv_total=1e6, mamba_total=3), ev)
    for s in (*members, again):
        book.add(s)
    book.note_load(12, 0)
    book.ready([])
    assert all(book.judge(m) is None for m in members)
    problem = book.judge(again)
    assert problem is not None or again.permission == "eviction"
    return problem


def test_an_eviction_inside_a_burst_is_placed_by_the_per_request_log(tmp_path) -> None:
    """Seen on SGLang 0.5.23 (fixtures: cand-nemo-eb, a burst of 40 on 48 mamba slots): the
    burst member's checkpoint was evicted by SGLang's counted walk before the burst answered."""
    blind = _burst_then_again(tmp_path, None)  # the scrape window alone: stored at 30, no growth after
    assert blind and "eviction counter did not move" in blind
    walk = {"ev": "evict", "num_tokens_evicted": 127, "swa_num_tokens_evicted": 0, "mamba_num_evicted": 1}
    (tmp_path / "seen").mkdir()
    assert _burst_then_again(tmp_path / "seen", walk) is None  # a walk after member 9's prefill, before the follow-up's
    (tmp_path / "early").mkdir()
    log = _log(tmp_path / "early", walk, {"ev": "prefill", "rid": "x", "prefix": 0, "extend": 1, "cut": False, "track": None},
               {"ev": "prefill", "rid": "y", "prefix": 0, "extend": 1, "cut": False, "track": None})
    assert not log.evicted_between(["y"], "x") and log.evicted_between(["x"], "y") is False  # walks before both: no evidence
    assert not log.evicted_between(["unknown"], "y") and not log.evicted_between([], "y")
    (tmp_path / "none").mkdir()
    unseen = _burst_then_again(tmp_path / "none")  # the log shows no walk in between
    assert unseen and "eviction counter did not move" in unseen


# ------------------------------------------------------------------ lazy_alloc_fail finish under overlap
def _finish_then_again(tmp_path, prompt: tuple, out: tuple, grid: StrategyGrid, track: int, records: tuple) -> str | None:
    """r1 (``prompt``, decoding ``out``), then its sequence + 5 tokens served with a 512-token hit,
    judged against a log holding r1's prefill (tracked at ``track``) and ``records`` (a
    ``state_stored`` record's key is the digest of that many tokens of r1's sequence)."""
    from conformance.sglang_plugins.token_digest import token_digest

    path = tmp_path / "cell.requests.jsonl"
    seq = prompt + out
    head = [{"ev": "start", "state_evictions": True}, {"ev": "prefill", "rid": "tag-r1", "prefix": 0, "extend": len(prompt), "cut": False, "track": track}]
    path.write_text("".join(json.dumps(r) + "\n" for r in (*head, *[{**r, "key": token_digest(seq[:r["len"]])} if r.get("ev") == "state_stored" else r for r in records])))
    log = RequestLog(path)
    log.refresh()
    book = HitBook(grid, Limits(context_len=100000, kv_total=1e6, mamba_total=1000), _evidence(log), server_rid=lambda rid: f"tag-{rid}")
    first, again = _served("r1", prompt, out, 0, 1, 2), _served("r2", seq + (7, 8, 9, 10, 11), (3,), 512, 3, 4)
    for s in (first, again):
        book.add(s)
    book.ready([])
    assert book.judge(first) is None
    return book.judge(again)


def _finish_before_boundary(tmp_path, *records: dict) -> str | None:
    """Seen on clean SGLang 0.5.23 (lazy + SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1, overlap, nightly
    programs): a 247-token prompt decodes 521 tokens (committed 767, one before the 768
    boundary), then its prompt + output + 5 hits 512, answering as the cold twin does.  The
    boundary step after the finish was not prepared, so the state tracked in place at 512 stayed
    valid and was inserted; had it been prepared, SGLang drops it and inserts nothing."""
    grid = StrategyGrid(64, 1, 256, LAZY, lazy_alloc_fail=True, lookahead=1)
    return _finish_then_again(tmp_path, tuple(range(10, 257)), tuple(range(2000, 2521)), grid, 192, records)


def test_a_lazy_alloc_fail_finish_keeps_its_last_track_only_when_sglang_stored_it(tmp_path) -> None:
    unseen = _finish_before_boundary(tmp_path)
    assert unseen and "cached_tokens 512" in unseen  # before: also with the store seen (a clean nightly false alarm)
    (tmp_path / "seen").mkdir()
    assert _finish_before_boundary(tmp_path / "seen", {"ev": "state_stored", "len": 512}) is None


# ------------------------------------------------------------------ a hit SGLang's tree was seen holding
def _overlapping_hit(tmp_path, *between: dict, per_node: bool = True) -> tuple[str | None, Served]:
    """x (320 tokens) and y (x + 1 token, cached 320) overlap: the model admits y's hit as a
    concurrent store.  ``between``: records after x's prefill, before y's admission."""
    from conformance.sglang_plugins.token_digest import token_digest

    x = _served("x", tuple(range(10, 330)), (1,), 0, 1, 4)
    y = _served("y", x.input_ids + (7,), (1,), 320, 2, 3)
    named = {"key": token_digest(x.input_ids)}
    path = tmp_path / "cell.requests.jsonl"
    records = [{"ev": "start", "state_evictions": per_node}, {"ev": "prefill", "rid": "x", "prefix": 0, "extend": 320, "cut": False, "track": 256},
               *({**r, **named} if r.get("ev") == "state_stored" else r for r in between),
               {"ev": "prefill", "rid": "y", "prefix": 320, "extend": 1, "cut": False, "track": None},
               {"ev": "state_stored", "len": 320, **named}]  # x's finish store, when it is not in ``between``
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    log = RequestLog(path)
    log.refresh()
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")), Limits(context_len=100000, kv_total=1e6, mamba_total=1000), _evidence(log))
    for s in (x, y):
        book.add(s)
    book.ready([])
    assert book.judge(x) is None
    return book.judge(y), y


def test_a_hit_needs_its_state_seen_stored_before_the_request_was_admitted(tmp_path) -> None:
    # the tree took x's state only after y was admitted: y's 320-token hit had no state to match
    late, y = _overlapping_hit(tmp_path)
    assert late and "cached_tokens 320" in late and "before it admitted" in late and y.held_seen is False
    (tmp_path / "seen").mkdir()
    seen, y = _overlapping_hit(tmp_path / "seen", {"ev": "state_stored", "len": 320})
    # the records settle what the model could only permit: the hit is the state SGLang held
    assert seen is None and y.held_seen is True and y.permission == "" and y.model_permission == "concurrent" and y.expected == "exact"
    # before: the model's concurrent permission alone admitted it; a server without per-node records still does
    (tmp_path / "old").mkdir()
    old, y = _overlapping_hit(tmp_path / "old", per_node=False)
    assert old is None and y.held_seen is None and y.permission == "concurrent"


def test_a_retracted_request_is_judged_at_its_last_admission(tmp_path) -> None:
    log = _log(tmp_path, {"ev": "prefill", "rid": "r", "prefix": 0, "extend": 64, "cut": True, "track": 64},
               {"ev": "prefill", "rid": "r", "prefix": 64, "extend": 36, "cut": False, "track": None},
               {"ev": "prefill", "rid": "r", "prefix": 64, "extend": 40, "cut": False, "track": None})
    assert log.admitted_at["r"] == 4 and log.first_prefill_at["r"] == 2  # the continuation chunk is not an admission


# ------------------------------------------------------------------ a finish under overlap whose in-flight step crossed a boundary
def _finish_one_before_boundary_under_overlap(tmp_path, *records: dict, lazy_alloc_fail: bool = False) -> str | None:
    """Shrunk from a clean fuzz run on SGLang 0.5.15 (extra_buffer, overlap, track 256; replay
    /work/wt/notes/i24-session7/fz-0.5.15-seed2-r9.json): r8, 464 tokens (hit 256), decodes 48
    (prompt + output = 512, a track boundary: the step in flight at the finish ran the last
    output token), then r9 = r8's sequence + 5 hits 512 and answers as its cold twin.  The
    oracle's finish store is the last boundary before ``committed`` = 511, i.e. none past the
    prefill's; SGLang's tree took the in-flight step's 512 state."""
    grid = StrategyGrid(64, 1, 256, strategy_named("extra_buffer"), lazy_alloc_fail=lazy_alloc_fail, lookahead=1)
    return _finish_then_again(tmp_path, tuple(range(10, 474)), tuple(range(2000, 2048)), grid, 256, records)


def test_a_finish_under_overlap_may_store_its_in_flight_boundary_state_only_when_sglang_stored_it(tmp_path) -> None:
    unseen = _finish_one_before_boundary_under_overlap(tmp_path)
    assert unseen and "cached_tokens 512" in unseen  # before: also with the store seen (the 0.5.15 fuzz false alarm)
    (tmp_path / "other").mkdir()  # a 512 state of another sequence seen stored: still no permission
    other = _finish_one_before_boundary_under_overlap(tmp_path / "other", {"ev": "state_stored", "len": 256})
    assert other and "cached_tokens 512" in other
    (tmp_path / "seen").mkdir()
    assert _finish_one_before_boundary_under_overlap(tmp_path / "seen", {"ev": "state_stored", "len": 512}) is None
    (tmp_path / "laf").mkdir()  # lazy_alloc_fail: that boundary's allocation fails, nothing tracked there
    laf = _finish_one_before_boundary_under_overlap(tmp_path / "laf", {"ev": "state_stored", "len": 512}, lazy_alloc_fail=True)
    assert laf is None or "cached_tokens 512" in laf


def test_the_in_flight_boundary_store_is_only_the_overlap_boundary_case() -> None:
    from conformance.checks.hit_bounds import in_flight_boundary_finish_store

    eb = strategy_named("extra_buffer")
    prompt, out = tuple(range(464)), tuple(range(1000, 1048))
    assert in_flight_boundary_finish_store(prompt, out, StrategyGrid(64, 1, 256, eb, lookahead=1)) == prompt + out
    assert in_flight_boundary_finish_store(prompt, out, StrategyGrid(64, 1, 256, eb, lookahead=0)) is None  # no step in flight
    assert in_flight_boundary_finish_store(prompt, out[:-1], StrategyGrid(64, 1, 256, eb, lookahead=1)) is None  # 511: no boundary
    assert in_flight_boundary_finish_store(prompt, out, StrategyGrid(64, 1, 256, strategy_named("no_buffer"), lookahead=1)) is None
    assert in_flight_boundary_finish_store(prompt, out, StrategyGrid(64, 1, 256, eb, lazy_alloc_fail=True, lookahead=1)) is None


# ------------------------------------------------------------------ the per-path cap
def _capped_follow_up(tmp_path, *between: dict, cap: int | None = 1) -> str | None:
    """Request a (130 tokens, its checkpoint at 128 taken) on a pool that never fills, then
    a's first 128 tokens + 3 hitting 0: with ``--mamba-max-states-per-path`` SGLang may have
    dropped the state on a later insert -- only its per-node record of that state says so."""
    from conformance.sglang_plugins.token_digest import token_digest

    a, again = _served("a", tuple(range(1000, 1130)), (5,), 0, 1, 2), _served("c", tuple(range(1000, 1128)) + (7, 8, 9), (3,), 0, 3, 4)
    log = _log(tmp_path, {"ev": "start", "state_evictions": True}, {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 130, "cut": False, "track": 128},
               {"ev": "state_stored", "len": 128, "key": token_digest(a.input_ids[:128])}, *between,
               {"ev": "prefill", "rid": "c", "prefix": 0, "extend": 131, "cut": False, "track": 128})
    book = HitBook(StrategyGrid(64, 1, 256, strategy_named("extra_buffer")),
                   Limits(context_len=100000, kv_total=1e6, mamba_total=1000, path_cap=cap), _evidence(log))
    for s in (a, again):
        book.add(s)
    book.ready([])
    assert book.judge(a) is None
    return book.judge(again)


def test_a_capped_tree_drops_states_without_pressure_but_only_on_sglangs_record(tmp_path) -> None:
    """Seen on 0.5.23 (no_buffer, --mamba-max-states-per-path 1): a session turn's 5-token state
    dropped by the cap on the next turn's insert, the pools far from full; the old oracle said
    "the pools never had to evict".  A capped tree may drop it, but only SGLang's record of that
    very state freed permits the miss."""
    from conformance.sglang_plugins.token_digest import token_digest

    freed = {"ev": "state_evicted", "len": 128, "key": token_digest(tuple(range(1000, 1128)))}
    assert "the pools never had to evict" in (_capped_follow_up(tmp_path, freed, cap=None) or "")  # no cap: the bound rules it out
    (tmp_path / "cap").mkdir()
    assert _capped_follow_up(tmp_path / "cap", freed) is None
    (tmp_path / "held").mkdir()
    held = _capped_follow_up(tmp_path / "held")
    assert held and held.kind == "hit_below_held" and "SGLang held a state of 128 tokens" in held
    (tmp_path / "other").mkdir()
    other = {"ev": "state_evicted", "len": 128, "key": token_digest(tuple(range(3000, 3128)))}
    assert "SGLang held a state of 128 tokens" in (_capped_follow_up(tmp_path / "other", other) or "")


# ------------------------------------------------------------------ a decode boundary in a mixed step
class MixedMode:
    def is_decode(self) -> bool:
        return False

    def is_mixed(self) -> bool:
        return True


def test_a_mixed_batch_records_its_decoding_rows_with_the_length_they_reach(tmp_path, monkeypatch) -> None:
    """0.5.23's mix_with_running leaves a decoding row's own prefix at its last prefill (0, so
    it read as a second prefill of 128 from 0) and, under overlap, its first decode step has no
    output yet.  The observer now tells it by its completed prefill and records the length the
    row reaches from the batch's prefix list; a retracted request prefills again."""
    from types import SimpleNamespace

    from conformance.sglang_plugins.activation import REPORT_ENV

    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    first = SimpleNamespace(rid="m1", prefix_len=0, extend_len=127, output_ids=[], kv=SimpleNamespace(mamba_last_track_seqlen=None))
    observe.write_requests(observe.prefill_records(SimpleNamespace(chunked_req=None), SimpleNamespace(forward_mode=Mode(False), reqs=[first])))
    newcomer = SimpleNamespace(rid="m2", prefix_len=0, extend_len=112, output_ids=[], kv=SimpleNamespace(mamba_last_track_seqlen=None))
    first.extend_len = 128  # SGLang's extend_end = prefix + 1 against the stale prefix_len of 0
    mixed = SimpleNamespace(forward_mode=MixedMode(), reqs=[newcomer, first], prefix_lens=[0, 127])
    records = observe.prefill_records(SimpleNamespace(chunked_req=newcomer), mixed)
    assert records == [{"ev": "prefill", "rid": "m2", "prefix": 0, "extend": 112, "cut": True, "track": None},
                       {"ev": "mixed_decode", "rid": "m1", "seq_len": 128}]
    observe.write_requests(records)
    log = RequestLog(tmp_path / "cell.requests.jsonl")
    log.refresh()
    assert log.untracked_decodes("m1") == {128} and log.chunks("m1") == [Prefill(0, 127, False, None)] and log.admissions["m1"] == 1
    observe.retract_observed(lambda batch: ([first], None), SimpleNamespace())
    again = observe.prefill_records(SimpleNamespace(chunked_req=None), SimpleNamespace(forward_mode=MixedMode(), reqs=[first], prefix_lens=[0]))
    assert again[0]["ev"] == "prefill"  # retracted: its next row is a prefill, not a decode


def _mixed_follow_up(tmp_path, *records: dict) -> str | None:
    """The 0.5.23 FalconH1 page-16 burst, one member: a 127-token prompt decoding 2 (its first
    decode step reaches the 128 boundary), then its sequence + 5 hits 0."""
    book = HitBook(StrategyGrid(128, 16, 128, strategy_named("extra_buffer")),
                   Limits(context_len=100000, kv_total=1e6, mamba_total=1000, prefill_budget=4096),
                   _evidence(_log(tmp_path, {"ev": "prefill", "rid": "b.0", "prefix": 0, "extend": 127, "cut": False, "track": None}, *records)))
    member = _served("b.0", tuple(range(10, 137)), (5, 6), 0, 1, 2)
    return _judge_follow_up(book, member, _served("r2", member.input_ids + member.output_ids + (7,) * 5, (3,), 0, 3, 4))


def test_a_decode_boundary_reached_in_a_mixed_step_is_not_owed(tmp_path) -> None:
    """SGLang 0.5.23 tracks no decode row of a mixed step ("Decode tails are not tracked in a
    mixed step", ScheduleBatch.mix_with_running), so the member's finish inserts no 128 state.
    Its records saying so are evidence from the same run; without them the lost hit stays a finding."""
    owed = _mixed_follow_up(tmp_path)
    assert owed and "cached_tokens 0" in owed and "[128]" in owed
    seen = tmp_path / "seen"
    seen.mkdir()
    assert _mixed_follow_up(seen, {"ev": "mixed_decode", "rid": "b.0", "seq_len": 128}) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()  # a mixed step short of the boundary does not excuse it
    assert _mixed_follow_up(elsewhere, {"ev": "mixed_decode", "rid": "b.0", "seq_len": 127}) is not None
