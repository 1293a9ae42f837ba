"""The reference engine: the kit's OWN scheduler over tiny CPU models (not SGLang code).

It implements SGLang 0.5.23's Mamba radix-cache semantics: a request matches the deepest
cached state snapshot (floored to the checkpoint grid), copies it into its own slot, and
snapshots its state where SGLang would: chunk-aligned in prefill (extra_buffer*), at
multiples of ``lcm(chunk, page, track_interval)`` in decode, and at finish (no_buffer: the
full sequence).  Slot accounting per strategy (``no_buffer``: 1 working slot;
``extra_buffer``: +2 ping-pong; ``extra_buffer_lazy``: +1, a second only across a track
boundary) lives in :mod:`conformance.reference.slots`.  Continuous batching: each
:meth:`Engine.step` admits waiting requests (a prefill batch) and decodes one token for every
running request.  Seeded faults are hooks asking :class:`FaultSwitch` (``faults.py``).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import torch

from conformance.errors import KitError
from conformance.matrix.grid import Grid
from conformance.reference.faults import FaultSwitch
from conformance.reference.pools import MambaSlotPool, PoolCheck, RequestPool, TokenPool, check_pool, leak_message
from conformance.reference.radix import RadixCache, Snapshot
from conformance.reference.request import Req, check_finish, sample, top_entries
from conformance.reference.sessions import SessionStore
from conformance.reference.slots import SlotKeeper
from conformance.matrix.strategy import BASELINE, NAMES, strategy_named

log = logging.getLogger("sglang.srt.managers.scheduler")
STRATEGIES = NAMES
MAX_PREFILL_BATCH = 8
# SGLang 0.5.23 (kv_cache_configurator.resolve_max_num_reqs) caps the running requests by the
# Mamba pool: max_mamba_cache_size // (3 + the strategy's tracking slots), 1 slot per request
# with the radix cache off.  The 3 leave room for the slot a checkpoint takes in the track
# slot's place and for cached states; without the cap a big burst finds no slot for its
# checkpoints, which SGLang never lets happen.
MAMBA_BASE_SLOTS_PER_REQUEST = 3


@dataclass(frozen=True)
class EngineConfig:
    strategy: str = BASELINE
    page_size: int = 1
    track_interval: int = 256
    max_mamba_slots: int = 64
    max_running_requests: int = 32
    kv_tokens: int = 65536
    disable_radix_cache: bool = False
    # False: no Mamba cap on the running requests, so a burst can outgrow the pool and reach
    # the scheduler's failure paths (a failed allocation after a prefix match, eviction of a
    # node a running request holds) that the cap keeps SGLang from -- the seeded faults there.
    mamba_running_cap: bool = True


def validate_config(cfg: EngineConfig, model_chunk: int) -> None:
    """The combinations SGLang refuses, as one-line KitErrors."""
    strategy = strategy_named(cfg.strategy)
    for name in ("page_size", "track_interval", "max_mamba_slots", "max_running_requests", "kv_tokens"):
        if getattr(cfg, name) < 1:
            raise KitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    refusal = (
        strategy.refuses_page_size(cfg.page_size)
        or strategy.refuses_track_interval(cfg.track_interval, cfg.page_size)
        or Grid.refuses(model_chunk, cfg.page_size)
    )
    if refusal:
        raise KitError(refusal)


class Engine:
    """Scheduler + pools + radix cache around one model.  Not thread-safe by itself: the
    server serialises calls with :attr:`lock`."""

    def __init__(self, model, cfg: EngineConfig, faults: FaultSwitch | None = None) -> None:
        validate_config(cfg, model.mamba_chunk_size)
        self.model, self.cfg = model, cfg
        self.faults = faults or FaultSwitch()
        self.strategy = strategy_named(cfg.strategy)
        self.grid = Grid.resolve(model.mamba_chunk_size, cfg.page_size, cfg.track_interval)
        self.chunk, self.checkpoint_grid, self.track_grid = self.grid.chunk, self.grid.checkpoint_grid, self.grid.track_grid
        self.mamba_pool = MambaSlotPool(cfg.max_mamba_slots)
        self.kv_pool = TokenPool(cfg.kv_tokens)
        self.req_pool = RequestPool(min(cfg.max_running_requests, self.running_cap()))
        self.cache = RadixCache(lambda s: self.mamba_pool.free([s]), self.kv_pool.free)
        self.cache.stale_evict_locked = self.faults.active("evict_running_slot")
        self.cache.split_moves_snapshot = self.faults.active("split_moves_snapshot")
        self.slots = SlotKeeper(self)
        self.sessions = SessionStore()
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.lock = threading.RLock()
        self.dead: str | None = None
        self.counters = collections.Counter()
        self._was_busy = False

    def running_cap(self) -> int:
        """Running requests the Mamba pool admits (:data:`MAMBA_BASE_SLOTS_PER_REQUEST`)."""
        per_request = 1 if self.cfg.disable_radix_cache else MAMBA_BASE_SLOTS_PER_REQUEST + self.strategy.ping_pong_slots
        return max(1, self.cfg.max_mamba_slots // per_request) if self.cfg.mamba_running_cap else self.cfg.max_running_requests

    # ------------------------------------------------------------ public API
    def submit(self, req: Req) -> None:
        if self.dead:
            raise KitError(f"scheduler is dead: {self.dead}")
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Abort request ``rid`` (queued or running); it finishes with reason "abort", like SGLang's."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "Abort before prefill"}, error=False)
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._abort_release(req)
                return True
        return False

    def abort_all(self) -> int:
        """Abort every queued and running request (SGLang's ``abort_all``); how many."""
        rids = [r.rid for r in [*self.waiting, *self.running]]
        return sum(self.abort(rid) for rid in rids)

    def request_idle_check(self) -> None:
        """Run the idle leak check at the next idle step (after a session close, say)."""
        self._was_busy = True

    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def step(self) -> bool:
        """One scheduling round; False when there was nothing to do."""
        self.sessions.expire(self)
        if self.is_idle():
            if self._was_busy:
                self._was_busy = False
                self.idle_check()
            return False
        self._was_busy = True
        decoding = list(self.running)
        batch = self._admit()
        if batch:
            self._prefill_batch(batch)
            self._log_batch("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d" % (
                len(batch), sum(len(r.input_ids) - r.prefix_len for r in batch), sum(r.prefix_len for r in batch)))
        for req in decoding:
            self._decode(req)
        if decoding:
            self.counters["decode_steps"] += 1
            if self.counters["decode_steps"] % 40 == 0:
                self._log_batch("Decode batch. #running-req: %d, #token: %d" % (
                    len(decoding), sum(r.state.seq_len for r in decoding)))
        for req in [r for r in self.running if r.finish_reason]:
            self.running.remove(req)
            self.slots.release(req, insert=True)
            self._done(req)
        return True

    def flush(self) -> bool:
        """SGLang's ``Scheduler.flush_cache``: refused unless idle; then the tree is reset and
        the pools' free lists are rebuilt from scratch (``HybridReqToTokenPool.clear``,
        ``MambaSlotAllocator.clear``, the KV allocator's ``clear``).  A slot leaked before
        the flush is therefore free after it, exactly as on SGLang: a leak must be read
        before any flush."""
        if not self.is_idle():
            return False
        self.cache.reset()
        self.mamba_pool.clear()
        self.kv_pool.clear()
        return True

    # ------------------------------------------------------------ admission
    def _admit(self) -> list[Req]:
        batch: list[Req] = []
        while self.waiting and len(batch) < MAX_PREFILL_BATCH:
            req = self.waiting[0]
            admitted = self._try_admit(req)
            if admitted is None:  # can never fit
                self.waiting.popleft()
                self._finish(req, {"type": "abort", "message": "request does not fit the memory pools"})
                continue
            if not admitted:
                break
            self.waiting.popleft()
            batch.append(req)
            self.running.append(req)
            self.slots.update_peak()
        return batch

    def _try_admit(self, req: Req) -> bool | None:
        """True when admitted, False to retry later, None when it can never fit."""
        if self.sessions.continues(req):
            return self.sessions.resume(self, req)
        need_slots = self.slots.slots_per_request()
        need_kv = len(req.input_ids) + req.sampling.max_new_tokens
        if need_slots > self.mamba_pool.size or need_kv > self.kv_pool.size:
            return None
        if not self.req_pool.available():
            return False
        match = None
        if not self.cfg.disable_radix_cache:
            limit = len(req.input_ids) - 1 if self.faults.active("logprob_start_ignored") else req.max_prefix_len()
            match = self.cache.match(req.input_ids, limit)
            self.cache.lock(match.node)
        prefix = match.hit_len if match else 0
        if not self.slots.alloc_for(req, need_slots, matched=prefix > 0):
            if match:
                self.cache.unlock(match.node)
            return None if not self.running else False
        need_kv -= prefix
        if not self.kv_pool.alloc(need_kv):
            self.cache.evict_tokens(need_kv - self.kv_pool.available())
            if not self.kv_pool.alloc(need_kv):
                self.slots.free_request_slots(req)
                if match:
                    self.cache.unlock(match.node)
                return None if not self.running else False
        self.req_pool.alloc()
        req.holds_row = True
        req.kv_reserved = need_kv
        if match:
            req.lock_node, req.prefix_len, req.kv_hit_len = match.node, prefix, match.kv_hit_len
            aligned = match.kv_hit_len // self.checkpoint_grid * self.checkpoint_grid
            req.branching_seqlen = aligned if aligned > prefix else None
        req.state = self._cow_from_cache(match.node.snapshot if match and prefix else None)
        req.last_row = match.node.snapshot.last_row if match and prefix else None
        req.reported_cached_tokens = self._reported_cached_tokens(req)
        self.counters["cache_hit_tokens"] += req.prefix_len
        self.counters["prompt_tokens"] += len(req.input_ids)
        return True

    def _cow_from_cache(self, snapshot: Snapshot | None):
        """Copy-on-write of the matched state into the request (hook: cow faults)."""
        if snapshot is None:
            return self.model.empty_state()
        state = snapshot.state.clone()
        if self.faults.active("cow_skipped_zero_state"):
            state = state.zero_recurrent()
        if self.faults.active("state_scaled_1pct"):
            state = state.scale_recurrent(state.recurrent_layers()[0], 0.99)
        return state

    def _reported_cached_tokens(self, req: Req) -> int:
        """meta_info.cached_tokens (hook: cached_tokens_* faults)."""
        if self.faults.active("cached_tokens_overreport"):
            return max(req.kv_hit_len, req.prefix_len + 1) if req.kv_hit_len else 0
        if self.faults.active("cached_tokens_underreport"):
            return 0
        return req.prefix_len

    # ------------------------------------------------------------ forwards
    def _prefill_batch(self, batch: list[Req]) -> None:
        for req in batch:
            self._prefill(req)
        if self.faults.active("mamba2_index_misalignment"):
            tracked = [r for r in batch if r.last_track_idx is not None and r.last_track_idx in r.track]
            for prev, req in zip(tracked, tracked[1:]):
                snap = req.track[req.last_track_idx]
                snap.state = snap.state.with_recurrent_from(prev.track[prev.last_track_idx].state)
        for req in batch:
            self.slots.checkpoint_after_prefill(req)
            check_finish(req, self.model.eos_token_id, self.model.tokenizer.decode)

    def _snapshot_at(self, track_at: int, total: int) -> int:
        """Where the recurrent state keyed at ``track_at`` is really taken (hook:
        track_boundary_*); the KV always stays that of ``track_at``."""
        if self.faults.active("track_boundary_early"):
            return track_at - 1
        if self.faults.active("track_boundary_late") and track_at < total:
            return track_at + 1
        return track_at

    def _prefill(self, req: Req) -> None:
        total, p = len(req.input_ids), req.prefix_len
        track_at = None if self.cfg.disable_radix_cache else self.slots.prefill_track_position(req)
        snap_pos = None if track_at is None else max(self._snapshot_at(track_at, total), p)
        cuts = sorted({p, total} | ({track_at, snap_pos} if track_at is not None else set()))
        # Rows (next-token log-probs) only where needed: every position from the first input
        # logprob on, else just each segment's last (snapshots, the first output token).
        need = min(max(req.start - 1, p), total - 1) if req.return_logprob else total - 1
        kept, state = [], req.state
        at = {p: (req.state, req.last_row)}
        for a, b in zip(cuts, cuts[1:]):
            first = min(max(a, need), b - 1)
            seg_rows, state = self.model.extend(state, req.input_ids[a:b], keep=b - first)
            kept.append((first, seg_rows))
            at[b] = (state, seg_rows[-1])
        all_rows = torch.cat([r for first, r in kept if first >= need])  # positions need .. total-1
        if track_at is not None:
            snap_state, snap_row = at[track_at]
            snap_state = snap_state.clone() if snap_pos == track_at else snap_state.with_recurrent_from(at[snap_pos][0])
            self.slots.track(req, track_at, snap_state, snap_row)
        self._record_input_logprobs(req, all_rows, need)
        req.state, req.last_row = state, all_rows[-1]
        self.counters["prefill_tokens"] += total - p
        if req.sampling.max_new_tokens > 0:
            self._emit(req, all_rows[-1])

    def _record_input_logprobs(self, req: Req, rows: torch.Tensor, base: int) -> None:
        """Input logprob entries from ``rows`` (row k: after input token ``base + k``)."""
        if not req.return_logprob:
            return
        p = req.prefix_len
        for i in range(req.start, len(req.input_ids)):
            tok = req.input_ids[i]
            if i == 0:
                req.input_entries.append((None, tok))
                req.input_top.append(None)
                continue
            row = rows[i - 1 - base] if i - 1 >= p else req.last_row
            req.input_entries.append((float(row[tok]), tok))
            req.input_top.append(top_entries(row, req.top_logprobs_num))

    def _decode(self, req: Req) -> None:
        if req.finish_reason or req not in self.running:
            return
        pos_after = req.state.seq_len + 1
        at_boundary = self.slots.tracks_decode() and pos_after % self.track_grid == 0
        if at_boundary:
            self.slots.before_boundary(req)
        before = req.state
        rows, req.state = self.model.extend(req.state, [req.output_ids[-1]])
        if at_boundary:
            early = self.faults.active("track_boundary_early")
            tracked = req.state.with_recurrent_from(before) if early else req.state.clone()
            self.slots.after_boundary(req, pos_after, tracked, rows[-1], before)
        self.counters["decode_tokens"] += 1
        self._emit(req, rows[-1])
        check_finish(req, self.model.eos_token_id, self.model.tokenizer.decode)

    def _emit(self, req: Req, row: torch.Tensor) -> None:
        tok = sample(row, req.sampling, req.rid, len(req.output_ids))
        req.output_ids.append(tok)
        req.output_rows.append(row)
        req.last_row = row
        if req.on_token is not None:
            req.on_token(req)

    # ------------------------------------------------------------ finishing
    def _abort_release(self, req: Req) -> None:
        """An admitted request aborted mid-flight (hook: abort_path_leak)."""
        req.finish_reason = {"type": "abort", "message": "aborted"}
        if not self.faults.active("abort_path_leak"):
            self.slots.release(req, insert=False)
        self._done(req)

    def _finish(self, req: Req, reason: dict, error: bool = True) -> None:
        """Finish a request that never got resources (aborted in the queue, or too big: an error)."""
        req.finish_reason = reason
        req.error = reason.get("message") if error else None
        self._done(req)

    def _done(self, req: Req) -> None:
        self.sessions.forget_in_flight(req, self.faults)
        self.counters["generation_tokens"] += len(req.output_ids)
        self.counters["requests_finished"] += 1
        if req.on_done is not None:
            req.on_done(req)

    def _log_batch(self, head: str) -> None:
        if log.isEnabledFor(logging.INFO):
            kv = 1 - self.kv_pool.available() / self.kv_pool.size
            mamba = 1 - self.mamba_pool.available() / self.mamba_pool.size
            log.info("%s, token usage: %.2f, mamba usage: %.2f, #running-req: %d, #queue-req: %d",
                     head, kv, mamba, len(self.running), len(self.waiting))

    # ------------------------------------------------------------ accounting
    def pool_checks(self) -> list[PoolCheck]:
        m_ev, m_pr = self.cache.mamba_counts()
        k_ev, k_pr = self.cache.kv_counts()
        sess = self.sessions.held()
        return [
            check_pool("mamba", total=self.mamba_pool.size, available=self.mamba_pool.available(),
                       evictable=m_ev, protected=m_pr, session_held=sum(r.held_slots() for r in sess),
                       uncached=sum(r.held_slots() for r in self.running)),
            check_pool("full", total=self.kv_pool.size, available=self.kv_pool.available(),
                       evictable=k_ev, protected=k_pr, session_held=sum(r.kv_reserved for r in sess),
                       uncached=sum(r.kv_reserved for r in self.running)),
            check_pool("req_to_token", total=self.req_pool.size, available=self.req_pool.available(),
                       evictable=0, protected=0, session_held=sum(r.holds_row for r in sess),
                       uncached=sum(r.holds_row for r in self.running)),
        ]

    def idle_check(self) -> str | None:
        """SGLang's idle invariant; a leak is logged and (strict mode) kills the scheduler."""
        if self.faults.active("idle_check_disabled_with_leak"):
            return None
        checks = self.pool_checks()
        msg = leak_message(checks)
        if msg is None and self.mamba_pool.has_duplicates():
            msg = "pool memory leak detected! mamba double free: " + checks[0].message
        if msg:
            log.error(msg)
            self.dead = msg
        return msg

    def stats(self) -> dict[str, float]:
        mamba, kv, rows = self.pool_checks()
        m_used = mamba.total - mamba.available - mamba.evictable
        return {
            "mamba_total": mamba.total, "mamba_available": mamba.available, "mamba_evictable": mamba.evictable,
            "mamba_protected": mamba.protected, "mamba_used": m_used, "mamba_usage": m_used / mamba.total,
            "mamba_session_held": mamba.session_held, "kv_protected": kv.protected, "kv_session_held": kv.session_held,
            "kv_total": kv.total, "kv_available": kv.available, "kv_evictable": kv.evictable,
            "kv_used": kv.total - kv.available - kv.evictable,
            "num_running_reqs": len(self.running), "num_queue_reqs": len(self.waiting),
            "pingpong_resident": self.slots.pingpong_resident(), "pingpong_peak": self.slots.peak,
            "session_count": len(self.sessions.sessions), "evictions": self.cache.evictions,
            **{f"counter_{k}": v for k, v in self.counters.items()},
        }
