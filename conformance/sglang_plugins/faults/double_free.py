"""``double_free``: a finished request's working mamba slot is freed twice.

Hooks SGLang's ``HybridReqToTokenPool.free_mamba_cache`` (AROUND): after the original
release, the same slot goes back onto the allocator's free list a second time, so the
pool counts one more free slot than it has and will hand the slot to two owners.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "double_free"
TARGET = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.free_mamba_cache"


def free_twice(original, pool, req, *args, **kwargs):
    slot = req.kv.mamba_pool_idx
    result = original(pool, req, *args, **kwargs)
    if slot is not None:
        pool.mamba_allocator.free(slot.reshape(1))
        fired(NAME)
    return result


FAULT = sglang_fault(
    NAME,
    "A finished request's working mamba slot is returned to the allocator twice: the free "
    "list holds it twice and the pool counts one slot more than it has.",
    "double release in release_kv_cache / free_mamba_cache (the 'double free? mamba_index is None' assertion class)",
    f"{MAMBA_USED_TOKENS} < 0 at idle (a slot counted twice); SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", free_twice),),
    suites=("leaks",),
)
