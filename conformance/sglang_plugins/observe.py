"""Fresh idle gauges, SGLang's whole idle invariant and resident track slots on
``/metrics`` (general plugin ``hybrid_conformance_observe``, scheduler process only).

SGLang publishes its pool gauges at idle only when its running-request gauge is stale
or every 30 s, so a reader can see the last batch's numbers long after the server went
idle.  This plugin wraps the scheduler's idle publisher (an AROUND hook through SGLang's
hook registry) so that, at most every :data:`MIN_INTERVAL_S`, an idle scheduler
publishes, and then exports, next to SGLang's own ``sglang:*`` gauges, the terms of the
invariant SGLang checks at idle but does not export:

``hybrid_conformance:{mamba,kv}_{total,protected,session_held}``, with a HiCache host tier
``hybrid_conformance:host_{kv,mamba}_{total,used}``, and
``hybrid_conformance:idle_publish_seq`` (incremented after each idle publish, so a scrape
that shows a newer sequence number holds gauges refreshed while idle).

Busy side (a BEFORE hook on ``Scheduler.run_batch``, so the batch is seen after
``prepare_for_decode`` took any lazy boundary slot and before the step's result gives it
back): for every decode step, the ping-pong track slots each request of the batch holds,
read from SGLang's request objects (``req.kv.mamba_ping_pong_empty``), published as
cumulative sums and window peaks (:data:`TRACK_GAUGES`).  A window starts at the first
batch after an idle publish, so after a load the peaks are those of the last busy period
(``busy_periods`` counts windows, so a reader can tell a load that spanned two).
The same hook also keeps window peaks of the pools' ``used`` terms (:data:`POOL_GAUGES`,
SGLang's own ``PoolStats``, read before every batch, prefill included), which SGLang's
gauges only sample at its log intervals.

Evidence counters for the programs' oracle (``conformance/programs/evidence.py``), both
cumulative and published with every idle publish: ``evictions_total`` (an AROUND hook on
the radix cache's eviction walk, :data:`EVICT_TARGET`, counting walks that evicted
anything; each walk's record also says what it was asked to free, i.e. which pool ran
short) and ``prefill_cuts_total`` (the BEFORE hook on ``run_batch``: an extend batch
holding the scheduler's ``chunked_req``, i.e. a prefill SGLang cut at its budget).

Per-request evidence (:data:`REQUESTS_SUFFIX`, a JSON-lines file next to the plugin report,
read back by ``conformance/programs/evidence.py``): for each request of each extend batch,
its rid, the prefix and extend lengths of that prefill, whether SGLang cut it there and
where it tracks that chunk's mamba checkpoint (``mamba_last_track_seqlen``, set by the
batch's preparation before ``run_batch``); and, under ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL``,
every request whose kept checkpoint SGLang dropped at a track boundary (an AROUND hook
on :data:`LAZY_TARGET`: ``mamba_last_track_seqlen`` went from a length to None).

Per-node eviction evidence (every release 0.5.11 on, both tree generations): an AROUND hook
on each tree's insert records each mamba state the tree took (``state_stored``: the inserted
prefix's length and :func:`conformance.sglang_plugins.token_digest.token_digest`, for an insert that did not
find a state already there, ``mamba_exist`` False), and keeps which pool slot holds it; a hook
on the place where the tree's removed states are seen records each such state
(``state_evicted``, same length and digest, and ``by``: what freed it -- SGLang's eviction
``walk``, an ``insert`` (the per-path cap runs inside it), or ``other``, read from the tree
operation in progress, :data:`_WITHIN`); a hook on the tree's reset (a flush) forgets the
slots and records the reset (``tree_reset``: every state taken before it is gone).  Where the removed states are seen differs per release (feature probes,
:data:`STATE_FREE_PLANS`, first match per tree class of :data:`STATE_TREES`): the eviction
step's result (``_apply_eviction_result``, 0.5.23), the device-frees drain every tree step goes
through (``_drain_device_frees``: walks, SGLang's per-path state cap, demotes; 0.5.17-0.5.22),
or, where a tree has no such drain (``MambaRadixCache``, the hybrid default up to 0.5.15, and
``UnifiedRadixCache`` up to 0.5.16), its public eviction walk ``evict``, after which every
remembered state no longer among the tree's own (``all_mamba_values_flatten``) was evicted.
The start line says whether every tree class of the release got all three hooks
(``state_evictions``; only then does "no record" mean "not evicted"), which plan each took
(``state_plans``) and what is missing where one did not (``state_missing``).

Pressure evidence (the programs' coverage counters, ``conformance/programs/evidence.py``), each
an AROUND hook where the release has its target (:data:`PRESSURE_TARGETS`, feature-probed; the
start line's ``pressure`` lists those hooked): ``refused`` (a request the prefill adder refused
for lack of room, ``NO_TOKEN``, after its match: its rid, matched length and digest, once per
rid and length), ``retract`` (the rids SGLang's ``retract_decode`` retracted), ``split`` (a
node split, seen where the tree runs in Python) and ``tree_core`` (the unified tree's core:
a Rust core's splits are not seen).

Nothing here changes what SGLang schedules, allocates, caches or checks.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from conformance.sglang_contract.metric_names import KIT_PREFIX
from conformance.sglang_plugins import evict_all
from conformance.sglang_plugins.activation import REPORT_ENV
from conformance.sglang_plugins.token_digest import token_digest
from conformance.sglang_plugins.tree_audit import STATE_POSITION_RULE, Auditor, state_position, tree_label

TARGET = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter._maybe_log_idle_metrics"
#: Before the scheduler's components were split out (0.5.12 and older) the idle publisher is
#: a Scheduler mixin method, so its ``self`` is the scheduler itself.
LEGACY_TARGET = "sglang.srt.managers.scheduler_runtime_checker_mixin.SchedulerRuntimeCheckerMixin._maybe_log_idle_metrics"
STEP_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
#: The scheduler's answer to ``/server_info`` (``GetInternalStateReq``): the kit's idle check
#: wakes an idle scheduler with that question (``conformance/workloads/idle.py``), and the
#: publish on that turn is then due at once instead of :data:`MIN_INTERVAL_S` after the last.
WAKE_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
#: The radix cache's eviction walk (``evict`` and ``evict_for_alloc`` both run it).
EVICT_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict"
#: Before that walk existed (0.5.21 and older) every eviction goes through the public
#: ``evict(EvictParams)`` of the tree in use: ``MambaRadixCache`` (the hybrid default up to
#: 0.5.15) or ``UnifiedRadixCache``; both are hooked, only the tree in use is ever called.
LEGACY_EVICT_TARGETS = (
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.evict",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict",
)
#: Where a request's mamba state becomes the tree's (per-node eviction evidence, 0.5.23 names).
INSERT_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"
#: Every eviction step's result is drained here (walk, path cap, demote): its mamba
#: ``device_frees`` are the tree's states it removed.
STATE_FREE_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._apply_eviction_result"
#: A flush drops the whole tree without an eviction step: the slot map starts over.
TREE_RESET_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset"
#: Every radix tree that can hold mamba states, per release: each one the release has must get
#: the per-node hooks (``HiMambaRadixCache``: 0.5.11-0.5.12's HiCache tree for hybrid models,
#: its own ``evict`` and ``reset``).
STATE_TREES = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache",
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache",
    "sglang.srt.mem_cache.hi_mamba_radix_cache.HiMambaRadixCache",
)
#: Where a tree's removed states are seen, newest release first: (method, plan).  ``step``: the
#: eviction step's result (0.5.23); ``drain``: the device-frees dict every tree step drains
#: (0.5.17-0.5.22); ``walk``: the public eviction walk, then the remembered states no longer in
#: the tree (``all_mamba_values_flatten``; MambaRadixCache, UnifiedRadixCache up to 0.5.16).
STATE_FREE_PLANS = (("_apply_eviction_result", "step"), ("_drain_device_frees", "drain"), ("evict", "walk"))
#: Where a tree takes a request's states (``req`` its first argument), per release: each one a
#: tree class has is hooked (:func:`caching_req`), so an insert knows whose state it takes.
CACHING_METHODS = ("checkpoint_into_tree", "insert_req", "cache_unfinished_req", "cache_finished_req")
#: The lazy strategy's boundary pre-allocation (a failed one drops the kept checkpoint).
LAZY_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.mamba_lazy_prealloc_at_boundary"
#: ``<log>.plugins.jsonl`` -> ``<log>.requests.jsonl``: the per-request evidence file.
REPORT_SUFFIX, REQUESTS_SUFFIX = ".plugins.jsonl", ".requests.jsonl"
#: An eviction walk's result fields (what it evicted: full tokens, SWA tokens, mamba states).
EVICT_FIELDS = ("num_tokens_evicted", "swa_num_tokens_evicted", "mamba_num_evicted")
#: What the walk was asked to free (its ``EvictParams``: the KV, SWA or Mamba shortfall that started it).
EVICT_ASKED = ("num_tokens", "swa_num_tokens", "mamba_num")
#: Cumulative evidence counters (conformance/programs/evidence.py reads them).
EVIDENCE_GAUGES = ("evictions_total", "prefill_cuts_total", "tree_audits_total")
#: The tree audit's cost (seconds, cumulative), published with the evidence counters.
AUDIT_COST_GAUGE = "tree_audit_seconds_total"
MIN_INTERVAL_S = 0.2

def _first(*readers: Callable[[Any], float]) -> Callable[[Any], float]:
    """The first reader that works on this release (newest first)."""
    def read(s: Any) -> float:
        for reader in readers[:-1]:
            try:
                return reader(s)
            except AttributeError:
                continue
        return readers[-1](s)

    return read


def _host_kv_pool(s: Any) -> Any:
    """The HiCache host KV pool (SGLang's own lookup for its ``hicache_host_*`` stats)."""
    pool = getattr(s.tree_cache, "token_to_kv_pool_host", None) or getattr(s.tree_cache, "full_kv_pool_host", None)
    if pool is None:
        raise AttributeError("no HiCache host pool")
    return pool


def _host_mamba_pool(s: Any) -> Any:
    """The HiCache host Mamba state pool of a hybrid model (``host_pool_group``'s mamba entry)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    entry = s.tree_cache.host_pool_group.entry_map.get(PoolName.MAMBA)
    if entry is None:
        raise AttributeError("no HiCache host mamba pool")
    return entry.host_pool


def _pool_stats(s: Any) -> Any:
    """SGLang's own ``PoolStats`` (what its gauges publish), from the scheduler's observer
    (0.5.13+) or the scheduler mixin (0.5.12 and older)."""
    observer = getattr(s, "pool_stats_observer", None)
    return observer.get_pool_stats() if observer is not None else s.get_pool_stats()


def _mamba_stat(field: str) -> Callable[[Any], float]:
    def read(s: Any) -> float:
        value = getattr(_pool_stats(s), field)
        if value is None:
            raise AttributeError(f"PoolStats.{field} is None (not a hybrid SSM pool)")
        return value

    return read


#: name -> reader of the scheduler; a reader that fails (a release without that
#: attribute) leaves the gauge unpublished rather than guessing.  Where the term moved, the
#: older release's own accessor (0.5.12's scheduler mixin methods) follows the newest.
READERS: dict[str, Callable[[Any], float]] = {
    "mamba_total": lambda s: s.req_to_token_pool.mamba_pool.size,
    "mamba_protected": lambda s: s.tree_cache.mamba_protected_size(),
    "mamba_session_held": _first(lambda s: s.pool_stats_observer.session_held_mamba_slots(), lambda s: s._session_held_mamba_slots()),
    "kv_total": _first(lambda s: s.req_to_token_pool.schedulable_token_capacity(s.token_to_kv_pool_allocator.size),
                       lambda s: s.token_to_kv_pool_allocator.size),
    "kv_protected": lambda s: s.tree_cache.full_protected_size(),
    "kv_session_held": _first(lambda s: s.pool_stats_observer.session_held_tokens(), lambda s: s._session_held_tokens()),
    # HiCache host tier (servers with --enable-hierarchical-cache only; SGLang publishes its
    # own hicache_host_* gauges at its log intervals): used = logical size - available
    "host_kv_total": lambda s: _host_kv_pool(s).logical_size,
    "host_kv_used": lambda s: _host_kv_pool(s).logical_size - _host_kv_pool(s).available_size(),
    "host_mamba_total": lambda s: _host_mamba_pool(s).logical_size,
    "host_mamba_used": lambda s: _host_mamba_pool(s).logical_size - _host_mamba_pool(s).available_size(),
    # SGLang's PoolStats mamba terms, which 0.5.11 computes but publishes only as the
    # fraction ``sglang:mamba_usage`` (the client stands them in for the missing
    # ``sglang:mamba_{used,available,evictable}_tokens``: conformance.client.GAUGE_STANDINS)
    "mamba_used": _mamba_stat("mamba_num_used"),
    "mamba_available": _mamba_stat("mamba_available_size"),
    "mamba_evictable": _mamba_stat("mamba_evictable_size"),
    "running_reqs": lambda s: len(s.running_batch.reqs),
    "waiting_reqs": lambda s: len(s.waiting_queue),
}

#: Busy-side gauges (all cumulative or window peaks; see the module docstring).
TRACK_GAUGES = (
    "decode_steps",  # decode batches run (cumulative)
    "decode_req_steps",  # sum over decode steps of requests in the batch (cumulative)
    "track_slot_req_steps",  # sum over decode steps of track slots those requests held (cumulative)
    "track_slots_now",  # track slots held by the last decode batch's requests
    "track_slots_step_peak",  # window peak of the per-step sum
    "track_slots_req_peak",  # window peak of one request's track slots
    "decode_running_peak",  # window peak of requests in one decode batch
    "busy_periods",  # windows started (cumulative)
)
#: Window peaks of the pools' used terms (SGLang's ``PoolStats``: size - available - evictable).
POOL_GAUGES = ("mamba_used_peak", "kv_used_peak")
_PEAKS = ("track_slots_step_peak", "track_slots_req_peak", "decode_running_peak", *POOL_GAUGES)


def track_slots(req: Any) -> int:
    """Ping-pong track slots one SGLang request holds right now (0 without a buffer).
    The buffer lives on ``req.kv`` once the request's cache state moved there (0.5.22+),
    on the request before (0.5.12 and older, and 0.5.16, whose ``req.kv`` holds only the
    KV lengths).  An entry is held unless its emptiness flag says so
    (``mamba_ping_pong_empty``) or, where the release has no flags, it is -1 (the lazy
    strategy's empty mark of 0.5.13-0.5.21); a release without lazy holds every entry."""
    holder = _holder(req, "mamba_ping_pong_track_buffer")
    buffer = getattr(holder, "mamba_ping_pong_track_buffer", None)
    if buffer is None:
        return 0
    empty = getattr(holder, "mamba_ping_pong_empty", None)
    if empty is None:
        entries = buffer.tolist() if hasattr(buffer, "tolist") else list(buffer)
        return sum(1 for e in entries if e != -1)
    return sum(1 for e in empty if not e)


def requests_path() -> str | None:
    """Where this server's per-request evidence goes (None: the kit gave no report path)."""
    import os

    report = os.environ.get(REPORT_ENV)
    return report.removesuffix(REPORT_SUFFIX) + REQUESTS_SUFFIX if report else None


def write_requests(records: list[dict[str, Any]]) -> None:
    """Append per-request evidence records (one JSON line each), at once."""
    path = requests_path()
    if not records or not path:
        return
    import json

    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def _holder(req: Any, attr: str) -> Any:
    """Where a request's mamba cache field ``attr`` lives: ``req.kv`` once the cache state
    moved there (0.5.19+), else the request.  Not every ``req.kv`` holds it: on 0.5.16-0.5.18
    ``req.kv`` is a ``ReqKvInfo`` of KV lengths only, set at allocation, while
    ``mamba_last_track_seqlen`` and the ping-pong buffer stay on the request (asking ``req.kv``
    there read every tracked checkpoint as None)."""
    kv = getattr(req, "kv", None)
    return kv if kv is not None and hasattr(kv, attr) else req


def _track_seqlen(req: Any) -> int | None:
    """The length the request's mamba checkpoint is tracked at (None: none)."""
    return getattr(_holder(req, "mamba_last_track_seqlen"), "mamba_last_track_seqlen", None)


def _prefill_lengths(req: Any) -> tuple[int, int]:
    """(prefix, extend) of the prefill about to run, per release: ``prefix_len``/``extend_len``
    (0.5.22 on); ``extend_range`` = [prefix, end) (0.5.15-0.5.21); ``len(prefix_indices)`` and
    ``extend_input_len`` (0.5.14 and older).  ``prefix_indices`` is a tensor: never truth-tested
    (that raised, so no release before 0.5.22 wrote a prefill record and the oracle saw no cut)."""
    prefix = getattr(req, "prefix_len", None)
    if prefix is None:
        indices = getattr(req, "prefix_indices", None)
        prefix = 0 if indices is None else len(indices)
    extend = getattr(req, "extend_len", None)
    if extend is None:
        span = getattr(req, "extend_range", None)
        extend = span.end - span.start if span is not None else getattr(req, "extend_input_len", 0)
    return int(prefix), int(extend)


#: Requests whose prefill the records saw complete, oldest first (a later row of theirs in a
#: mixed batch is a decode step riding the prefill's forward); bounded, retractions removed.
_PREFILLED: dict[str, None] = {}
_PREFILLED_MAX = 65536


def _decode_seq_len(batch: Any, i: int) -> int | None:
    """The length a mixed batch's decode row ``i`` reaches this step: its prefix (on the batch:
    ``mix_with_running`` appends ``seq_len - 1`` and leaves the request's own prefix at its
    last prefill) + 1, else the batch's ``seq_lens_cpu``."""
    prefix_lens = getattr(batch, "prefix_lens", None)
    if isinstance(prefix_lens, list) and len(prefix_lens) == len(batch.reqs):
        return int(prefix_lens[i]) + 1
    seq_lens = getattr(batch, "seq_lens_cpu", None)
    return int(seq_lens[i]) if seq_lens is not None else None


def prefill_records(scheduler: Any, batch: Any) -> list[dict[str, Any]]:
    """One record per request of an extend batch about to run: prefix and extend lengths of
    this prefill, whether SGLang cut it here (the scheduler's ``chunked_req``), and the
    length its mamba checkpoint is tracked at (None: none this chunk).  A mixed batch's
    decoding rows are no prefill: each is a ``mixed_decode`` record with the length it reaches
    (SGLang 0.5.23: "Decode tails are not tracked in a mixed step").  A row decodes when it has
    output or its prefill was seen complete: under overlap the first decode step is prepared
    before the prefill's token is appended, so its output is still empty."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or mode.is_decode() or not getattr(mode, "is_extend", lambda: True)():
        return []
    chunked = getattr(scheduler, "chunked_req", None)
    mixed = getattr(mode, "is_mixed", lambda: False)()
    out = []
    for i, r in enumerate(batch.reqs):
        rid = str(r.rid)
        if mixed and (getattr(r, "output_ids", None) or rid in _PREFILLED):
            out.append({"ev": "mixed_decode", "rid": rid, "seq_len": _decode_seq_len(batch, i)})
            continue
        prefix, extend = _prefill_lengths(r)
        track = _track_seqlen(r)
        out.append({"ev": "prefill", "rid": rid, "prefix": prefix, "extend": extend,
                    "cut": r is chunked, "track": None if track is None else int(track)})
        if r is chunked:
            _PREFILLED.pop(rid, None)
        else:
            _PREFILLED[rid] = None
            while len(_PREFILLED) > _PREFILLED_MAX:
                del _PREFILLED[next(iter(_PREFILLED))]
    return out


def lazy_prealloc_observed(original: Callable, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the lazy boundary pre-allocation: a request whose kept checkpoint
    (``mamba_last_track_seqlen``) it dropped is recorded with the length it was at (result unchanged)."""
    try:
        before = [(r, _track_seqlen(r)) for r in batch.reqs]
    except Exception:  # an observer never breaks the server
        before = []
    result = original(batch, *args, **kwargs)
    try:
        seq_lens = batch.seq_lens_cpu.tolist()
        write_requests([{"ev": "lazy_drop", "rid": str(r.rid), "was": int(old), "seq_len": int(seq_lens[i])}
                        for i, (r, old) in enumerate(before) if old is not None and _track_seqlen(r) is None])
    except Exception:  # an observer never breaks the server
        pass
    return result


class _Exporter:
    def __init__(self) -> None:
        self.gauges: dict[str, Any] = {}
        self.seq = 0
        self.last = 0.0
        self.track = dict.fromkeys((*TRACK_GAUGES, *POOL_GAUGES), 0)
        self.window_open = False
        self.evidence = dict.fromkeys(EVIDENCE_GAUGES, 0)

    def gauge(self, name: str) -> Any:
        if name not in self.gauges:
            from prometheus_client import Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

            self.gauges[name] = Gauge(KIT_PREFIX + name, f"hybrid-conformance observe: {name}", multiprocess_mode="mostrecent")
        return self.gauges[name]

    def publish(self, scheduler: Any) -> None:
        for name, read in READERS.items():
            try:
                value = float(read(scheduler))
            except Exception:
                continue
            self.gauge(name).set(value)
        for name, n in self.evidence.items():
            self.gauge(name).set(n)
        self.gauge(AUDIT_COST_GAUGE).set(_AUDITOR.seconds)
        self.seq += 1
        self.window_open = False  # the next batch starts a new busy window
        self.gauge("idle_publish_seq").set(self.seq)

    def step(self, batch: Any) -> None:
        """Account one batch about to run (decode batches only)."""
        mode = getattr(batch, "forward_mode", None)
        if mode is None or not mode.is_decode():
            return
        t = self.track
        self._open_window()
        per_req = [track_slots(r) for r in batch.reqs]
        now = sum(per_req)
        t["decode_steps"] += 1
        t["decode_req_steps"] += len(per_req)
        t["track_slot_req_steps"] += now
        t["track_slots_now"] = now
        t["track_slots_step_peak"] = max(t["track_slots_step_peak"], now)
        t["track_slots_req_peak"] = max(t["track_slots_req_peak"], max(per_req, default=0))
        t["decode_running_peak"] = max(t["decode_running_peak"], len(per_req))
        for name in TRACK_GAUGES:
            self.gauge(name).set(t[name])

    def count(self, name: str) -> None:
        """One more of an evidence counter, published at once."""
        if name not in self.evidence:
            return
        self.evidence[name] += 1
        self.gauge(name).set(self.evidence[name])

    def cut(self, scheduler: Any, batch: Any) -> None:
        """An extend batch that holds the scheduler's chunked request: SGLang cut a prefill."""
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_decode():
            return
        chunked = getattr(scheduler, "chunked_req", None)
        if chunked is not None and any(r is chunked for r in batch.reqs):
            self.count("prefill_cuts_total")

    def _open_window(self) -> None:
        if not self.window_open:
            self.window_open = True
            self.track["busy_periods"] += 1
            for peak in _PEAKS:
                self.track[peak] = 0

    def pools(self, scheduler: Any) -> None:
        """Account the pools' used terms before one batch (any mode) runs."""
        stats = _pool_stats(scheduler)
        self._open_window()
        self.gauge("busy_periods").set(self.track["busy_periods"])
        for name, used in (("mamba_used_peak", stats.mamba_num_used), ("kv_used_peak", stats.full_num_used)):
            if used is not None:
                self.track[name] = max(self.track[name], used)
                self.gauge(name).set(self.track[name])


_EXPORTER = _Exporter()

#: (rid, matched length) of the refusals already recorded (a waiting request is refused every round)
_REFUSED: set[tuple[str, int]] = set()


def _matched(req: Any) -> int:
    """The prefix SGLang matched for ``req`` (``prefix_len``, else its ``prefix_indices``: a
    tensor up to 0.5.21, whose truth value SGLang's torch refuses when it is empty)."""
    n = getattr(req, "prefix_len", None)
    if n is not None:
        return int(n)
    indices = getattr(req, "prefix_indices", None)
    return 0 if indices is None else len(indices)


def _sequence(req: Any) -> list[int]:
    """The tokens SGLang matches a request on: its prompt and what it has decoded so far
    (``origin_input_ids`` + ``output_ids`` on every release; ``fill_ids``, the same sequence,
    exists on 0.5.12 only, ``full_untruncated_fill_ids`` from 0.5.13)."""
    out = getattr(req, "output_ids", None)
    return [int(t) for t in list(req.origin_input_ids) + (list(out) if out is not None else [])]


#: Pressure hooks whose observer failed once (each is named once in the request log, so the
#: kit reads its counter as not recorded instead of 0).
_OBSERVER_FAILED: set[str] = set()


def observer_failed(hook: str, error: BaseException) -> None:
    """Record that ``hook``'s observer could not read what it observes (once per hook): an
    observer never breaks the server, and never lets its silence read as "nothing happened"."""
    if hook in _OBSERVER_FAILED:
        return
    _OBSERVER_FAILED.add(hook)
    try:
        write_requests([{"ev": "observer_error", "hook": hook, "error": f"{type(error).__name__}: {error}"[:300]}])
    except Exception:  # an observer never breaks the server
        pass


def refused_observed(original: Callable, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the prefill adder's admission: a request refused for lack of KV or Mamba
    room (``NO_TOKEN``) after matching a cached prefix is recorded (result unchanged)."""
    result = original(adder, req, *args, **kwargs)
    try:
        n = _matched(req)
        if getattr(result, "name", "") == "NO_TOKEN" and n > 0 and (str(req.rid), n) not in _REFUSED:
            _REFUSED.add((str(req.rid), n))
            write_requests([{"ev": "refused", "rid": str(req.rid), "matched": n, "key": token_digest(_sequence(req)[:n])}])
    except Exception as e:  # an observer never breaks the server
        observer_failed("refused", e)
    return result


def retract_observed(original: Callable, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``retract_decode``: the requests SGLang retracted (result unchanged)."""
    result = original(batch, *args, **kwargs)
    try:
        if result[0]:
            for r in result[0]:
                _PREFILLED.pop(str(r.rid), None)  # its prefill runs again
            write_requests([{"ev": "retract", "rids": [str(r.rid) for r in result[0]]}])
    except Exception as e:  # an observer never breaks the server
        observer_failed("retract", e)
    return result


def split_observed(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on a tree node's split (result unchanged)."""
    result = original(*args, **kwargs)
    try:
        write_requests([{"ev": "split"}])
    except Exception as e:  # an observer never breaks the server
        observer_failed("split", e)
    return result


def tree_core_observed(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the unified tree's core construction: which core it runs (a Rust core
    splits nodes inside Rust, where the ``split`` hook cannot see them; result unchanged)."""
    result = original(*args, **kwargs)
    try:
        write_requests([{"ev": "tree_core", "core": f"{type(result).__module__}.{type(result).__qualname__}"}])
    except Exception as e:  # an observer never breaks the server
        observer_failed("tree_core", e)
    return result


#: Pressure evidence: name -> (hook, targets, newest first).  Every target the release has is
#: hooked: a release carries older trees beside the one a cell runs (0.5.18 has both
#: ``MambaRadixCache`` and the unified tree), so hooking only the first found can watch a tree
#: the server never builds.
PRESSURE_TARGETS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "refused": (refused_observed, ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",)),
    "retract": (retract_observed, ("sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",)),
    "split": (split_observed, ("sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.redistribute_on_node_split",  # 0.5.21 on
                               "sglang.srt.mem_cache.unified_cache.components.mamba_component.MambaComponent.redistribute_on_node_split",  # 0.5.18-0.5.20
                               "sglang.srt.mem_cache.unified_cache_components.mamba_component.MambaComponent.redistribute_on_node_split",  # up to 0.5.17
                               "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache._split_node")),
    "tree_core": (tree_core_observed, ("sglang.srt.mem_cache.unified_radix_cache.create_tree_core",)),
}


def register_pressure_hooks(registry: Any, around: Any) -> dict[str, list[tuple[str, Any]]]:
    """Register the pressure hooks on every target this release has: name -> [(target, SGLang's
    function there before the hooks applied)], names without a target left out."""
    import pkgutil

    chosen: dict[str, list[tuple[str, Any]]] = {}
    for name, (hook, targets) in PRESSURE_TARGETS.items():
        found = [(t, b) for t in targets if (b := _resolve(pkgutil, t)) is not None]
        for target, _ in found:
            registry.register(target, hook, around)
        if found:
            chosen[name] = found
    return chosen


def idle_publish(original: Callable, reporter: Any, *args: Any, **kwargs: Any) -> Any:
    now = time.monotonic()
    due = now - _EXPORTER.last >= MIN_INTERVAL_S
    collector = getattr(reporter, "metrics_collector", None)
    if due and collector is not None and hasattr(collector, "last_log_time"):
        collector.last_log_time = float("-inf")  # SGLang's own publish runs now, not in 30 s
    result = original(reporter, *args, **kwargs)
    if due and collector is not None and getattr(reporter, "current_scheduler_metrics_enabled", False):
        _EXPORTER.last = now
        evict_on_request(getattr(reporter, "scheduler", reporter))
        audit_tree(getattr(reporter, "scheduler", reporter), None, idle=True)
        _EXPORTER.publish(getattr(reporter, "scheduler", reporter))  # the legacy publisher is the scheduler
    return result


def wake_observed(original: Callable, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on :data:`WAKE_TARGET`: a reader asked, so the next idle publish is due now
    (a publish still runs only on an idle turn, after the question was answered)."""
    _EXPORTER.last = float("-inf")
    return original(scheduler, *args, **kwargs)


def evict_on_request(scheduler: Any) -> None:
    """The kit's request for SGLang's eviction walk over the whole tree, answered at idle
    (``conformance/sglang_plugins/evict_all.py``); the walk's frees are recorded like any walk's."""
    try:
        record = evict_all.serve(scheduler, requests_path())
        if record is not None:
            write_requests([record])
    except Exception:  # an observer never breaks the server; an unanswered request is visible to the kit
        pass


def before_run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook: read the batch, change nothing (returns None: arguments unchanged)."""
    try:
        _EXPORTER.pools(scheduler)
    except Exception:  # an observer never breaks the server; a missing gauge is visible to the kit
        pass
    try:
        _EXPORTER.step(batch)
    except Exception:  # an observer never breaks the server; a missing gauge is visible to the kit
        pass
    try:
        _EXPORTER.cut(scheduler, batch)
    except Exception:  # an observer never breaks the server; a missing gauge is visible to the kit
        pass
    try:
        write_requests(prefill_records(scheduler, batch))
    except Exception:  # an observer never breaks the server; a missing record is visible to the kit
        pass
    audit_tree(scheduler, batch)


#: The tree audit of this server (``conformance/sglang_plugins/tree_audit.py``).
_AUDITOR = Auditor()


def audit_tree(scheduler: Any, batch: Any, *, idle: bool = False) -> None:
    """Audit the scheduler's tree (before a batch runs, or at an idle publish: ``idle`` when no
    request runs or waits), write each new violation, count the audit."""
    try:
        idle = idle and not scheduler.running_batch.reqs and not scheduler.waiting_queue
        lens = {slot: n for slot, (n, _) in _TREE_STATES.items()}
        write_requests([v.to_json() for v in _AUDITOR.run(scheduler, batch, idle=idle, state_lens=lens)])
        _EXPORTER.count("tree_audits_total")
    except Exception as e:  # an observer never breaks the server; an audit that cannot run says so once
        if not _AUDITOR.failed:
            _AUDITOR.failed = f"{type(e).__name__}: {e}"[:300]
            write_requests([{"ev": "tree_audit_error", "error": _AUDITOR.failed}])


#: The tree operations in progress, innermost last (``walk``, ``insert``): what a state freed
#: now was freed by (SGLang's scheduler runs them on one thread).
_WITHIN: list[str] = []


def _pushed(stack: list, item: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run SGLang's ``original`` with ``item`` on top of ``stack`` (what is in progress while it runs)."""
    stack.append(item)
    try:
        return original(*args, **kwargs)
    finally:
        stack.pop()


def _within(cause: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run SGLang's ``original`` with ``cause`` as the tree operation in progress."""
    return _pushed(_WITHIN, cause, original, *args, **kwargs)


#: An eviction record's ``order`` when the tree walks its own LRU lists (no eviction policy reaches them).
LRU_LISTS = "lru_lists"


def walks_lru_lists(cache: Any) -> bool:
    """Does this tree evict by its own LRU lists whatever ``--radix-eviction-policy`` says?
    MambaRadixCache (hybrid models' default tree up to 0.5.15) keeps ``full_lru_list`` and
    ``mamba_lru_list`` and no eviction strategy; the unified tree (and its cores) carries one."""
    return hasattr(cache, "full_lru_list") and not hasattr(cache, "eviction_strategy") and not hasattr(cache, "tree_core")


def evict_counted(original: Callable, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the eviction walk: count walks that evicted anything, and record each
    in the per-request file, so its place among the prefill records says which requests'
    stores it came after; the states it frees are recorded ``by`` the walk (result unchanged)."""
    result = _within("walk", original, cache, *args, **kwargs)
    try:
        counts = {f: int(getattr(result, f, 0) or 0) for f in EVICT_FIELDS}
        if any(counts.values()):
            _EXPORTER.count("evictions_total")
            params = args[0] if args else kwargs.get("params")
            asked = {f"asked_{f}": int(getattr(params, f, 0) or 0) for f in EVICT_ASKED}  # which pool ran short
            order = {"order": LRU_LISTS, "tree": type(cache).__name__} if walks_lru_lists(cache) else {}
            write_requests([{"ev": "evict", **counts, **asked, **order}])
    except Exception:  # an observer never breaks the server
        pass
    return result


#: pool slot -> (prefix length, digest) of the state the tree took there (``state_stored``)
_TREE_STATES: dict[int, tuple[int, str]] = {}


def _slots(value: Any) -> list[int]:
    """The pool slots a mamba value (a tensor of slot indices) names."""
    return [int(x) for x in value.reshape(-1).tolist()]


def _key_tokens(key: Any) -> list[int]:
    """The token ids a radix key stands for (its ``limit`` honoured where the release has one)."""
    raw = getattr(key, "raw_token_ids", None)
    return [int(t) for t in (raw() if raw is not None else key.token_ids)]


def _remember(value: Any, tokens: list[int]) -> None:
    """A mamba state the tree took: remember its slot(s) and record it."""
    stored = (len(tokens), token_digest(tokens))
    for slot in _slots(value):
        _TREE_STATES[slot] = stored
    write_requests([{"ev": "state_stored", "len": stored[0], "key": stored[1]}])


def _forget(slots: list[int], by: str | None = None) -> None:
    """The tree's states in ``slots`` left it: record each, with what freed it (``by``, else
    the tree operation in progress; slots it never held are ignored)."""
    cause = by or (_WITHIN[-1] if _WITHIN else "other")
    gone = [_TREE_STATES.pop(s) for s in slots if s in _TREE_STATES]
    write_requests([{"ev": "state_evicted", "len": n, "key": d, "by": cause} for n, d in gone])


#: The requests a tree is caching now, innermost last: (rid, the lengths its states were tracked at).
_CACHING: list[tuple[str, tuple[int, ...]]] = []


def _tracked(req: Any) -> tuple[int, ...]:
    """The lengths a request's kept mamba states were computed at: its last and previous
    tracked lengths where the release keeps them (empty: it tracks none, e.g. no_buffer)."""
    out = []
    for attr in ("mamba_last_track_seqlen", "mamba_prev_track_seqlen"):
        v = getattr(_holder(req, attr), attr, None)
        if isinstance(v, int) and v > 0:
            out.append(v)
    return tuple(out)


def caching_req(original: Callable, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on a tree's caching of a request (:data:`CACHING_METHODS`): while it runs, an
    insert knows whose state it takes and where that state was tracked (result unchanged)."""
    req = args[0] if args else kwargs.get("req")
    try:
        entry = (str(req.rid), _tracked(req))
    except Exception:  # an observer never breaks the server
        entry = ("", ())
    return _pushed(_CACHING, entry, original, cache, *args, **kwargs)


def _judge_position(cache: Any, key_len: int) -> None:
    """Rule ``state_position`` on a state the tree just took from the request being cached."""
    if not _CACHING or not _CACHING[-1][1]:
        return
    rid, tracked = _CACHING[-1]
    found = state_position(key_len, rid, tracked, int(getattr(cache, "page_size", 1) or 1))
    lines = _AUDITOR.judged(tree_label(cache), STATE_POSITION_RULE)
    write_requests([r.to_json() for r in (*lines, *([found] if found else []))])


def state_stored(original: Callable, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the tree's insert: a mamba state the tree took (no state there before)
    is recorded with its prefix, and its slot remembered, and, when a request is being cached,
    judged by the rule ``state_position``; a state freed while it runs (the per-path cap) is
    freed ``by`` the insert (result unchanged)."""
    result = _within("insert", original, cache, params, *args, **kwargs)
    try:
        value, key = getattr(params, "mamba_value", None), getattr(params, "key", None)
        if value is not None and key is not None and not getattr(cache, "disable", False) and not result.mamba_exist:
            tokens = _key_tokens(key)
            _remember(value, tokens)
            _judge_position(cache, len(tokens))
    except Exception:  # an observer never breaks the server; a missing record is visible to the kit
        pass
    return result


def state_freed(original: Callable, cache: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on draining a tree step's frees: each tree state among its mamba device
    frees (read before the drain consumes them) is recorded as evicted (result unchanged).
    ``result`` is the step's result (``_apply_eviction_result``, 0.5.23) or its device-frees
    dict itself (``_drain_device_frees``, 0.5.17-0.5.22)."""
    try:
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        frees = getattr(result, "device_frees", result)
        slots = [s for value in (frees.get(ComponentType.MAMBA) or ()) for s in _slots(value)]
    except Exception:  # an observer never breaks the server
        slots = []
    out = original(cache, result, *args, **kwargs)
    try:
        _forget(slots)
    except Exception:  # an observer never breaks the server
        pass
    return out


def states_left(original: Callable, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on a tree's public eviction walk where the release has no drain to read
    (``walk`` plan): after a walk that evicted anything, each remembered state the tree no
    longer holds (``all_mamba_values_flatten``) is recorded as evicted (result unchanged)."""
    result = original(cache, *args, **kwargs)
    try:
        if _TREE_STATES and any(int(getattr(result, f, 1) or 0) for f in EVICT_FIELDS):
            held = set(_slots(cache.all_mamba_values_flatten()))
            _forget([s for s in list(_TREE_STATES) if s not in held], by="walk")
    except Exception:  # an observer never breaks the server
        pass
    return result


def tree_reset(original: Callable, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on the tree's reset (a flush): no slot holds a tree state any more, so a
    slot reused later is never taken for the prefix it held before; the reset is recorded
    (``tree_reset``: every state taken before it is gone; result unchanged)."""
    result = original(cache, *args, **kwargs)
    _TREE_STATES.clear()
    _AUDITOR.reset()
    try:
        write_requests([{"ev": "tree_reset"}])
    except Exception:  # an observer never breaks the server
        pass
    return result


#: plan -> the hook on its removal point
_FREE_HOOKS = {"step": state_freed, "drain": state_freed, "walk": states_left}


def _tree_class(tree: str) -> Any:
    """The tree class at dotted ``tree``, None when the release lacks it (or cannot import it)."""
    import pkgutil

    try:
        return pkgutil.resolve_name(tree)
    except Exception:  # a module the release lacks or cannot import: no such tree in this server
        return None


def state_hook_plan() -> tuple[dict[str, Callable], dict[str, str], list[str]]:
    """The per-node hooks this release takes (feature probes over :data:`STATE_TREES` and
    :data:`STATE_FREE_PLANS`): ``(hooks, plans, missing)`` -- dotted target -> hook, tree class
    name -> the plan it took, and one line per tree class that cannot be fully hooked (then
    no per-node evidence at all: ``hooks`` is empty).  A method a class inherits is hooked
    on the class that defines it (itself in the table)."""
    hooks: dict[str, Callable] = {}
    plans: dict[str, str] = {}
    missing: list[str] = []
    for tree in STATE_TREES:
        cls = _tree_class(tree)
        if cls is None:
            continue
        name = tree.rsplit(".", 1)[1]
        free = next(((m, plan) for m, plan in STATE_FREE_PLANS
                     if hasattr(cls, m) and (plan != "walk" or hasattr(cls, "all_mamba_values_flatten"))), None)
        lacks = [m for m in ("insert", "reset") if not hasattr(cls, m)]
        if free is None:
            lacks.append("a removal point (_apply_eviction_result, _drain_device_frees, or evict with all_mamba_values_flatten)")
        if lacks:
            missing.append(f"{name} lacks {', '.join(lacks)}")
            continue
        plans[name] = free[1]
        caching = [(m, caching_req) for m in CACHING_METHODS if hasattr(cls, m)]
        for method, hook in (("insert", state_stored), ("reset", tree_reset), (free[0], _FREE_HOOKS[free[1]]), *caching):
            owner = next(k for k in cls.__mro__ if method in vars(k))
            hooks[f"{owner.__module__}.{owner.__qualname__}.{method}"] = hook
    if missing:
        return {}, plans, missing
    return hooks, plans, missing


def _nest(inner: Callable, outer: Callable) -> Callable:
    """One AROUND hook running ``outer`` around ``inner`` around SGLang's function (one hook per
    target: the walk plan's state records come before the eviction counter's walk record,
    which ``conformance/checks/eviction_order.py`` relies on)."""
    def nested(original: Callable, *args: Any, **kwargs: Any) -> Any:
        return outer(lambda *a, **k: inner(original, *a, **k), *args, **kwargs)

    nested.__name__ = f"{outer.__name__}_around_{inner.__name__}"
    return nested


def register_state_hooks(registry: Any, around: Any, outer: dict[str, Callable] | None = None) -> Callable[[], list[str]]:
    """Register this release's per-node hooks (:func:`state_hook_plan`) with SGLang's hook
    registry; ``outer``: AROUND hooks the caller has for the same targets (the eviction
    counter on a tree's public ``evict``), nested around the state hook there and removed from
    ``outer``.  The returned function, called after ``apply_hooks``, writes the start line
    (``state_evictions`` true only when every tree class got every hook and each took effect)
    and returns the targets hooked."""
    import pkgutil

    hooks, plans, missing = state_hook_plan()
    before = {t: _resolve(pkgutil, t) for t in hooks}
    for target, hook in hooks.items():
        if outer and target in outer:
            hook = _nest(hook, outer.pop(target))
        registry.register(target, hook, around)

    def start_line(**extra: Any) -> list[str]:
        hooked = [t for t, b in before.items() if b is not None and _resolve(pkgutil, t) is not b]
        lacking = missing + [f"hook on {t} was not applied" for t in hooks if t not in hooked]
        if not plans and not lacking:
            lacking = ["no radix tree that holds mamba states"]
        per_node = bool(hooked) and not lacking
        # the kit refuses per-request evidence without this line; "no state_evicted record" means "none evicted" only with per_node
        write_requests([{"ev": "start", "state_evictions": per_node, "state_plans": plans, "state_missing": lacking, **extra}])
        return hooked

    return start_line


def install(role: str) -> dict[str, Any]:
    if role != "scheduler":
        return {}
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    owner, attr = STEP_TARGET.rsplit(".", 1)
    before = getattr(pkgutil.resolve_name(owner), attr)
    evict_before = {t: b for t in (EVICT_TARGET,) if (b := _resolve(pkgutil, t)) is not None}
    if not evict_before:
        evict_before = {t: b for t in LEGACY_EVICT_TARGETS if (b := _resolve(pkgutil, t)) is not None}
    idle_target = TARGET
    try:
        pkgutil.resolve_name(TARGET)
    except (ImportError, AttributeError):
        idle_target = LEGACY_TARGET
    HookRegistry.register(idle_target, idle_publish, HookType.AROUND)
    wake_before = _resolve(pkgutil, WAKE_TARGET)
    if wake_before is not None:
        HookRegistry.register(WAKE_TARGET, wake_observed, HookType.AROUND)
    HookRegistry.register(STEP_TARGET, before_run_batch, HookType.BEFORE)
    counters = dict.fromkeys(evict_before, evict_counted)
    state_line = register_state_hooks(HookRegistry, HookType.AROUND, outer=counters)
    pressure = register_pressure_hooks(HookRegistry, HookType.AROUND)
    for target, hook in counters.items():  # the counters no state hook shares a target with
        HookRegistry.register(target, hook, HookType.AROUND)
    lazy_owner, lazy_attr = LAZY_TARGET.rsplit(".", 1)
    lazy_before = getattr(pkgutil.resolve_name(lazy_owner), lazy_attr, None)
    if lazy_before is not None:  # releases with the lazy strategy
        HookRegistry.register(LAZY_TARGET, lazy_prealloc_observed, HookType.AROUND)
    HookRegistry.apply_hooks()
    if getattr(pkgutil.resolve_name(owner), attr) is before:  # SGLang logs a failed hook and carries on
        raise RuntimeError(f"hook on {STEP_TARGET} was not applied")
    evict_hooked = [t for t, b in evict_before.items() if _resolve(pkgutil, t) is not b]
    if not evict_hooked or len(evict_hooked) < len(evict_before):
        # an eviction path not seen: never publish a counter that would read "no eviction" (the kit refuses the oracle)
        _EXPORTER.evidence.pop("evictions_total", None)
    gauges = sorted(KIT_PREFIX + n for n in (*READERS, *TRACK_GAUGES, *POOL_GAUGES, *EVIDENCE_GAUGES, AUDIT_COST_GAUGE)) + [KIT_PREFIX + "idle_publish_seq"]
    if lazy_before is not None and getattr(pkgutil.resolve_name(lazy_owner), lazy_attr) is lazy_before:
        raise RuntimeError(f"hook on {LAZY_TARGET} was not applied")
    pressure_hooked = {n: hooked for n, found in pressure.items() if (hooked := [t for t, b in found if _resolve(pkgutil, t) is not b])}
    state_hooked = state_line(pressure=sorted(pressure_hooked))
    wake_hooked = [WAKE_TARGET] if wake_before is not None and _resolve(pkgutil, WAKE_TARGET) is not wake_before else []
    around = list(dict.fromkeys([idle_target, *wake_hooked, *evict_hooked, *state_hooked, *(t for ts in pressure_hooked.values() for t in ts)]
                                + ([LAZY_TARGET] if lazy_before is not None else [])))
    return {"around": around, "before": [STEP_TARGET], "gauges": gauges, "requests": requests_path()}


def _resolve(pkgutil: Any, target: str) -> Any:
    """The function at dotted ``target`` (class attribute), None when the release lacks it."""
    owner, attr = target.rsplit(".", 1)
    try:
        return getattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError):
        return None
