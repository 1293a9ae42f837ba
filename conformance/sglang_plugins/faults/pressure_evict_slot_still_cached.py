"""``pressure_evict_slot_still_cached``: a mamba-pool pressure eviction frees the slot of a
radix node that still names it.

When the Mamba state pool runs short, SGLang 0.5.23 asks the radix cache for room
(``UnifiedRadixCache.evict_for_alloc(EvictParams(mamba_num=k))``: from request admission,
``_evict_mamba_for_device_alloc``, and from ``MambaComponent._alloc_mamba_slot`` when a
checkpoint's replacement slot cannot be had); the eviction tombstones nodes and frees
their slots.  This fault hooks ``evict_for_alloc`` (AROUND): on a mamba shortfall it
first frees the slot of the checkpoint stored most recently (recorded by an AFTER hook on
``MambaComponent.prepare_for_caching_req``), as an eviction that returned a slot without
detaching its node would, then evicts as SGLang does.  The freed slot is handed to a
running request whose state overwrites it while the tree still serves it to later hits.
It fires only under Mamba pool pressure: ``mamba_pool = small`` (16 slots) is its cell.
Measured on SGLang 0.5.23: the direct probe's burst runs only the small pool short, but the
suites' bursts (kl, prefix_branching, leaks) run the kit's default CPU pool (48) short too
(shortfalls of 7-8 slots), so in the suites this fault is not specific to the small pool.
"""

from __future__ import annotations

from typing import Any, Callable

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "pressure_evict_slot_still_cached"
EVICT_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_for_alloc"
STORE_TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.prepare_for_caching_req"
_STORED: list[int] = []  # slots handed to the radix cache, oldest first
_FREED: set[int] = set()


def remember_stored(result, component, req, insert_params, *args, **kwargs):
    value = getattr(insert_params, "mamba_value", None)
    if result and value is not None:
        _STORED.append(int(value.reshape(-1)[0]))
        del _STORED[:-64]
    return result


def free_newest_stored(cache) -> int | None:
    """Free the slot of the checkpoint stored most recently that is still allocated, leaving
    its radix node naming it; the slot, or None when there is none."""
    allocator = cache.req_to_token_pool.mamba_allocator
    in_use = getattr(allocator, "is_slot_allocated", lambda slot: True)
    slot = next((s for s in reversed(_STORED) if s not in _FREED and in_use(s)), None)
    if slot is not None:
        import torch

        _FREED.add(slot)
        allocator.free(torch.tensor([slot], dtype=torch.int64))
    return slot


def freeing_a_cached_slot_first(name: str, shortfall: Callable[[Any], int]) -> Callable:
    """An AROUND hook on ``evict_for_alloc``: when ``shortfall(params)`` (the pool that ran
    short) is non-zero, free the newest stored checkpoint's slot first, then evict as SGLang does."""
    def hook(original, cache, *args, **kwargs):
        short = shortfall(plan_arg(args, kwargs, 0, "params"))
        if short and cache.supports_mamba():
            slot = free_newest_stored(cache)
            if slot is not None:
                fired(name, slot=slot, shortfall=int(short))
        return original(cache, *args, **kwargs)
    return hook


free_a_cached_slot_first = freeing_a_cached_slot_first(NAME, lambda params: getattr(params, "mamba_num", 0))


FAULT = sglang_fault(
    NAME,
    "Under Mamba pool pressure an eviction frees the slot of the most recently stored checkpoint "
    "while its radix node still names it: the slot goes to a running request whose state "
    "overwrites it, and later hits on that prefix continue from the wrong state.",
    "mamba pressure eviction (UnifiedRadixCache.evict_for_alloc with a mamba shortfall) returning a "
    "slot without detaching the node that holds it",
    "hits on a recently stored prefix diverge from cold after the pool ran short (KL / prefix_branching "
    "outputs); the slot is later freed twice (leak checks, SGLang's strict idle check); it needs a Mamba shortfall",
    (Hook(EVICT_TARGET, "around", free_a_cached_slot_first), Hook(STORE_TARGET, "after", remember_stored)),
    options=("mamba_pool=small",),
    suites=("kl", "prefix_branching", "leaks"),
    group="option",
)
