"""Pool driver for SGLang's ``req.kv`` lifecycle (the request's cache state in ``ReqKvInfo``).

``KvPoolDriver(key, sizes)`` builds ``HybridReqToTokenPool`` (mamba slots from
``MambaSlotAllocator``), ``HybridLinearKVPool`` with SGLang's token allocator and
``UnifiedRadixCache(FULL, MAMBA)`` for one :class:`~conformance.sglang_api.pool_runtime.PoolKey`
and drives requests through SGLang's own lifecycle functions with no model:

* ``admit``: ``Req.init_next_round_input`` (match + copy-on-write slot), lock,
  ``alloc_req_slots``; a refused admission goes through ``release_kv_cache``'s no-row path
  like the scheduler's waiting-queue abort.
* ``prefill_chunk``: SGLang's KV allocators (evict on demand),
  ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``,
  ``_collect_deferred_mamba_cow_and_clear``, then ``checkpoint_kv_cache``.
* ``decode``: KV allocators, ``mamba_lazy_prealloc_at_boundary``,
  ``set_mamba_track_indices_from_reqs``, ``SchedulerBatchResultProcessor.
  _mamba_prefix_cache_update``; the four lines of ``_handle_finish_state_updated_req``
  that name the tracked slot before that call are mirrored here.  With ``lookahead=True``
  a finishing request first runs one more decode forward whose token is dropped, as
  overlap's one-step lookahead does at finish (``finish(run, lookahead=True)``).
* ``finish`` / ``abort``: ``release_kv_cache(checkpoint=...)``; ``flush`` as the scheduler's
  ``flush_cache``; ``evict`` through ``UnifiedRadixCache.evict``.

Where the model would compute a state, the driver writes a state marker
(``conformance.sglang_api.state_marker``) into the slot SGLang's own index mapping
names, after checking that the slot holds the marker of the prefix it claims
(``StateMismatch`` otherwise).  Every eviction (explicit or inside an SGLang allocation)
is counted via an instance wrapper on the tree's single eviction funnel ``_evict``.
Written against 0.5.23; the probe admits it where ``ReqKvInfo``, ``checkpoint_kv_cache``
and ``unified_cache.components`` exist (0.5.22 measured); ``_gather_mamba_track_indices``
is used where present, else the ping-pong mapping is indexed directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from array import array
from types import SimpleNamespace
from typing import Iterator, Sequence

import torch

from conformance.sglang_api import state_marker
from conformance.sglang_api.pool_base import PoolDriverBase, cpu_pin_memory_guard, record_slots
from conformance.sglang_api.pool_driver import (
    FULL_LAYERS,
    MAMBA_LAYERS,
    NotApplicable,
    PoolExhausted,
    PoolSizes,
    Running,
)
from conformance.sglang_api.pool_runtime import PoolKey, publish_for

DRIVER_NAME = "kv"


def import_symbols(features) -> SimpleNamespace:
    """Every SGLang symbol this driver touches (raises ImportError/AttributeError if one is gone)."""
    import sglang
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.environ import envs
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.schedule_batch import (
        FINISH_ABORT,
        FINISH_LENGTH,
        Req,
        ScheduleBatch,
        set_mamba_track_indices_from_reqs,
    )
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
    from sglang.srt.mem_cache import allocation as mem_allocation
    from sglang.srt.mem_cache import common as mem_cache_common
    from sglang.srt.mem_cache.allocation import alloc_req_slots
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import (
        get_exec,
        mamba_cache_chunk_size,
        mamba_checkpoint_grid,
        mamba_track_grid,
        override_platform,
        publish,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.session import streaming_session

    StreamingSession = getattr(streaming_session, "StreamingSession", None)  # noqa: N806  (the tree's session slots)
    gather = getattr(schedule_batch, "_gather_mamba_track_indices", None) or _index_track_mapping
    names = dict(locals())
    for drop in ("features", "schedule_batch", "gather", "streaming_session"):
        names.pop(drop)
    return SimpleNamespace(**names, gather_mamba_track_indices=gather)


def _index_track_mapping(mapping, req_pool_indices, positions):
    """The ping-pong slot at ``positions`` of each request row (before the helper existed)."""
    return mapping[req_pool_indices, positions]


class KvPoolDriver(PoolDriverBase):
    """The pool driver for the ``req.kv`` lifecycle (see the module docstring)."""

    oracle_exact = True
    sglang_checker = True

    def __init__(self, key: PoolKey, sizes: PoolSizes = PoolSizes(), *, api: SimpleNamespace):
        self.api = api
        reason = self.gap(self.api, key)
        if reason:
            raise NotApplicable(reason)
        self.key, self.sizes = key, sizes
        self.server_args = publish_for(self.api, key)
        self.evictions = 0
        self.running: dict[str, Running] = {}
        self._next_token = 1_000
        self._build()

    # ------------------------------------------------------------ setup
    def activate(self) -> None:
        """Make this harness's ServerArgs the published global state again."""
        self.api.publish(self.server_args, role="test")

    @contextlib.contextmanager
    def _fault_env(self) -> Iterator[None]:
        if self.key.lazy_alloc_fail:
            with self.api.envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.override(True):
                yield
        else:
            yield

    def _build(self) -> None:
        api, key, sizes = self.api, self.key, self.sizes
        mamba = api.get_exec().mamba
        self.extra, self.lazy = mamba.enable_mamba_extra_buffer, mamba.enable_mamba_extra_buffer_lazy
        with api.envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
            shape = api.Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=4, conv_kernel=4
            )
            params = api.Mamba2CacheParams(shape=shape, layers=list(MAMBA_LAYERS))
        self.rtp = api.HybridReqToTokenPool(
            size=sizes.max_reqs, mamba_size=sizes.mamba_slots, mamba_spec_state_size=sizes.max_reqs,
            max_context_len=sizes.max_context_len, device="cpu", enable_memory_saver=False, cache_params=params,
            mamba_layer_ids=list(MAMBA_LAYERS), enable_mamba_extra_buffer=self.extra,
            enable_mamba_extra_buffer_lazy=self.lazy, enable_overlap_schedule=self.extra,
        )
        kv_pool = api.HybridLinearKVPool(
            size=sizes.kv_tokens, dtype=torch.bfloat16, page_size=key.page_size, head_num=1, head_dim=8,
            full_attention_layer_ids=list(FULL_LAYERS), device="cpu", enable_memory_saver=False,
            mamba_pool=self.rtp.mamba_pool,
        )
        if key.page_size == 1:
            self.alloc = api.TokenToKVPoolAllocator(
                size=sizes.kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
            )
        else:
            self.alloc = api.PagedTokenToKVPoolAllocator(
                size=sizes.kv_tokens, page_size=key.page_size, dtype=torch.bfloat16, device="cpu",
                kvcache=kv_pool, need_sort=False,
            )
        self.tree = api.UnifiedRadixCache(
            params=api.CacheInitParams(
                disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
                page_size=key.page_size, tree_components=(api.ComponentType.FULL, api.ComponentType.MAMBA),
                enable_mamba_extra_buffer=self.extra, enable_mamba_extra_buffer_lazy=self.lazy,
                tree_core_backend="python",
            )
        )
        real_evict = self.tree._evict

        def counting_evict(*args, **kwargs):
            result = real_evict(*args, **kwargs)
            if result.num_tokens_evicted or result.mamba_num_evicted:
                self.evictions += 1
            return result

        self.tree._evict = counting_evict
        self.chunk = api.mamba_cache_chunk_size()
        self.checkpoint_grid = api.mamba_checkpoint_grid(key.page_size)
        self.track_grid = api.mamba_track_grid(key.page_size)
        hf = SimpleNamespace(mamba_chunk_size=key.model_chunk) if key.family == "mamba2" else SimpleNamespace()
        self._model_config = SimpleNamespace(hf_text_config=hf, is_encoder_decoder=False)
        self._processor = self._make_processor()

    def _make_processor(self):
        cls = self.api.SchedulerBatchResultProcessor
        kw = {f.name: None for f in dataclasses.fields(cls)}
        kw.update(tree_cache=self.tree, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
                  is_generation=True, enable_overlap=False, enable_overlap_mlx=False)
        return cls(**kw)

    def _batch(self, reqs: Sequence[object], seq_lens: Sequence[int]) -> SimpleNamespace:
        """The fields of a ScheduleBatch that SGLang's mamba helpers read."""
        return SimpleNamespace(
            reqs=list(reqs), req_to_token_pool=self.rtp, tree_cache=self.tree, model_config=self._model_config,
            seq_lens_cpu=torch.tensor(list(seq_lens), dtype=torch.int64),
            req_pool_indices=torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64),
            spec_algorithm=SimpleNamespace(is_none=lambda: True), enable_overlap=False,
            mamba_track_buffer_indices=None, mamba_track_mask_cpu=None, mamba_decode_batch_idx_cpu=None,
        )

    # ------------------------------------------------------------ capability answers
    @classmethod
    def gap(cls, api, key: PoolKey, need: str | None = None) -> str | None:
        """None, or the one line saying why this release and driver cannot run ``key``
        (and ``need``: ``sessions``, ``lookahead``)."""
        reason = api.features.not_applicable(key.strategy)
        if reason:
            return reason
        if need == "sessions" and not hasattr(api.UnifiedRadixCache, "maybe_hand_to_session"):
            return f"sglang {api.features.version}: UnifiedRadixCache has no streaming-session slots (maybe_hand_to_session)"
        return None

    # ------------------------------------------------------------ views (driver contract)
    @staticmethod
    def state(req):
        """The object holding the request's cache fields: ``req.kv``."""
        return req.kv

    @staticmethod
    def live_state_len(run: Running) -> int:
        """How many tokens the state in the request's live slot covers (the hit's copy is
        deferred to the extend here, so a matched request not yet prefilled holds none)."""
        return run.req.kv.kv_committed_len

    def free_mamba_slots(self) -> list[int]:
        return [int(s) for s in self.rtp.mamba_allocator.free_slots.tolist()]

    def tree_mamba_slots(self) -> list[int]:
        return [int(s) for s in self.tree.all_mamba_values_flatten().tolist()]

    def mamba_available(self) -> int:
        return int(self.rtp.mamba_allocator.available_size())

    def request_slots(self, req) -> list[int]:
        return record_slots(req.kv)

    def session_records(self) -> dict:
        """Streaming-session records the tree holds (session id -> ReqKvInfo)."""
        return dict(self.tree.session_records()) if hasattr(self.tree, "session_records") else {}

    def tree_state_keys(self) -> dict[tuple[int, ...], int]:
        """Every state the tree holds: token key -> mamba slot."""
        mamba = self.api.ComponentType.MAMBA
        out: dict[tuple[int, ...], int] = {}
        stack = [(self.tree.root_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                key = child.key
                p = path + tuple(key.token_ids[: len(key)])
                value = child.component_data[mamba].value
                if value is not None:
                    out[p] = int(value.view(-1)[0])
                stack.append((child, p))
        return out

    # ------------------------------------------------------------ helpers
    def _mamba_slot(self, req) -> int:
        return int(self.rtp.req_index_to_mamba_index_mapping[req.kv.req_pool_idx])

    def _alloc_kv(self, req, start: int, end: int) -> None:
        row = req.kv.req_pool_idx
        allocation = self.api.mem_allocation
        if self.key.page_size == 1:
            loc = allocation.alloc_token_slots(self.tree, end - start)
        else:
            last = int(self.rtp.req_to_token[row, start - 1]) if start > 0 else -1
            t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
            if end - start == 1 and start > 0:
                loc = allocation.alloc_paged_token_slots_decode(self.tree, t(end), t(end), t(last))
            else:
                loc = allocation.alloc_paged_token_slots_extend(
                    self.tree, t(start), t(start), t(end), t(end), t(last), end - start
                )
        self.rtp.write((row, slice(start, end)), loc.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = end

    def _track_slot(self, entry, batch):
        """The ping-pong slot the extend tracks into: named by the entry where the release
        does (``track_index``), else gathered from its position in the request's row."""
        if hasattr(entry, "track_index"):
            return torch.tensor([int(entry.track_index)])
        mapping = self.rtp.req_index_to_mamba_ping_pong_track_buffer_mapping
        position = torch.tensor([entry.track_position], dtype=torch.int64)
        return self.api.gather_mamba_track_indices(mapping, batch.req_pool_indices, position)

    def _set_track_indices(self, batch) -> None:
        with cpu_pin_memory_guard():  # some releases pin the index tensor they build
            self.api.set_mamba_track_indices_from_reqs(batch)

    def _kv_room(self, tokens: int) -> bool:
        ps = self.key.page_size
        need = -(-tokens // ps) * ps + ps
        return self.alloc.available_size() + self.tree.full_evictable_size() >= need

    def _mamba_room(self, slots: int) -> bool:
        return self.rtp.mamba_allocator.available_size() + self.tree.mamba_evictable_size() >= slots

    def reuse(self, req, prompt: Sequence[int]) -> None:
        """Make a finished ``Req`` the next turn's: new input, no output, not finished."""
        req.origin_input_ids = array("q", list(prompt))
        del req.output_ids[:]
        req.finished_reason = None

    # ------------------------------------------------------------ lifecycle
    def make_req(self, rid: str, prompt: Sequence[int], max_new_tokens: int = 4096):
        return self.api.Req(
            rid=rid, origin_input_text="", origin_input_ids=array("q", list(prompt)),
            sampling_params=self.api.SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
        )

    def open_session(self, session_id: str):
        """A streaming session as the scheduler's session controller presents it to a Req."""
        log: list[str] = []
        return SimpleNamespace(
            session_id=session_id, streaming=True, log=log,
            abort_req=lambda: log.append("abort"), finish_req=lambda req: log.append(f"finish {req.rid}"),
        )

    def close_session(self, session) -> None:
        """The session controller's close: the tree releases the session's record."""
        self.tree.release_session(session.session_id)

    def admit(self, rid: str, prompt: Sequence[int], *, chunked_prefill_size: int | None = None, session=None) -> Running:
        """Match, COW, lock and allocate a new request; raise PoolExhausted if refused.
        With ``session`` the request is a streaming turn: it borrows the session's record
        when the session holds one (SGLang's ``StreamingSession.try_match_prefix``)."""
        if rid in self.running:
            raise ValueError(f"request {rid} already running")
        if not prompt:
            raise ValueError(f"request {rid} has an empty prompt")
        tracking = self.rtp.mamba_initial_tracking_slots if self.extra else 0
        if self.rtp.available_size() < 1 or not self._mamba_room(1 + tracking + 1):
            raise PoolExhausted("no request row or mamba slot")
        req = self.make_req(rid, prompt)
        req.session = session
        req.init_next_round_input(self.tree)
        return self.adopt(rid, req, prompt, chunked_prefill_size=chunked_prefill_size)

    def adopt(self, rid: str, req, prompt: Sequence[int], *, chunked_prefill_size: int | None = None) -> Running:
        """Lock and allocate a request whose ``init_next_round_input`` already ran (a new
        request, or a reused ``Req`` object as streaming sessions do)."""
        tracking = self.rtp.mamba_initial_tracking_slots if self.extra else 0
        matched = req.prefix_len
        req.lock = self.tree.lock(req.last_node)
        first = self._chunk_end(matched, len(prompt), chunked_prefill_size) - matched
        if self.rtp.available_size() < 1 or not self._mamba_room(tracking + 1) or not self._kv_room(first):
            self.tree.unlock(req.lock)
            req.lock = None
            self.api.release_kv_cache(req, self.tree, checkpoint=False)
            raise PoolExhausted("admission refused after match")
        if not req.kv.holds_kv:  # a borrowed session record already has its row and prefix
            self.api.alloc_req_slots(self.rtp, [req], self.tree)
            prefix = self.tree.prefix_device_indices(req)
            if len(prefix):
                self.rtp.write((req.kv.req_pool_idx, slice(0, len(prefix))), prefix.to(torch.int32))
        run = Running(rid, req, tuple(prompt), matched, chunked_prefill_size)
        self.running[rid] = run
        return run

    def _chunk_end(self, start: int, prompt_len: int, chunked_prefill_size: int | None) -> int:
        """Where the PrefillAdder cuts the next chunk (page-aligned)."""
        if not chunked_prefill_size or prompt_len - start <= chunked_prefill_size:
            return prompt_len
        ps = self.key.page_size
        return (start + max(chunked_prefill_size // ps * ps, ps)) // ps * ps

    def prefill_chunk(self, run: Running) -> int | None:
        """Run the next prefill chunk; returns the length the tree stored (None if nothing)."""
        req, prompt = run.req, run.prompt
        start = req.prefix_len
        end = self._chunk_end(start, len(prompt), run.chunked_prefill_size)
        if not self._kv_room(end - start) or not self._mamba_room(1):
            # the checkpoint after the chunk copies (no_buffer) or donates-and-refills a slot
            raise PoolExhausted("no KV or mamba room for the prefill chunk")
        req.extend_end = end
        self._alloc_kv(req, start, end)
        if hasattr(self.tree, "maybe_hand_to_session"):
            self.tree.maybe_hand_to_session(req)  # as alloc_for_extend: a streaming turn's first row goes to its session
        batch = self._batch([req], [end])
        entry = None
        if self.extra:
            entry = self.api.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(batch, req)
        self.api.ScheduleBatch._collect_deferred_mamba_cow_and_clear(batch, [req])
        pool = self.rtp.mamba_pool
        if batch.mamba_cow_src_indices is not None:
            pool.copy_from(batch.mamba_cow_src_indices, batch.mamba_cow_dst_indices)
        if batch.mamba_clear_indices is not None:
            pool.clear_slots(batch.mamba_clear_indices)
        slot = self._mamba_slot(req)
        self._expect_state(slot, prompt[:start], f"{run.rid} prefill [{start}:{end}) start state")
        state_marker.write(pool, slot, state_marker.marker_for(prompt[:end]))
        tracked = None
        if entry is not None and entry.track_mask:
            tracked = req.kv.mamba_last_track_seqlen  # what SGLang records; the kernel snapshots at the entry's track_seqlen
            track_slot = self._track_slot(entry, batch)
            snap = state_marker.snapshot_marker(prompt, entry.track_seqlen, prefix_len=start, extend_end=end, state_chunk=self.key.model_chunk)
            state_marker.write(pool, int(track_slot[0]), snap)
        if end == len(prompt):
            run.prefill_done = True
            req.output_ids.append(self.fresh_token())
        self.api.checkpoint_kv_cache(req, self.tree)
        stored = end if not self.extra else tracked
        if stored is not None:
            run.stored.append(stored)
        return stored

    def _forward(self, run: Running, what: str):
        """One decode forward of ``run``: its KV, the ping-pong track index (extra-buffer
        strategies; the lazy boundary allocation first), the state it computes (and tracks
        at a boundary).  Returns (batch, at_boundary)."""
        api, req = self.api, run.req
        if not self._kv_room(1):
            raise PoolExhausted(f"no KV room for a {what} token")
        seq_len = req.kv.kv_committed_len + 1
        self._alloc_kv(req, seq_len - 1, seq_len)
        req.decode_batch_idx += 1
        batch = self._batch([req], [seq_len])
        at_boundary = False
        if self.extra:
            interval = api.mamba_track_grid(self.key.page_size)
            with self._fault_env():
                if self.lazy:
                    api.ScheduleBatch.mamba_lazy_prealloc_at_boundary(batch, interval)
            self._set_track_indices(batch)
            at_boundary = seq_len % interval == 0
            batch.mamba_track_mask_cpu = [at_boundary]
            batch.mamba_decode_batch_idx_cpu = [req.decode_batch_idx]
        seq = run.tokens
        slot = self._mamba_slot(req)
        self._expect_state(slot, seq[: seq_len - 1], f"{run.rid} {what} to {seq_len} start state")
        state_marker.write(self.rtp.mamba_pool, slot, state_marker.marker_for(seq[:seq_len]))
        if at_boundary:
            state_marker.write(self.rtp.mamba_pool, int(batch.mamba_track_indices[0]), state_marker.marker_for(seq[:seq_len]))
        return batch, at_boundary

    def decode(self, run: Running, token: int | None = None) -> bool:
        """One synchronous decode step; returns whether it was a track boundary."""
        req = run.req
        if not run.prefill_done:
            raise ValueError(f"{run.rid} is still in prefill")
        batch, at_boundary = self._forward(run, "decode")
        req.output_ids.append(token if token is not None else self.fresh_token())
        if self.extra:
            if at_boundary and not self.lazy:  # mirrors _handle_finish_state_updated_req
                req.kv.mamba_last_track_idx = batch.mamba_track_buffer_indices[0]
                req.kv.mamba_prev_track_seqlen = req.kv.mamba_last_track_seqlen
                req.kv.mamba_last_track_seqlen = req.kv.kv_committed_len
            if at_boundary:
                self._processor._mamba_prefix_cache_update(req, batch, None, 0, known_boundary=not self.lazy)
        return at_boundary

    def _lookahead_forward(self, run: Running) -> None:
        """Overlap's one-step lookahead at finish: the next decode forward of a request that
        is about to finish was already launched (KV allocated, state advanced, tracked into
        the next ping-pong slot at a boundary); its token is dropped and its result never
        processed."""
        self._forward(run, "lookahead")
        run.req.finished_len = len(run.req.output_ids)

    def finish(self, run: Running, *, abort: bool = False, lookahead: bool = False) -> None:
        """Finish (or abort: one more decode forward, then the same release) a request;
        ``lookahead``: overlap's extra forward was launched before the finish was seen."""
        api, req = self.api, run.req
        if abort and run.prefill_done and self._kv_room(1):
            self.decode(run)
        if lookahead and run.prefill_done and not abort:
            self._lookahead_forward(run)
        if abort:
            req.finished_reason = api.FINISH_ABORT()
        else:
            req.finished_reason = api.FINISH_LENGTH(length=len(req.output_ids))
        checkpoint = req.mamba_lazy_checkpoint if self.lazy else True
        if not run.prefill_done:
            checkpoint = False  # an aborted chunked prefill is released without insert
        api.release_kv_cache(req, self.tree, checkpoint=checkpoint)
        del self.running[run.rid]



DRIVER = KvPoolDriver
