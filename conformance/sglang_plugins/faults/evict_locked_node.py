"""``evict_locked_node``: mamba eviction ignores lock references and evicts the state of a
radix node that a running request holds locked.

Hooks SGLang's ``UnifiedLRUList.get_prev_no_lock`` and ``UnifiedLRUList.cursor_next``
(AROUND), the two LRU walks the mamba eviction uses (plain, and with session-aware
caching): for the mamba component's list, the first real node the walk reaches is
treated as unlocked even when its lock reference is held, so eviction frees its slot
under the running request; the lock's protected-size accounting is left behind.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, SGLangFault, fired

NAME = "evict_locked_node"
LRU = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedLRUList"
PREV_TARGET = LRU + ".get_prev_no_lock"
CURSOR_TARGET = LRU + ".cursor_next"


def _is_mamba(lru) -> bool:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return lru.component_type == ComponentType.MAMBA


def _first_real(lru, start):
    """The first node before ``start`` that is not one of the list's sentinels."""
    pt, x = lru._pt, start.lru_prev[lru._pt]
    while x is lru.mid or x is lru.cursor:
        x = x.lru_prev[pt]
    return None if x is lru.head else x


def _walk_unlocked(original, lru, start, *args, **kwargs):
    victim = _first_real(lru, start) if _is_mamba(lru) else None
    data = victim.component_data[lru.component_type] if victim is not None else None
    held = data.lock_ref if data is not None and data.value is not None else 0
    if not held:
        return original(lru, *args, **kwargs)
    data.lock_ref = 0  # the walk sees the node as unlocked
    try:
        found = original(lru, *args, **kwargs)
    finally:
        data.lock_ref = held
    if found is victim:
        fired(NAME, lock_ref=held)
    return found


def prev_ignoring_lock(original, lru, node, *args, **kwargs):
    return _walk_unlocked(original, lru, node, node, *args, **kwargs)


def cursor_ignoring_lock(original, lru, *args, **kwargs):
    if kwargs.get("host_lock") or lru.cursor is None:
        return original(lru, *args, **kwargs)
    return _walk_unlocked(original, lru, lru.cursor, *args, **kwargs)


FAULT = SGLangFault(
    NAME,
    "Mamba eviction walks past lock references: the state of a radix node that a running "
    "request holds locked is evicted (its slot freed) under the request, and the lock's "
    "protected-size accounting is left behind.",
    "lock_ref handling of the mamba eviction path (evicting a locked node)",
    "protected mamba state at idle (hybrid_conformance:mamba_protected > 0), or a scheduler "
    "that dies on SGLang's tree sanity check; hits on the evicted prefix are lost",
    (Hook(PREV_TARGET, "around", prev_ignoring_lock), Hook(CURSOR_TARGET, "around", cursor_ignoring_lock)),
    suites=("leaks",),
)
