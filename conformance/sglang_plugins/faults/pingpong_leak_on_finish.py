"""``pingpong_leak_on_finish``: a finished request's ping-pong track slots are forgotten,
not freed (the SGLang PR 26941 class of leak, on every finish).

Hooks SGLang's ``HybridReqToTokenPool.free_mamba_cache`` (AROUND): the request's working
slot is freed as usual, but its ping-pong entries are marked empty first, so the free
step skips them and then drops the references: one slot leaked per finished request
whose state went into the radix cache (the kept slot), two when nothing was inserted.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "pingpong_leak_on_finish"
TARGET = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.free_mamba_cache"


def free_mamba_cache(original, pool, req, mamba_ping_pong_track_buffer_to_keep=None):
    empty = req.kv.mamba_ping_pong_empty
    if pool.enable_mamba_extra_buffer and empty is not None:
        dropped = sum(1 for p, e in enumerate(empty) if not e and p != mamba_ping_pong_track_buffer_to_keep)
        if dropped:
            req.kv.mamba_ping_pong_empty = [True] * len(empty)  # the free step now skips them
            fired(NAME, slots=dropped)
    return original(pool, req, mamba_ping_pong_track_buffer_to_keep)


FAULT = sglang_fault(
    NAME,
    "When a request finishes, its ping-pong track slots are not returned to the mamba pool: "
    "the free step sees them as empty and drops the references (one slot per finished "
    "request whose state was cached, two otherwise).",
    "SGLang PR 26941 class (ping-pong track slots leaked until the idle check killed the server)",
    f"{MAMBA_USED_TOKENS} > 0 at idle before any flush; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", free_mamba_cache),),
    suites=("leaks",),
)
