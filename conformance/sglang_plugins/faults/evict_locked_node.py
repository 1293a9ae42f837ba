"""``evict_locked_node``: the mamba state of a radix node is evicted -- its slot returned to
the allocator -- while a request holds the node locked, and the tree keeps referencing it.

Hooks SGLang's ``UnifiedRadixCache.lock`` (AFTER): when a request locks the node its hit
matched, that node's mamba slot is freed once, as an eviction that ignored the lock and
did not detach the state would.  The slot is then both free and cached (counted twice,
and free to be handed to another request before the hit's copy-on-write reads it); the
tree frees it again when the node goes.  (SGLang 0.5.23 runs the Rust tree core here,
whose LRU walks the kit cannot hook; the lock is the Python-side entry it can.)
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "evict_locked_node"
TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.lock"
_EVICTED: set[int] = set()


def evict_under_lock(lock, cache, node_id, *args, **kwargs):
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    if lock is None or not cache.supports_mamba():
        return lock
    value = cache.tree_core.get_component_device_value(node_id, ComponentType.MAMBA)
    if value is None or int(value.reshape(-1)[0]) in _EVICTED:
        return lock
    _EVICTED.add(int(value.reshape(-1)[0]))
    cache.req_to_token_pool.mamba_allocator.free(value.reshape(-1).clone())
    fired(NAME, slot=int(value.reshape(-1)[0]))
    return lock


FAULT = sglang_fault(
    NAME,
    "When a request locks the radix node its hit matched, the node's mamba state is evicted "
    "anyway (its slot freed) while the tree keeps referencing it: the slot is counted twice, "
    "can be handed to another request before the hit copies from it, and is freed again "
    "when the node goes.",
    "lock_ref handling of the mamba eviction path (evicting a locked node without detaching it)",
    f"{MAMBA_USED_TOKENS} < 0 at idle (a slot counted twice); SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "after", evict_under_lock),),
    suites=("leaks", "kl"),  # the kl suite's hits lock cached nodes; the leak checks read the pools after every scenario
)
