"""The one module that imports every SGLang symbol the pool tier touches.

A new SGLang release breaks here, in one place.  ``load()`` imports them once (SGLang's
import takes ~12 s) and returns a namespace; it raises :class:`SGLangUnavailable` with a
one-line cause when sglang is missing, fails to import, or is not the version the tier
was written against.  Tests call :func:`require` which turns that into ``pytest.skip``
with the cause: never a silent pass.

The CPU neutralisation lives here too (:func:`cpu_pin_memory_guard`): SGLang's
``prepare_for_decode``/``prepare_for_extend`` call ``Tensor.pin_memory()`` for buffered
strategies, which needs a CUDA driver.  The harness never calls those two functions (it
drives their mamba helpers directly), so the guard is only a safety net that makes
``pin_memory`` the identity on a CPU-only torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from types import SimpleNamespace
from typing import Iterator

SUPPORTED_VERSIONS = ("0.5.23",)

_API: SimpleNamespace | None = None
_ERROR: str | None = None


class SGLangUnavailable(RuntimeError):
    """sglang cannot be used by the pool tier; ``str()`` is the one-line cause."""


def _import() -> SimpleNamespace:
    try:
        import sglang
    except Exception as e:  # ImportError or any error raised while importing
        raise SGLangUnavailable(f"sglang is not importable ({type(e).__name__}: {e})") from None
    version = getattr(sglang, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS and not os.environ.get("HYBRID_CONFORMANCE_ANY_SGLANG"):
        raise SGLangUnavailable(
            f"sglang {version} is installed but the pool tier targets {', '.join(SUPPORTED_VERSIONS)} "
            "(set HYBRID_CONFORMANCE_ANY_SGLANG=1 to try anyway)"
        )
    warnings.filterwarnings("ignore")
    try:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.environ import envs
        from sglang.srt.managers.schedule_batch import (
            FINISH_ABORT,
            FINISH_LENGTH,
            Req,
            ScheduleBatch,
            _gather_mamba_track_indices,
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
    except Exception as e:
        raise SGLangUnavailable(f"sglang {version} lacks a symbol the pool tier needs ({type(e).__name__}: {e})") from None
    for name in ("sglang", "sglang.srt", "root"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    return SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("e", "name")})


def load() -> SimpleNamespace:
    """Import SGLang's symbols once; raise :class:`SGLangUnavailable` naming the cause."""
    global _API, _ERROR
    if _API is not None:
        return _API
    if _ERROR is not None:
        raise SGLangUnavailable(_ERROR)
    try:
        _API = _import()
    except SGLangUnavailable as e:
        _ERROR = str(e)
        raise
    return _API


def require() -> SimpleNamespace:
    """``load()`` for tests: skip (never pass) with the cause when sglang is unusable."""
    import pytest

    try:
        return load()
    except SGLangUnavailable as e:
        pytest.skip(f"pool tier needs sglang: {e}")


def version() -> str:
    return load().sglang.__version__


@contextlib.contextmanager
def cpu_pin_memory_guard() -> Iterator[None]:
    """Make ``Tensor.pin_memory`` the identity when no CUDA driver is present."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.pin_memory
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]
