"""``kv_evict_frees_cached_mamba_slot``: a KV-pool shortfall eviction frees a Mamba slot that a
radix node still names.

When the KV pool runs short, SGLang 0.5.23's allocator asks the radix cache for room
(``TokenToKVPoolAllocator.evict_to_free_tokens`` ->
``UnifiedRadixCache.evict_for_alloc(EvictParams(num_tokens=shortfall))``); the walk evicts
whole leaves, KV and the Mamba state each node holds together.  This fault hooks
``evict_for_alloc`` (AROUND): on a KV shortfall (tokens asked, no Mamba slot asked) it first
frees the slot of the checkpoint stored most recently (the AFTER hook on
``MambaComponent.prepare_for_caching_req`` it shares with ``pressure_evict_slot_still_cached``)
-- the Mamba half of a KV eviction applied to the wrong node, whose radix node still names
the slot -- then evicts as SGLang does.  The next admitted request overwrites the slot;
later hits on that prefix continue from the wrong state.
It needs a KV shortfall: ``kv_pool = small`` (``--max-total-tokens 4096``) is its cell.
Measured on SGLang 0.5.23 (the observe plugin records what each eviction walk was asked to
free): kl, prefix_branching and leaks' other scenarios never run even the small KV pool short
(every walk asked for Mamba slots only), so the leaks suite's KV fill, run on the small-KV
cells only, is what reaches it.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.pressure_evict_slot_still_cached import EVICT_TARGET, STORE_TARGET, freeing_a_cached_slot_first, remember_stored
from conformance.sglang_plugins.faults.spec import Hook, sglang_fault

NAME = "kv_evict_frees_cached_mamba_slot"


def _kv_shortfall(params) -> int:
    """Tokens asked of a walk started by the KV pool alone (no Mamba slot asked), else 0."""
    return 0 if getattr(params, "mamba_num", 0) else max(0, int(getattr(params, "num_tokens", 0) or 0))


free_a_cached_slot_on_kv_shortfall = freeing_a_cached_slot_first(NAME, _kv_shortfall)


FAULT = sglang_fault(
    NAME,
    "A KV-pool shortfall eviction frees the Mamba slot of the most recently stored checkpoint "
    "while its radix node still names it (the Mamba half of the eviction applied to the wrong node): "
    "the next request overwrites it, later hits on that prefix diverge.",
    "KV eviction under pressure (UnifiedRadixCache.evict_for_alloc with a token shortfall) releasing "
    "a Mamba state the tree still serves",
    "hits on a recently stored prefix diverge from cold once the KV pool ran short (KL / prefix_branching "
    "outputs); the slot is later freed twice (the leaks suite's KV fill on kv_pool = small cells, SGLang's strict "
    "idle check); it needs a KV shortfall",
    (Hook(EVICT_TARGET, "around", free_a_cached_slot_on_kv_shortfall), Hook(STORE_TARGET, "after", remember_stored)),
    options=("kv_pool=small",),
    suites=("leaks", "prefix_branching", "kl"),
    group="option",
)
