"""``mamba_gate_reclaims_cached_slot``: when admission runs out of Mamba slots, the scheduler
reclaims a cached checkpoint's slot without detaching its radix node.

SGLang 0.5.23's ``PrefillAdder`` gates new requests on Mamba slots separately from KV
tokens (``rem_mamba_slots`` = the allocator's schedulable free slots + the tree's
mamba-evictable slots; ``budget_state`` answers ``NO_TOKEN`` once it reaches 0 while KV
still has room).  That gate closes only when the *running* requests and locked nodes hold
the whole pool: a pool smaller than a burst's working slots (``mamba_pool = small``, 16
slots), never the kit's default CPU pool (48) with the suites' bursts, which only run it
short of *cached* slots (``evict_for_alloc``, see ``pressure_evict_slot_still_cached``).
This fault hooks ``budget_state`` (AROUND): the first time in an adder that the Mamba gate
is what closes, it frees the slot of the checkpoint stored most recently while its node
still names it (as a reclaim that skipped the tree would).  The next admitted request gets
that slot and overwrites it; later hits on the prefix continue from its state, and the
node's own eviction frees the slot a second time.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.pressure_evict_slot_still_cached import STORE_TARGET, free_newest_stored, remember_stored
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "mamba_gate_reclaims_cached_slot"
GATE_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.budget_state"


def reclaim_when_the_mamba_gate_closes(original, adder, *args, **kwargs):
    result = original(adder, *args, **kwargs)
    left = getattr(adder, "rem_mamba_slots", None)
    if left is not None and left <= 0 and adder.memory_budget.has_capacity() and not getattr(adder, "_kit_reclaimed", False):
        adder._kit_reclaimed = True  # once per scheduling round
        slot = free_newest_stored(adder.tree_cache)
        if slot is not None:
            fired(NAME, slot=slot, rem_mamba_slots=int(left))
    return result


FAULT = sglang_fault(
    NAME,
    "When admission runs out of Mamba slots (the adder's Mamba gate closes with KV room left), "
    "the scheduler reclaims the slot of the most recently stored checkpoint without detaching its "
    "radix node: the next admitted request overwrites it, later hits on that prefix diverge.",
    "the Mamba admission gate (PrefillAdder.budget_state, rem_mamba_slots <= 0) reclaiming a cached "
    "slot behind the radix tree's back",
    "hits on a recently stored prefix diverge from cold after the pool was full of running requests "
    "(KL / prefix_branching outputs); the slot is later freed twice (leak checks, SGLang's strict idle "
    "check); it needs running requests to hold the whole Mamba pool",
    (Hook(GATE_TARGET, "around", reclaim_when_the_mamba_gate_closes), Hook(STORE_TARGET, "after", remember_stored)),
    options=("mamba_pool=small",),
    suites=("kl", "prefix_branching", "leaks"),
)
