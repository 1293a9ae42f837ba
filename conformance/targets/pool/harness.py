"""Synchronous driver over SGLang 0.5.23's REAL Mamba memory management, on CPU.

``PoolHarness(key, sizes)`` builds ``HybridReqToTokenPool`` (mamba slots from
``MambaSlotAllocator``), ``HybridLinearKVPool`` with SGLang's token allocator and
``UnifiedRadixCache(FULL, MAMBA)`` for one :class:`~conformance.targets.pool.runtime.PoolKey`
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
  that name the tracked slot before that call are mirrored here (lookahead 0: the
  harness is synchronous, so overlap's one-step lookahead is not exercised).
* ``finish`` / ``abort``: ``release_kv_cache(checkpoint=...)``; ``flush`` as the scheduler's
  ``flush_cache``; ``evict`` through ``UnifiedRadixCache.evict``.

Where the model would compute a state, the harness writes a state marker
(``state_marker``) into the slot SGLang's own index mapping names, after checking that the
slot holds the marker of the prefix it claims (``StateMismatch`` otherwise).  Every
eviction (explicit or inside an SGLang allocation) is counted via an instance wrapper on
the tree's single eviction funnel ``_evict``.
"""

from __future__ import annotations

import contextlib
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterator, Sequence

import torch

from conformance.targets.pool import sglang_api, state_marker
from conformance.targets.pool.runtime import PoolKey, publish_for

MAMBA_LAYERS = (0, 1, 2)
FULL_LAYERS = (3,)


class StateMismatch(AssertionError):
    """A slot did not hold the state the request's bookkeeping says it holds."""


class PoolExhausted(Exception):
    """The pools cannot take this operation now (the scheduler would not schedule it)."""


@dataclass(frozen=True)
class PoolSizes:
    mamba_slots: int = 12
    max_reqs: int = 3
    kv_tokens: int = 2048
    max_context_len: int = 2048


@dataclass
class Running:
    """A request the harness drives: the real ``Req`` plus what the kit knows of it."""

    rid: str
    req: object
    prompt: tuple[int, ...]
    matched: int
    chunked_prefill_size: int | None
    prefill_done: bool = False
    stored: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return list(self.req.origin_input_ids) + list(self.req.output_ids)


class PoolHarness:
    def __init__(self, key: PoolKey, sizes: PoolSizes = PoolSizes()):
        self.api = sglang_api.load()
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
        import dataclasses

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

    # ------------------------------------------------------------ helpers
    def _mamba_slot(self, req) -> int:
        return int(self.rtp.req_index_to_mamba_index_mapping[req.kv.req_pool_idx])

    def _expect_state(self, slot: int, tokens: Sequence[int], where: str) -> None:
        want, got = state_marker.marker_for(tokens), state_marker.read(self.rtp.mamba_pool, slot)
        if got != want:
            raise StateMismatch(f"{where}: mamba slot {slot} holds {got}, expected {want}")

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

    def _kv_room(self, tokens: int) -> bool:
        ps = self.key.page_size
        need = -(-tokens // ps) * ps + ps
        return self.alloc.available_size() + self.tree.full_evictable_size() >= need

    def _mamba_room(self, slots: int) -> bool:
        return self.rtp.mamba_allocator.available_size() + self.tree.mamba_evictable_size() >= slots

    def fresh_token(self) -> int:
        self._next_token += 1
        return self._next_token

    # ------------------------------------------------------------ lifecycle
    def make_req(self, rid: str, prompt: Sequence[int], max_new_tokens: int = 4096):
        return self.api.Req(
            rid=rid, origin_input_text="", origin_input_ids=array("q", list(prompt)),
            sampling_params=self.api.SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
        )

    def admit(self, rid: str, prompt: Sequence[int], *, chunked_prefill_size: int | None = None) -> Running:
        """Match, COW, lock and allocate a new request; raise PoolExhausted if refused."""
        if rid in self.running:
            raise ValueError(f"request {rid} already running")
        if not prompt:
            raise ValueError(f"request {rid} has an empty prompt")
        tracking = self.rtp.mamba_initial_tracking_slots if self.extra else 0
        if self.rtp.available_size() < 1 or not self._mamba_room(1 + tracking + 1):
            raise PoolExhausted("no request row or mamba slot")
        req = self.make_req(rid, prompt)
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
            mapping = self.rtp.req_index_to_mamba_ping_pong_track_buffer_mapping
            track_slot = self.api._gather_mamba_track_indices(
                mapping, batch.req_pool_indices, torch.tensor([entry.track_position], dtype=torch.int64)
            )
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

    def decode(self, run: Running, token: int | None = None) -> bool:
        """One synchronous decode step; returns whether it was a track boundary."""
        api, req = self.api, run.req
        if not run.prefill_done:
            raise ValueError(f"{run.rid} is still in prefill")
        if not self._kv_room(1):
            raise PoolExhausted("no KV room for a decode token")
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
            api.set_mamba_track_indices_from_reqs(batch)
            at_boundary = seq_len % interval == 0
            batch.mamba_track_mask_cpu = [at_boundary]
            batch.mamba_decode_batch_idx_cpu = [req.decode_batch_idx]
        seq = run.tokens
        slot = self._mamba_slot(req)
        self._expect_state(slot, seq[: seq_len - 1], f"{run.rid} decode to {seq_len} start state")
        state_marker.write(self.rtp.mamba_pool, slot, state_marker.marker_for(seq[:seq_len]))
        if at_boundary:
            state_marker.write(self.rtp.mamba_pool, int(batch.mamba_track_indices[0]), state_marker.marker_for(seq[:seq_len]))
        req.output_ids.append(token if token is not None else self.fresh_token())
        if self.extra:
            if at_boundary and not self.lazy:  # mirrors _handle_finish_state_updated_req
                req.kv.mamba_last_track_idx = batch.mamba_track_buffer_indices[0]
                req.kv.mamba_prev_track_seqlen = req.kv.mamba_last_track_seqlen
                req.kv.mamba_last_track_seqlen = req.kv.kv_committed_len
            if at_boundary:
                self._processor._mamba_prefix_cache_update(req, batch, None, 0, known_boundary=not self.lazy)
        return at_boundary

    def finish(self, run: Running, *, abort: bool = False) -> None:
        """Finish (or abort: one more decode forward, then the same release) a request."""
        api, req = self.api, run.req
        if abort and run.prefill_done and self._kv_room(1):
            self.decode(run)
        if abort:
            req.finished_reason = api.FINISH_ABORT()
        else:
            req.finished_reason = api.FINISH_LENGTH(length=len(req.output_ids))
        checkpoint = req.mamba_lazy_checkpoint if self.lazy else True
        if not run.prefill_done:
            checkpoint = False  # an aborted chunked prefill is released without insert
        api.release_kv_cache(req, self.tree, checkpoint=checkpoint)
        del self.running[run.rid]

    def evict(self, num_tokens: int = 0, mamba_num: int = 0):
        return self.tree.evict(self.api.EvictParams(num_tokens=num_tokens, mamba_num=mamba_num))

    def evict_all(self):
        return self.evict(self.alloc.size, self.rtp.mamba_pool.size)

    def flush(self) -> None:
        """The scheduler's flush_cache (only legal when idle)."""
        if self.running:
            raise ValueError("flush needs an idle pool")
        self.tree.reset()
        self.rtp.clear()
        self.alloc.clear()
        self.evictions = 0
