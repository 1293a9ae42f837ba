"""Invariants of the pool tier, evaluated on a :class:`PoolHarness` after every step.

Each check raises :class:`PoolInvariantError` with one line naming the invariant and the
numbers.  The set:

* ``sglang_checker`` (where the release has it): SGLang's own ``SchedulerInvariantChecker`` in strict mode: the idle
  equation per pool (``available + evictable + protected + session_held + uncached ==
  total``) and the request-row check when idle, its busy full-pool check otherwise.
* ``slot_partition``: every mamba slot 1..N is in exactly one of: the allocator's free
  list, a radix-tree node, a running request (its state slot and ping-pong slots), a
  streaming session's kept record.
  Catches leaks, double frees, frees into the wrong pool and stale references.
* ``counts``: the kit's own equations for the mamba pool (also while busy) and the
  request-row pool.
* ``ping_pong``: ``extra_buffer`` requests hold 2 track slots, ``extra_buffer_lazy`` 1
  (between steps; the transient second slot lives only inside a boundary step).
* ``tree_states``: every state the tree holds carries the marker of its key; every
  request's live and last tracked state carries the marker of its recorded length.
"""

from __future__ import annotations

from types import SimpleNamespace

from conformance.sglang_api import state_marker
from conformance.sglang_api.pool_base import record_slots
from conformance.matrix.strategy import strategy_named


class PoolInvariantError(AssertionError):
    """A pool invariant failed; the message is one line naming it."""


def _fail(name: str, msg: str) -> PoolInvariantError:
    return PoolInvariantError(f"[{name}] {msg}")


def make_sglang_checker(h):
    """SGLang's pool-stats observer and invariant checker wired to the driver's pools
    (None where the release has no such checker: the other invariants still run)."""
    if not h.sglang_checker:
        return None
    api = h.api
    obs = api.SchedulerPoolStatsObserver(
        tree_cache=h.tree, token_to_kv_pool_allocator=h.alloc, req_to_token_pool=h.rtp,
        session_controller=SimpleNamespace(sessions={}), hisparse_coordinator=None, is_hybrid_swa=False,
        is_hybrid_ssm=True, enable_hisparse=False, full_tokens_per_layer=h.alloc.size,
        swa_tokens_per_layer=None, max_total_num_tokens=h.alloc.size,
    )
    running = lambda: SimpleNamespace(reqs=[r.req for r in h.running.values()]) if h.running else None  # noqa: E731
    chk = api.SchedulerInvariantChecker(
        is_hybrid_swa=False, is_hybrid_ssm=True, disaggregation_mode=api.DisaggregationMode.NULL,
        page_size=h.key.page_size, full_tokens_per_layer=h.alloc.size, swa_tokens_per_layer=None,
        max_total_num_tokens=h.alloc.size, tree_cache=h.tree, token_to_kv_pool_allocator=h.alloc,
        req_to_token_pool=h.rtp, pool_stats_observer=obs, get_last_batch=running, get_running_batch=running,
        scheduler_stage_metrics=None,
    )
    return obs, chk


def sglang_checker(h, checker=None) -> None:
    checker = checker or make_sglang_checker(h)
    if checker is None:
        return
    obs, chk = checker
    with h.api.envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(True):
        try:
            if h.running:
                ps = obs.get_pool_stats()
                uncached, _ = chk._get_total_uncached_sizes()
                leak, msg = chk._check_full_pool(ps, uncached=uncached)
                if leak:
                    raise ValueError(f"busy full pool memory leak detected! {msg}")
                return
            leak, messages = chk._check_all_pools(obs.get_pool_stats())
            if leak:
                chk._report_leak("pool", " | ".join(messages))
            chk._check_req_pool()
        except (ValueError, AssertionError) as e:
            raise _fail("sglang_checker", " ".join(str(e).split())) from None


def request_slots(h, run) -> list[int]:
    return h.request_slots(run.req)


def slot_partition(h) -> None:
    size = h.rtp.mamba_pool.size
    owners: dict[int, list[str]] = {}
    for s in h.free_mamba_slots():
        owners.setdefault(s, []).append("free")
    for s in h.tree_mamba_slots():
        owners.setdefault(s, []).append("tree")
    live = {id(h.state(r.req)) for r in h.running.values()}
    for sid, record in h.session_records().items():
        if id(record) not in live:  # a running turn borrows its session's record
            for s in _record_slots(record):
                owners.setdefault(s, []).append(f"session:{sid}")
    for run in h.running.values():
        for s in request_slots(h, run):
            owners.setdefault(s, []).append(run.rid)
    missing = sorted(set(range(1, size + 1)) - set(owners))
    shared = {s: o for s, o in sorted(owners.items()) if len(o) > 1}
    foreign = sorted(s for s in owners if not 1 <= s <= size)
    if missing or shared or foreign:
        raise _fail("slot_partition", f"mamba slots owned by nobody (leaked)={missing or None}, by several={shared or None}, out of range={foreign or None}")


