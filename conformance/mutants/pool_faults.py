"""Seeded pool faults: monkeypatches of SGLang's REAL memory-management functions.

Each fault re-creates a known class of bug so the kit can show its pool tier catches it.
Use as a pytest plugin: ``HYBRID_CONFORMANCE_FAULT=<name> pytest -p conformance.mutants.
pool_faults ...`` (``FAULT_ENV`` is read in one place: :func:`selected_fault`), or in
process with ``with apply(name): ...``.  ``FAULTS`` maps name -> :class:`conformance.matrix.faults.SeededFault`
(layer ``pool``: description, real bug modelled, patch function, strategies it applies to).  A patch function takes the
``conformance.sglang_api.pool`` namespace (the req.kv driver's symbols) and a ``setattr``-like ``patch(obj, name, value)`` callable.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import torch

from conformance.errors import KitError
from conformance.matrix.faults import FAULT_ENV, SeededFault, registry
from conformance.matrix.strategy import BUFFERED, LAZY, NAMES
from conformance.sglang_api import pool as sglang_api

#: What catches a pool fault: the first invariant of the pool suite that breaks.
CAUGHT_AS = "a pool invariant of the pool suite (`conformance/suites/leaks`, `-m pool`) fails"


def _pingpong_leak_on_finish(api, patch):
    pool_cls = api.HybridReqToTokenPool
    original = pool_cls.free_mamba_cache

    def free_mamba_cache(self, req, mamba_ping_pong_track_buffer_to_keep=None):
        if req.kv.mamba_ping_pong_track_buffer is None:
            return original(self, req, mamba_ping_pong_track_buffer_to_keep)
        self.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_pool_idx = None
        req.kv.mamba_ping_pong_track_buffer = None  # slots forgotten, never freed
        req.kv.mamba_ping_pong_empty = None
        req.kv.mamba_next_track_idx = req.kv.mamba_last_track_idx = None
        req.kv.mamba_last_track_seqlen = req.kv.mamba_prev_track_seqlen = None

    patch(pool_cls, "free_mamba_cache", free_mamba_cache)


def _pingpong_stale_reference(api, patch):
    pool_cls = api.HybridReqToTokenPool
    original = pool_cls.free_mamba_cache

    def free_mamba_cache(self, req, mamba_ping_pong_track_buffer_to_keep=None):
        buf, empty, nxt = req.kv.mamba_ping_pong_track_buffer, req.kv.mamba_ping_pong_empty, req.kv.mamba_next_track_idx
        original(self, req, mamba_ping_pong_track_buffer_to_keep)
        if buf is not None:  # pre-fix behaviour: the finished Req keeps naming freed slots
            req.kv.mamba_ping_pong_track_buffer, req.kv.mamba_ping_pong_empty = buf, list(empty)
            req.kv.mamba_next_track_idx = nxt

    patch(pool_cls, "free_mamba_cache", free_mamba_cache)


def _lazy_second_slot_kept(api, patch):
    cls = api.SchedulerBatchResultProcessor

    def mamba_lazy_post_decode_at_boundary(self, req, batch, track_idx):
        req.kv.mamba_last_track_idx = track_idx
        req.kv.mamba_next_track_idx = track_idx  # the old slot is never given back

    patch(cls, "mamba_lazy_post_decode_at_boundary", mamba_lazy_post_decode_at_boundary)


def _lazy_alloc_fail_tracks_empty_slot(api, patch):
    cls = api.ScheduleBatch
    original = cls.mamba_lazy_prealloc_at_boundary

    def mamba_lazy_prealloc_at_boundary(self, mamba_track_interval):
        before = {id(r): r.kv.mamba_next_track_idx for r in self.reqs}
        original(self, mamba_track_interval)
        for i, req in enumerate(self.reqs):
            other = 1 - before[id(req)]
            if self.seq_lens_cpu[i].item() % mamba_track_interval == 0 and req.kv.mamba_ping_pong_empty[other]:
                req.kv.mamba_next_track_idx = other  # failure path still switches to the missing slot

    patch(cls, "mamba_lazy_prealloc_at_boundary", mamba_lazy_prealloc_at_boundary)


def _track_shift(delta: int):
    """Off by ``delta`` in the track seqlen SGLang hands to the kernel (the entry's
    ``track_seqlen``, where ``_force_track_h``'s +1 lives), while the length SGLang records
    as tracked (``mamba_last_track_seqlen``) stays right: the kernel snapshots another
    position's state (or a chunk state past the sequence) under the recorded key."""

    def apply(api, patch):
        cls = api.ScheduleBatch
        original = cls._mamba_radix_cache_v2_req_prepare_for_extend

        def prepare(self, req):
            entry = original(self, req)
            if entry.track_mask:
                return entry._replace(track_seqlen=entry.track_seqlen + delta)
            return entry

        patch(cls, "_mamba_radix_cache_v2_req_prepare_for_extend", prepare)

    return apply


def _cow_skipped(api, patch):
    cls = api.MambaComponent
    original = cls.finalize_match_result_in_cache

    def finalize(self, params, result):
        out = original(self, params, result)
        if params.req is not None:
            params.req.kv.mamba_cow_src_index = None  # the hit continues from a stale/zeroed slot
        return out

    patch(cls, "finalize_match_result_in_cache", finalize)


def _donate_keeps_reference(api, patch):
    pool_cls = api.HybridReqToTokenPool

    def donate(self, req, new_slot):
        idx = self.get_mamba_ping_pong_keep_idx(req)
        self.mamba_allocator.free(new_slot)  # the refill is dropped: the request keeps the donated slot
        return req.kv.mamba_ping_pong_track_buffer[idx].unsqueeze(-1).clone()

    patch(pool_cls, "donate_mamba_ping_pong_slot", donate)


def _mamba_double_free(api, patch):
    pool_cls = api.HybridReqToTokenPool
    original = pool_cls.free_mamba_cache

    def free_mamba_cache(self, req, mamba_ping_pong_track_buffer_to_keep=None):
        idx = req.kv.mamba_pool_idx
        original(self, req, mamba_ping_pong_track_buffer_to_keep)
        self.mamba_allocator.free(idx.unsqueeze(0))

    patch(pool_cls, "free_mamba_cache", free_mamba_cache)


def _mamba_freed_into_kv_pool(api, patch):
    module = api.mem_cache_common
    original = module.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint):
        idx = req.kv.mamba_pool_idx
        mamba_allocator = tree_cache.req_to_token_pool.mamba_allocator
        real_free = mamba_allocator.free
        diverted = []

        def free(slots):
            if idx is not None and slots.numel() == 1 and int(slots.view(-1)[0]) == int(idx):
                diverted.append(slots.view(-1).to(torch.int64))
                return None
            return real_free(slots)

        mamba_allocator.free = free
        try:
            return original(req, tree_cache, checkpoint=checkpoint)
        finally:
            del mamba_allocator.free
            for slots in diverted:  # handed to the KV allocator instead
                tree_cache.token_to_kv_pool_allocator.free(slots)

    patch(module, "release_kv_cache", release_kv_cache)
    patch(api, "release_kv_cache", release_kv_cache)


