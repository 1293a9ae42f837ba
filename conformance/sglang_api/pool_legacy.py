"""Pool driver for SGLang's older request lifecycle (cache state on the ``Req`` itself).

Fits releases where the probe finds no ``ReqKvInfo``, a ``MambaRadixCache`` (the tree the
scheduler builds for hybrid SSM models there) and ``release_kv_cache(req, tree,
is_insert=...)``: measured on 0.5.12, 0.5.13 and 0.5.18.  It builds
``HybridReqToTokenPool``, ``HybridLinearKVPool`` with SGLang's token allocator and
``MambaRadixCache`` for one :class:`~conformance.sglang_api.pool_runtime.PoolKey` and drives
requests the way that scheduler does, with no model:

* ``admit``: ``Req.init_next_round_input(tree)`` (match; the tree copies the matched state
  into a fresh slot), ``inc_lock_ref``, ``alloc_req_slots``; a refused admission goes
  through ``release_kv_cache``'s no-row path.
* ``prefill_chunk``: one chunk (the whole prompt); SGLang's ``alloc_token_slots``, the
  extend-time tracking helper ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``
  (either of its signatures), then ``maybe_cache_unfinished_req`` as the scheduler does
  after a prefill.
* ``decode``: ``alloc_token_slots`` and the state marker; decode-boundary tracking is not
  driven (the insert at finish then keeps the state tracked at prefill).
* ``finish`` / ``abort``: ``release_kv_cache(req, tree, is_insert=...)``.

Differences between these releases are probed (``mamba_allocator`` or ``mamba_pool``
free list, ``allocation`` or ``common`` module, ``set_extend_range``, the publishing of
server args).  The prefix oracle models the ``req.kv`` lifecycle's insert points, so this
driver answers ``oracle_exact = False``; SGLang's idle checker class does not exist here
(``sglang_checker = False``).  Every other invariant holds it to account.
"""

from __future__ import annotations

import importlib
import inspect
from array import array
from types import SimpleNamespace
from typing import Sequence

import torch

from conformance.sglang_api import state_marker
from conformance.sglang_api.pool_base import PoolDriverBase, record_slots
from conformance.sglang_api.pool_driver import (
    FULL_LAYERS,
    MAMBA_LAYERS,
    NotApplicable,
    PoolExhausted,
    PoolSizes,
    Running,
)
from conformance.sglang_api.pool_runtime import PoolKey, legacy_argv
from conformance.sglang_api.validate import as_cuda
from conformance.matrix.strategy import strategy_named


def import_symbols(features) -> SimpleNamespace:
    """Every SGLang symbol this driver touches (raises ImportError/AttributeError if one is gone)."""
    from sglang.srt import server_args
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.managers import schedule_batch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    except ImportError:
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: F811
    allocation = importlib.import_module("sglang.srt.mem_cache.allocation") if features.mem_allocation else common
    runtime = importlib.import_module("sglang.srt.runtime_context") if features.runtime_context else None
    return SimpleNamespace(
        Mamba2CacheParams=Mamba2CacheParams, Mamba2StateShape=Mamba2StateShape, envs=envs,
        FINISH_ABORT=FINISH_ABORT, FINISH_LENGTH=FINISH_LENGTH, Req=Req, ScheduleBatch=ScheduleBatch,
        EvictParams=EvictParams, CacheInitParams=CacheInitParams, MambaRadixCache=MambaRadixCache,
        HybridLinearKVPool=HybridLinearKVPool, HybridReqToTokenPool=HybridReqToTokenPool,
        SamplingParams=SamplingParams, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        alloc_req_slots=allocation.alloc_req_slots, alloc_token_slots=allocation.alloc_token_slots,
        release_kv_cache=common.release_kv_cache, maybe_cache_unfinished_req=common.maybe_cache_unfinished_req,
        mem_cache_common=common, server_args=server_args, runtime=runtime,
        ReqKvInfo=getattr(schedule_batch, "ReqKvInfo", None),  # KV lengths only, where it exists
    )