def _record_slots(kv) -> list[int]:
    """Mamba slots a detached request record (a streaming session's) holds."""
    return record_slots(kv)


def counts(h) -> None:
    live = {id(h.state(r.req)) for r in h.running.values()}
    held = sum(len(request_slots(h, r)) for r in h.running.values())
    held += sum(len(_record_slots(kv)) for kv in h.session_records().values() if id(kv) not in live)
    avail = h.mamba_available()
    ev, prot, total = h.tree.mamba_evictable_size(), h.tree.mamba_protected_size(), h.rtp.mamba_pool.size
    if avail + ev + prot + held != total:
        raise _fail("counts", f"[mamba] available={avail} + evictable={ev} + protected={prot} + held_by_requests={held} != total={total}")
    rows = h.rtp.available_size()
    sessions = sum(1 for kv in h.session_records().values() if id(kv) not in live and kv.req_pool_idx is not None)
    if rows + len(h.running) + sessions != h.rtp.size:
        raise _fail("counts", f"[req] available={rows} + running={len(h.running)} + session rows={sessions} != total={h.rtp.size}")


def ping_pong(h) -> None:
    if not h.extra:
        return
    want = strategy_named(h.key.strategy).ping_pong_slots
    for run in h.running.values():
        kv = h.state(run.req)
        if kv.mamba_ping_pong_track_buffer is None:
            raise _fail("ping_pong", f"{run.rid} holds no ping-pong buffer")
        held = len(h.request_slots(run.req)) - (kv.mamba_pool_idx is not None)
        if held != want:
            raise _fail("ping_pong", f"{h.key.strategy} request {run.rid} holds {held} track slots between steps, expected {want}")


def tree_state_keys(h) -> dict[tuple[int, ...], int]:
    """Every state the tree holds: token key -> mamba slot."""
    return h.tree_state_keys()


def tree_states(h) -> None:
    pool = h.rtp.mamba_pool
    for key, slot in tree_state_keys(h).items():
        got = state_marker.read(pool, slot)
        if got != state_marker.marker_for(key):
            raise _fail("tree_states", f"tree node at length {len(key)} (slot {slot}) holds {got}, expected {state_marker.marker_for(key)}")
    for run in h.running.values():
        kv, seq = h.state(run.req), run.tokens
        covered = h.live_state_len(run)
        if kv.mamba_pool_idx is not None and kv.req_pool_idx is not None and covered is not None:
            got = state_marker.read(pool, int(kv.mamba_pool_idx))
            want = state_marker.marker_for(seq[:covered])
            if got != want:
                raise _fail("tree_states", f"{run.rid} live slot {int(kv.mamba_pool_idx)} holds {got}, expected {want}")
        n = getattr(kv, "mamba_last_track_seqlen", None)
        if h.extra and n is not None and kv.mamba_ping_pong_track_buffer is not None:
            track = getattr(kv, "mamba_last_track_idx", None)
            if track is None:  # older lifecycle: the kept slot is the other of the next one
                track = 1 - kv.mamba_next_track_idx if kv.mamba_next_track_idx is not None else None
            if track is None:
                continue
            slot = int(kv.mamba_ping_pong_track_buffer[track])
            if state_marker.read(pool, slot) != state_marker.marker_for(seq[:n]):
                raise _fail("tree_states", f"{run.rid} tracked length {n} but slot {slot} holds {state_marker.read(pool, slot)}")


def check_all(h, checker=None) -> None:
    slot_partition(h)
    counts(h)
    sglang_checker(h, checker)
    ping_pong(h)
    tree_states(h)


def back_to_totals(h) -> None:
    """After evict-all at idle every pool is back at its total."""
    mamba = (h.mamba_available(), h.rtp.mamba_pool.size)
    kv = (h.alloc.available_size(), h.alloc.size)
    rows = (h.rtp.available_size(), h.rtp.size)
    if mamba[0] != mamba[1] or kv[0] != kv[1] or rows[0] != rows[1]:
        raise _fail("back_to_totals", f"after evict-all: mamba {mamba[0]}/{mamba[1]}, kv {kv[0]}/{kv[1]}, rows {rows[0]}/{rows[1]} available")