def _leak_on_abort(api, patch):
    module = api.mem_cache_common
    original = module.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint):
        if not isinstance(req.finished_reason, api.FINISH_ABORT):
            return original(req, tree_cache, checkpoint=checkpoint)
        allocator = tree_cache.req_to_token_pool.mamba_allocator
        allocator.free = lambda slots: None  # the abort path forgets its mamba slots
        try:
            return original(req, tree_cache, checkpoint=checkpoint)
        finally:
            del allocator.free

    patch(module, "release_kv_cache", release_kv_cache)
    patch(api, "release_kv_cache", release_kv_cache)


def _refused_after_match_leak(api, patch):
    module = api.mem_cache_common
    original = module.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint):
        if not req.kv.holds_kv and req.kv.holds_mamba:
            req.kv.mamba_pool_idx = None  # the COW slot of a refused request is dropped, not freed
            return None
        return original(req, tree_cache, checkpoint=checkpoint)

    patch(module, "release_kv_cache", release_kv_cache)
    patch(api, "release_kv_cache", release_kv_cache)


def _session_abort_keeps_record(api, patch):
    cls = api.StreamingSession
    original = cls.try_cache_finished_req

    def try_cache_finished_req(self, req):
        session_id = req.session.session_id if getattr(req, "session", None) is not None else None
        slot = self.slots.get(session_id) if session_id is not None else None
        kept = original(self, req)
        if not kept and slot is not None and isinstance(req.finished_reason, api.FINISH_ABORT):
            self.slots[session_id] = slot  # the aborted turn's record (released by the caller) stays with the session
        return kept

    patch(cls, "try_cache_finished_req", try_cache_finished_req)


