"""Per-strategy mamba slot bookkeeping of the reference engine (the kit's own rules,
following SGLang 0.5.23's ``--mamba-radix-cache-strategy``):

* ``no_buffer`` — one working slot; at finish the working slot itself (the state after the
  whole sequence) is donated to the radix cache.
* ``extra_buffer`` — the working slot plus 2 ping-pong track slots; a tracked snapshot is
  written to the ``next`` slot and the indices swap; at finish the last tracked snapshot is
  inserted.
* ``extra_buffer_lazy`` — the working slot plus 1 track slot; the second is allocated just
  before a decode track boundary and the old keep slot is freed after it.  If that
  allocation fails (or ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1``) the boundary is tracked in
  place in the keep slot (0.5.23 has no evict-retry there), so what is cached is unchanged.
"""

from __future__ import annotations

import logging

from conformance.reference.radix import Snapshot
from conformance.reference.request import Req

log = logging.getLogger("sglang.srt.managers.schedule_batch")


class SlotKeeper:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.strategy = engine.strategy
        self.lazy = self.strategy.lazy
        self.peak = 0

    # ------------------------------------------------------------ allocation
    def slots_per_request(self) -> int:
        return 1 + self.strategy.ping_pong_slots

    def _alloc(self, n: int) -> list[int] | None:
        e = self.engine
        got = e.mamba_pool.alloc(n)
        if got is None and not e.cfg.disable_radix_cache:
            e.cache.evict_mamba(n - e.mamba_pool.available())
            got = e.mamba_pool.alloc(n)
        return got

    def alloc_for(self, req: Req, n: int, matched: bool) -> bool:
        """Working slot first (the copy-on-write target), then the track slots."""
        working = self._alloc(1)
        if working is None:
            return False
        extra = self._alloc(n - 1) if n > 1 else []
        if extra is None:
            if not (matched and self.engine.faults.active("sched_fail_leak")):
                self.engine.mamba_pool.free(working)
            return False
        req.working_slot = working[0]
        req.pingpong = (extra + [None, None])[:2]
        return True

    def free_request_slots(self, req: Req) -> None:
        self.engine.mamba_pool.free([req.working_slot, *req.pingpong_slots()])
        req.working_slot, req.pingpong, req.track = None, [None, None], {}

    def pingpong_resident(self) -> int:
        held = list(self.engine.running) + list(self.engine.sessions.held())
        return sum(len(r.pingpong_slots()) for r in held)

    def update_peak(self) -> None:
        self.peak = max(self.peak, self.pingpong_resident())

    # ------------------------------------------------------------ tracking
    def tracks_decode(self) -> bool:
        return self.strategy.has_buffer and not self.engine.cfg.disable_radix_cache

    def prefill_track_position(self, req: Req) -> int | None:
        """SGLang's prefill checkpoint: prefix + whole checkpoint grids of the extend, or the
        branching point when it lies inside this extend."""
        e, p = self.engine, req.prefix_len
        extend = len(req.input_ids) - p
        if not self.strategy.has_buffer:
            return len(req.input_ids) if extend > 0 else None
        if extend < e.checkpoint_grid:
            return None
        pos = p + extend // e.checkpoint_grid * e.checkpoint_grid
        b = req.branching_seqlen
        if b is not None and p < b <= pos and (b - p) % e.chunk == 0:
            pos = b
        return pos

    def track(self, req: Req, pos: int, state, row) -> None:
        """Store a snapshot at ``pos`` in the request's next track slot (no_buffer: in a
        holder that gets its own slot when it is checkpointed)."""
        idx = req.next_track_idx if self.strategy.has_buffer else 0
        req.track[idx] = Snapshot(req.pingpong[idx], state, row)
        req.prev_track_seqlen, req.last_track_seqlen = req.last_track_seqlen, pos
        req.last_track_idx = idx
        if self.strategy.has_buffer and not self.lazy:
            req.next_track_idx = 1 - idx

    def checkpoint_after_prefill(self, req: Req) -> None:
        """Publish the prefill's tracked snapshot into the tree (SGLang's checkpoint after a
        prefill chunk): no_buffer copies the state into a new slot; extra_buffer* donate the
        track slot and take a fresh one in its place."""
        e = self.engine
        idx = req.last_track_idx
        if idx is None or idx not in req.track:
            return
        snap = req.track.pop(idx)
        pos = req.last_track_seqlen
        req.last_track_idx = req.last_track_seqlen = req.prev_track_seqlen = None
        fresh = self._alloc(1)
        if fresh is None:  # nothing evictable: the checkpoint is skipped
            return
        if not self.strategy.has_buffer:
            snap.slot = fresh[0]
        else:
            req.pingpong[idx] = fresh[0]
        tree_len = req.lock_node.depth if req.lock_node is not None else 0
        new_tokens, taken = e.cache.insert(req.input_ids[:pos], snap)
        if not taken and not e.faults.active("dup_insert_leak"):
            e.mamba_pool.free([snap.slot])
        moved = pos - tree_len
        req.kv_reserved -= moved
        e.kv_pool.free(moved - new_tokens)
        node = e.cache.match(req.input_ids, pos).node
        e.cache.lock(node)
        e.cache.unlock(req.lock_node)
        req.lock_node = node
        self.update_peak()

    def before_boundary(self, req: Req) -> None:
        """Lazy only: take the second ping-pong slot for the coming boundary."""
        if not self.lazy:
            return
        other = 1 - req.next_track_idx
        req.lazy_pending = None
        if req.pingpong[other] is not None:
            return
        slot = None if self.engine.faults.lazy_alloc_fail else self.engine.mamba_pool.alloc(1)
        if slot is None:  # no evict-retry in 0.5.23: the boundary is tracked in place
            log.debug("mamba lazy prealloc failed at boundary (rid=%s); tracking in place", req.rid)
            return
        req.pingpong[other] = slot[0]
        req.lazy_pending = other
        self.update_peak()

    def after_boundary(self, req: Req, pos: int, state, row, previous_state) -> None:
        """Record the boundary state; ``previous_state`` is the state before this step."""
        if not self.lazy:
            self.track(req, pos, state, row)
            return
        new = req.lazy_pending
        req.lazy_pending = None
        if new is None:  # allocation failed: tracking degrades in place into the keep slot
            if not self.engine.faults.active("lazy_fail_still_inserts"):
                self.track(req, pos, state, row)
            else:  # the fault: the write is lost (old recurrent state), the key still advances
                self.track(req, pos, state.with_recurrent_from(previous_state), row)
            return
        old = req.next_track_idx
        req.next_track_idx = new
        self.track(req, pos, state, row)
        req.track.pop(old, None)
        finishing = len(req.output_ids) + 1 >= req.sampling.max_new_tokens  # this step emits the last token
        if not self.engine.faults.active("lazy_slot_not_returned") and not (finishing and self.engine.faults.active("lazy_finish_at_boundary_leak")):
            self.engine.mamba_pool.free([req.pingpong[old]])
        req.pingpong[old] = None

    # ------------------------------------------------------------ release
    def release(self, req: Req, insert: bool, to_session: bool = True) -> None:
        """Finish-time release: insert into the cache, free or donate slots and KV."""
        e = self.engine
        if to_session and insert and e.sessions.hold(e, req):
            return
        donated = None
        new_tree_tokens = 0
        if insert and not e.cfg.disable_radix_cache:
            cache_len, snap = self._finished_checkpoint(req)
            cache_len = cache_len // e.cfg.page_size * e.cfg.page_size
            if cache_len > 0 and snap is not None:
                new_tree_tokens, taken = e.cache.insert(req.all_tokens()[:cache_len], snap)
                donated = snap.slot if taken else None
        e.kv_pool.free(req.kv_reserved)
        e.kv_pool.alloc(new_tree_tokens)
        req.kv_reserved = 0
        if req.lock_node is not None:
            e.cache.unlock(req.lock_node)
            req.lock_node = None
        self._free_finished_slots(req, donated)
        if req.holds_row:
            e.req_pool.free()
            req.holds_row = False

    def _finished_checkpoint(self, req: Req) -> tuple[int, Snapshot | None]:
        f = self.engine.faults
        if not self.strategy.has_buffer:
            short = f.active("stop_finish_key_short") and (req.finish_reason or {}).get("type") == "stop" and req.output_ids
            return req.state.seq_len - bool(short), Snapshot(req.working_slot, req.state, req.last_row)
        if req.last_track_seqlen is None or req.last_track_idx not in req.track:
            return 0, None
        older = 1 - req.last_track_idx
        if f.active("older_pingpong_inserted") and not self.lazy and older in req.track:
            return req.last_track_seqlen, req.track[older]
        return req.last_track_seqlen, req.track[req.last_track_idx]

    def _free_finished_slots(self, req: Req, donated: int | None) -> None:
        f = self.engine.faults
        working = [] if req.working_slot == donated else [req.working_slot]
        pingpong = [s for s in req.pingpong_slots() if s != donated]
        if f.active("pingpong_leak_on_finish"):
            pingpong = []
        if f.active("double_free"):
            working = working + (working or [donated])
        if f.active("idle_check_disabled_with_leak"):
            if working:
                working = []
            else:  # the working slot went to the tree: the forked copy's slot leaks
                self.engine.mamba_pool.alloc(1)
        self.engine.mamba_pool.free(working + pingpong)
        req.working_slot, req.pingpong, req.track = None, [None, None], {}