def _zero(pool, slots) -> None:
    """Clear mamba slots the way the release's pool would (conv and SSM states to zero)."""
    for t in list(pool.mamba_cache.conv) + [pool.mamba_cache.temporal]:
        t[:, slots] = 0


def _kwargs_for(fn, **candidates):
    """The candidates ``fn`` accepts (releases add and drop constructor parameters)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in candidates.items() if k in params}


class LegacyPoolDriver(PoolDriverBase):
    """The pool driver for the pre-``req.kv`` lifecycle (see the module docstring)."""

    oracle_exact = False
    sglang_checker = False

    def __init__(self, key: PoolKey, sizes: PoolSizes = PoolSizes(), *, api: SimpleNamespace):
        self.api = api = api
        self.key, self.sizes = key, sizes
        reason = self.gap(api, key)
        if reason:
            raise NotApplicable(reason)
        self.server_args = self._publish()
        self.evictions = 0
        self.running: dict[str, Running] = {}
        self._next_token = 1_000
        self._build()

    # ------------------------------------------------------------ capability answers
    @classmethod
    def gap(cls, api, key: PoolKey, need: str | None = None) -> str | None:
        """None, or the one line saying why this release and driver cannot run ``key``."""
        version = api.features.version
        reason = api.features.not_applicable(key.strategy)
        if reason:
            return reason
        if strategy_named(key.strategy).lazy:
            return f"sglang {version}: the legacy-lifecycle driver does not drive the lazy boundary path"
        if key.page_size != 1:
            return f"sglang {version}: the legacy-lifecycle driver drives page size 1 only (cell has {key.page_size})"
        if need == "sessions":
            return f"sglang {version}: streaming-session slots are driven on the req.kv lifecycle only"
        if need == "lookahead":
            return f"sglang {version}: the legacy-lifecycle driver does not drive decode-boundary tracking"
        return None

    # ------------------------------------------------------------ setup
    def _publish(self):
        api, key = self.api, self.key
        try:
            with as_cuda(api.features):
                sa = api.server_args.prepare_server_args(legacy_argv(key, api.features.strategy_flag))
        except (AssertionError, ValueError) as e:
            raise NotApplicable(f"sglang {api.features.version} refuses pool cell {key.id}: {' '.join(str(e).split())[:200]}") from None
        api.server_args.set_global_server_args_for_scheduler(sa)
        if api.runtime is not None and hasattr(api.runtime, "publish"):
            api.runtime.publish(sa, role="test")
        return sa

    def activate(self) -> None:
        self.api.server_args.set_global_server_args_for_scheduler(self.server_args)
        if self.api.runtime is not None and hasattr(self.api.runtime, "publish"):
            self.api.runtime.publish(self.server_args, role="test")

    def _build(self) -> None:
        api, key, sizes = self.api, self.key, self.sizes
        self.extra, self.lazy = strategy_named(key.strategy).has_buffer, False  # gap() refuses lazy keys
        with api.envs.SGLANG_MAMBA_SSM_DTYPE.override("float32"):
            shape = api.Mamba2StateShape.create(
                tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16, state_size=4, conv_kernel=4
            )
            params = api.Mamba2CacheParams(shape=shape, layers=list(MAMBA_LAYERS))
        self.rtp = api.HybridReqToTokenPool(**_kwargs_for(
            api.HybridReqToTokenPool.__init__,
            size=sizes.max_reqs, mamba_size=sizes.mamba_slots, mamba_spec_state_size=sizes.max_reqs,
            max_context_len=sizes.max_context_len, device="cpu", enable_memory_saver=False, cache_params=params,
            mamba_layer_ids=list(MAMBA_LAYERS), enable_mamba_extra_buffer=self.extra,
            enable_mamba_extra_buffer_lazy=False, enable_overlap_schedule=self.extra,
        ))
        kv_pool = api.HybridLinearKVPool(**_kwargs_for(
            api.HybridLinearKVPool.__init__,
            size=sizes.kv_tokens, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8,
            full_attention_layer_ids=list(FULL_LAYERS), enable_kvcache_transpose=False, device="cpu",
            enable_memory_saver=False, mamba_pool=self.rtp.mamba_pool,
        ))
        self.alloc = api.TokenToKVPoolAllocator(**_kwargs_for(
            api.TokenToKVPoolAllocator.__init__,
            size=sizes.kv_tokens, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False,
        ))
        self.tree = api.MambaRadixCache(api.CacheInitParams(**_kwargs_for(
            api.CacheInitParams,
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc, page_size=1,
            enable_mamba_extra_buffer=self.extra, enable_mamba_extra_buffer_lazy=False,
        )))
        real_evict = self.tree.evict

        def counting_evict(params):
            before = (self.tree.full_evictable_size(), self.tree.mamba_evictable_size())
            result = real_evict(params)
            if (self.tree.full_evictable_size(), self.tree.mamba_evictable_size()) != before:
                self.evictions += 1
            return result

        self.tree.evict = counting_evict
        rt = api.runtime
        if rt is not None and hasattr(rt, "mamba_cache_chunk_size"):
            self.chunk = int(rt.mamba_cache_chunk_size())
        else:
            self.chunk = int(self.server_args.mamba_cache_chunk_size)
        self.checkpoint_grid = int(rt.mamba_checkpoint_grid(1)) if rt is not None and hasattr(rt, "mamba_checkpoint_grid") else self.chunk
        self.track_grid = key.track_interval
        self._slots_owner = getattr(self.rtp, "mamba_allocator", None) or self.rtp.mamba_pool
        ids = inspect.signature(api.Req.__init__).parameters["origin_input_ids"].annotation
        self._ids_type = "array" if "array" in str(ids) else "list"

    # ------------------------------------------------------------ views (driver contract)
    @staticmethod
    def state(req):
        """The object holding the request's cache fields: the ``Req`` itself."""
        return req

    def live_state_len(self, run: Running) -> int | None:
        """How many tokens the state in the request's live slot covers: its KV so far; before
        its prefill, the matched prefix where the release copies the hit's state at match
        time; None (not defined yet) where it defers the copy and the clear to the extend
        (``_collect_deferred_mamba_cow_and_clear``): the slot may hold a former owner's state."""
        if run.prefill_done:
            return run.req.kv_committed_len
        deferred = hasattr(self.api.ScheduleBatch, "_collect_deferred_mamba_cow_and_clear")
        return None if deferred else run.matched

    def free_mamba_slots(self) -> list[int]:
        return [int(s) for s in self._slots_owner.free_slots.tolist()]

    def mamba_available(self) -> int:
        return int(self._slots_owner.available_size())

    def session_records(self) -> dict:
        return {}

    def _nodes(self):
        stack = [(self.tree.root_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                p = path + tuple(child.key.token_ids[: len(child.key)])
                yield child, p
                stack.append((child, p))

    def tree_mamba_slots(self) -> list[int]:
        return [int(s) for node, _ in self._nodes() if node.mamba_value is not None for s in node.mamba_value.view(-1).tolist()]

    def tree_state_keys(self) -> dict[tuple[int, ...], int]:
        return {p: int(node.mamba_value.view(-1)[0]) for node, p in self._nodes() if node.mamba_value is not None}

    # ------------------------------------------------------------ helpers
    def _mamba_slot(self, req) -> int:
        return int(self.rtp.req_index_to_mamba_index_mapping[req.req_pool_idx])

    def _alloc_kv(self, req, start: int, end: int) -> None:
        loc = self.api.alloc_token_slots(self.tree, end - start)
        self.rtp.write((req.req_pool_idx, slice(start, end)), loc.to(torch.int32))
        req.kv_committed_len = end
        self._kv_record(req, end)

    def _kv_record(self, req, allocated: int) -> None:
        """The KV length the request holds; where the release keeps it in its own record
        (``ReqKvInfo``), that record exists whenever the request holds a row, as
        ``alloc_for_extend`` (which takes both at once) leaves it."""
        req.kv_allocated_len = allocated
        if self.api.ReqKvInfo is not None:
            if getattr(req, "kv", None) is None:
                req.kv = self.api.ReqKvInfo(kv_allocated_len=allocated, swa_evicted_seqlen=0)
            else:
                req.kv.kv_allocated_len = allocated

    def _kv_room(self, tokens: int) -> bool:
        return self.alloc.available_size() + self.tree.full_evictable_size() >= tokens + 1

    def _mamba_room(self, slots: int) -> bool:
        return self.mamba_available() + self.tree.mamba_evictable_size() >= slots

    def request_slots(self, req) -> list[int]:
        return record_slots(req)

    def reuse(self, req, prompt: Sequence[int]) -> None:
        """Make a finished ``Req`` the next turn's (as a streaming session carries one on):
        new input, no output, not finished, its per-turn release flags re-armed."""
        req.origin_input_ids = array("q", list(prompt)) if self._ids_type == "array" else list(prompt)
        del req.output_ids[:]
        req.finished_reason = None
        for flag in ("kv_committed_freed", "kv_overallocated_freed"):
            if hasattr(req, flag):
                setattr(req, flag, False)

    # ------------------------------------------------------------ lifecycle
    def make_req(self, rid: str, prompt: Sequence[int], max_new_tokens: int = 4096):
        ids = array("q", list(prompt)) if self._ids_type == "array" else list(prompt)
        return self.api.Req(
            rid=rid, origin_input_text="", origin_input_ids=ids,
            sampling_params=self.api.SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
        )

    def admit(self, rid: str, prompt: Sequence[int], *, chunked_prefill_size: int | None = None) -> Running:
        if rid in self.running:
            raise ValueError(f"request {rid} already running")
        if not prompt:
            raise ValueError(f"request {rid} has an empty prompt")
        if self.rtp.available_size() < 1 or not self._mamba_room(2 + (2 if self.extra else 0)):
            raise PoolExhausted("no request row or mamba slot")
        req = self.make_req(rid, prompt)
        req.init_next_round_input(self.tree)
        return self.adopt(rid, req, prompt, chunked_prefill_size=chunked_prefill_size)

    def adopt(self, rid: str, req, prompt: Sequence[int], *, chunked_prefill_size: int | None = None) -> Running:
        """Lock and allocate a request whose ``init_next_round_input`` already ran."""
        matched = len(req.prefix_indices)
        self.tree.inc_lock_ref(req.last_node)
        if self.rtp.available_size() < 1 or not self._mamba_room(2 if self.extra else 0) or not self._kv_room(len(prompt) - matched):
            self.tree.dec_lock_ref(req.last_node)
            self.api.release_kv_cache(req, self.tree)
            raise PoolExhausted("admission refused after match")
        self.api.alloc_req_slots(self.rtp, [req], self.tree)
        if matched:
            self.rtp.write((req.req_pool_idx, slice(0, matched)), req.prefix_indices.to(torch.int32))
        req.kv_committed_len = matched  # the row holds the matched prefix, as after alloc_for_extend
        self._kv_record(req, matched)
        run = Running(rid, req, tuple(prompt), matched, None)
        self.running[rid] = run
        return run

    def _track_at_extend(self, req):
        """SGLang's extend-time tracking helper; returns (track slot, tracked length) or None."""
        helper = self.api.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend
        batch = SimpleNamespace(req_to_token_pool=self.rtp, tree_cache=self.tree)
        if len(inspect.signature(helper).parameters) > 2:  # (self, req, mask, indices, seqlens)
            mask, indices, seqlens = [], [], []
            helper(batch, req, mask, indices, seqlens)
            entry = SimpleNamespace(track_mask=mask[0], track_index=indices[0])
        else:
            entry = helper(batch, req)
        return (int(entry.track_index), req.mamba_last_track_seqlen) if entry.track_mask else None

    def prefill_chunk(self, run: Running) -> int | None:
        """Prefill the rest of the prompt in one chunk; returns the tracked length (extra_buffer)."""
        req, prompt = run.req, run.prompt
        start, end = len(req.prefix_indices), len(prompt)
        if not self._kv_room(end - start) or not self._mamba_room(1):
            raise PoolExhausted("no KV or mamba room for the prefill")
        # what the PrefillAdder sets before the extend (each release keeps its own fields)
        if hasattr(req, "set_extend_range"):
            req.set_extend_range(start, end)
        if hasattr(req, "set_extend_input_len"):
            req.set_extend_input_len(end - start)
        if hasattr(req, "fill_len"):
            req.fill_len = end
        self._alloc_kv(req, start, end)
        tracked = self._track_at_extend(req) if self.extra else None
        pool, slot = self.rtp.mamba_pool, self._mamba_slot(req)
        collect = getattr(self.api.ScheduleBatch, "_collect_deferred_mamba_cow_and_clear", None)
        if collect is not None:  # releases that defer the hit's copy-on-write to the extend
            batch = SimpleNamespace()
            collect(batch, [req])
            if batch.mamba_cow_src_indices is not None:
                pool.copy_from(batch.mamba_cow_src_indices, batch.mamba_cow_dst_indices)
            if batch.mamba_clear_indices is not None:
                pool.clear_slots(batch.mamba_clear_indices) if hasattr(pool, "clear_slots") else _zero(pool, batch.mamba_clear_indices)
        self._expect_state(slot, prompt[:start], f"{run.rid} prefill [{start}:{end}) start state")
        state_marker.write(pool, slot, state_marker.marker_for(prompt[:end]))
        if tracked is not None:
            state_marker.write(pool, tracked[0], state_marker.marker_for(prompt[: tracked[1]]))
        run.prefill_done = True
        req.output_ids.append(self.fresh_token())
        self.api.maybe_cache_unfinished_req(req, self.tree)
        stored = end if not self.extra else (tracked[1] if tracked else None)
        if stored is not None:
            run.stored.append(stored)
        return stored

    def decode(self, run: Running, token: int | None = None) -> bool:
        """One decode step (no boundary tracking on this lifecycle); returns False."""
        req = run.req
        if not run.prefill_done:
            raise ValueError(f"{run.rid} is still in prefill")
        if not self._kv_room(1):
            raise PoolExhausted("no KV room for a decode token")
        seq_len = req.kv_committed_len + 1
        self._alloc_kv(req, seq_len - 1, seq_len)
        seq = run.tokens
        slot = self._mamba_slot(req)
        self._expect_state(slot, seq[: seq_len - 1], f"{run.rid} decode to {seq_len} start state")
        state_marker.write(self.rtp.mamba_pool, slot, state_marker.marker_for(seq[:seq_len]))
        req.output_ids.append(token if token is not None else self.fresh_token())
        return False

    def finish(self, run: Running, *, abort: bool = False, lookahead: bool = False) -> None:
        if lookahead:
            raise NotApplicable(self.gap(self.api, self.key, "lookahead"))
        api, req = self.api, run.req
        req.finished_reason = api.FINISH_ABORT() if abort else api.FINISH_LENGTH(length=len(req.output_ids))
        api.release_kv_cache(req, self.tree, is_insert=not abort and run.prefill_done)
        del self.running[run.rid]



DRIVER = LegacyPoolDriver
DRIVER_NAME = "legacy"