def _finish_keeps_the_next_track_slot(api, patch):
    module = api.mem_cache_common
    original = module.release_kv_cache

    def release_kv_cache(req, tree_cache, *, checkpoint):
        kv = req.kv
        if checkpoint and kv.mamba_ping_pong_track_buffer is not None and kv.mamba_next_track_idx is not None:
            kv.mamba_last_track_idx = kv.mamba_next_track_idx  # the slot the next forward writes, not the tracked one
        return original(req, tree_cache, checkpoint=checkpoint)

    patch(module, "release_kv_cache", release_kv_cache)
    patch(api, "release_kv_cache", release_kv_cache)


ALL = NAMES


def _pool_fault(name: str, description: str, real_bug: str, where: str, patch: Callable[[object, Callable], None],
                strategies: tuple[str, ...] = ALL) -> SeededFault:
    """A pool-tier record: ``patch`` replaces SGLang's ``where`` (in ``conformance.sglang_api.pool``'s
    namespace); caught as a broken pool invariant."""
    return SeededFault(name, "pool", description, real_bug, where, CAUGHT_AS, patch=patch, strategies=strategies)


FAULTS: dict[str, SeededFault] = registry(
    _pool_fault("pingpong_leak_on_finish", "finishing requests never return their ping-pong track slots",
                "PR 26941 class: ping-pong slots leaked per finished request until the idle check killed the server",
                "HybridReqToTokenPool.free_mamba_cache", _pingpong_leak_on_finish, BUFFERED),
    _pool_fault("pingpong_stale_reference", "a finished Req keeps naming its freed ping-pong slots",
                "PR 26941 itself: the stale mamba_ping_pong_track_buffer made the next alloc of a reused Req skip",
                "HybridReqToTokenPool.free_mamba_cache", _pingpong_stale_reference, BUFFERED),
    _pool_fault("lazy_second_slot_kept", "the transient lazy slot is never returned after a boundary step",
                "PR 27118 class: mamba_lazy_post_decode_at_boundary not freeing the old slot",
                "SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary", _lazy_second_slot_kept, LAZY),
    _pool_fault("lazy_alloc_fail_tracks_empty_slot", "a failed lazy boundary allocation still tracks into the missing slot, which is then inserted",
                "PR 27118 class: alloc-fail path inserting a state that was never written",
                "ScheduleBatch.mamba_lazy_prealloc_at_boundary", _lazy_alloc_fail_tracks_empty_slot, LAZY),
    _pool_fault("track_boundary_early", "prefill passes the kernel a track seqlen one token short (the +1 of _force_track_h dropped); the recorded length stays right",
                "off-by-one in SGLang's track seqlen (_mamba_radix_cache_v2_req_prepare_for_extend): the state of another position is cached under the key",
                "ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend", _track_shift(-1), BUFFERED),
    _pool_fault("track_boundary_late", "prefill passes the kernel a track seqlen one token long (a +1 where the last position is aligned); the recorded length stays right",
                "off-by-one in SGLang's track seqlen: an aligned snapshot reads a chunk state past the sequence's own",
                "ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend", _track_shift(+1), BUFFERED),
    _pool_fault("cow_skipped", "a cache hit does not copy the matched state into the request's slot",
                "PR 26877 class: a hit continues from a zeroed or stale state",
                "MambaComponent.finalize_match_result_in_cache", _cow_skipped),
    _pool_fault("donate_keeps_reference", "a donated track slot stays referenced by the running request",
                "eviction then frees a slot a running request still writes",
                "HybridReqToTokenPool.donate_mamba_ping_pong_slot", _donate_keeps_reference, BUFFERED),
    _pool_fault("mamba_double_free", "a finished request's mamba slot is freed twice",
                "double free: the slot is later handed to two owners",
                "HybridReqToTokenPool.free_mamba_cache", _mamba_double_free),
    _pool_fault("mamba_freed_into_kv_pool", "a finished request's mamba slot is returned to the wrong pool (the KV allocator)",
                "PR 27256 class: frees routed to the wrong allocator/device",
                "mem_cache.common.release_kv_cache", _mamba_freed_into_kv_pool),
    _pool_fault("leak_on_abort", "aborted requests never return their mamba slots",
                "leak only on the abort path",
                "mem_cache.common.release_kv_cache", _leak_on_abort),
    _pool_fault("session_abort_keeps_record", "an aborted streaming turn's released record stays with its session",
                "PR 26941 (abort path): try_cache_finished_req must hand the record back and clear it from the session",
                "StreamingSession.try_cache_finished_req", _session_abort_keeps_record, ("extra_buffer",)),
    _pool_fault("finish_keeps_next_track_slot", "a finishing request hands the tree the ping-pong slot the next forward writes",
                "overlap lookahead at finish: the launched forward overwrites the slot the tree was given",
                "mem_cache.common.release_kv_cache", _finish_keeps_the_next_track_slot, ("extra_buffer",)),
    _pool_fault("refused_after_match_leak", "a request refused after its match keeps its copy-on-write slot",
                "matched-request scheduling failure leak (scheduler's revert of the matched mamba idx)",
                "mem_cache.common.release_kv_cache", _refused_after_match_leak),
)


def get(name: str) -> SeededFault:
    if name not in FAULTS:
        raise KitError(f"{FAULT_ENV}={name!r}: unknown pool fault (known: {', '.join(FAULTS)})")
    return FAULTS[name]


@contextlib.contextmanager
def apply(name: str) -> Iterator[SeededFault]:
    """Install one fault for the duration of the block (undone in reverse order)."""
    fault = get(name)
    api = sglang_api.load()
    undo: list[tuple[object, str, object, bool]] = []

    def patch(obj, attr, value):
        had = attr in vars(obj)
        undo.append((obj, attr, getattr(obj, attr, None), had))
        setattr(obj, attr, value)

    fault.patch(api, patch)
    try:
        yield fault
    finally:
        for obj, attr, old, had in reversed(undo):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


def selected_fault() -> str | None:
    """The one place the fault env var is read."""
    return os.environ.get(FAULT_ENV) or None


_ACTIVE: contextlib.ExitStack | None = None


def pytest_configure(config) -> None:
    global _ACTIVE
    name = selected_fault()
    if name is None:
        return
    _ACTIVE = contextlib.ExitStack()
    _ACTIVE.enter_context(apply(name))


def pytest_unconfigure(config) -> None:
    if _ACTIVE is not None:
        _ACTIVE.close()


def pytest_report_header(config) -> list[str]:
    name = selected_fault()
    return [f"pool fault injected: {name} ({get(name).description})"] if name else []
