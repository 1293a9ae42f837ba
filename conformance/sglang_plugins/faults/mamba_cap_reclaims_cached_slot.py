"""``mamba_cap_reclaims_cached_slot``: when the Mamba pool's request cap holds requests back,
the scheduler reclaims a cached checkpoint's slot without detaching its radix node.

SGLang 0.5.23 caps ``max_running_requests`` by the Mamba pool (``kv_cache_configurator``:
``max_mamba_cache_size // state slots per request``, 5 for extra_buffer here: "max_running_requests
is capped to 3 by the mamba state cache (max_mamba_cache_size=16, 5 state slots per
request)"), so admission's own Mamba gate (``PrefillAdder.rem_mamba_slots``) never closes:
the request rows run out first (``Scheduler.get_num_allocatable_reqs`` answers 0 with
requests waiting).  With ``mamba_pool = small`` (16 slots) that happens from the 4th
concurrent request; with the kit's default CPU pool (48: cap 9) only past 9.  This fault
hooks ``get_num_allocatable_reqs`` (AROUND): each time the cap starts holding waiting
requests back, it frees the slot of the checkpoint stored most recently while its node
still names it (a reclaim that skipped the tree).  The next admitted request overwrites
it; later hits on that prefix continue from its state, and the node's own eviction frees
the slot a second time.
Measured on SGLang 0.5.23: the direct probe (a burst of 5, 7 hits) fires it only on the small
pool; in the suites prefix_branching's tree sends ~56 requests at once, past the default
pool's cap of 9 too (fired 6x, up to 47 waiting; SGLang's strict idle check then killed the
server), so in the suites this fault is not specific to the small pool either.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.pressure_evict_slot_still_cached import STORE_TARGET, free_newest_stored, remember_stored
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "mamba_cap_reclaims_cached_slot"
CAP_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_num_allocatable_reqs"
_HELD: list[bool] = [False]  # the cap is holding requests back (fire once per such episode)


def reclaim_when_the_cap_holds(original, scheduler, *args, **kwargs):
    result = original(scheduler, *args, **kwargs)
    held = result <= 0 and len(getattr(scheduler, "waiting_queue", ())) > 0
    if held and not _HELD[0]:
        slot = free_newest_stored(scheduler.tree_cache)
        if slot is not None:
            fired(NAME, slot=slot, waiting=len(scheduler.waiting_queue))
    _HELD[0] = held
    return result


FAULT = sglang_fault(
    NAME,
    "When the Mamba pool's request cap holds waiting requests back, the scheduler reclaims the slot "
    "of the most recently stored checkpoint without detaching its radix node: the next admitted "
    "request overwrites it, later hits on that prefix diverge.",
    "the running-request cap SGLang derives from the Mamba pool (Scheduler.get_num_allocatable_reqs "
    "at 0 with requests waiting) reclaiming a cached slot behind the radix tree's back",
    "hits on a recently stored prefix diverge from cold once more requests arrive than the Mamba pool's "
    "cap runs (KL / prefix_branching outputs); the slot is later freed twice (leak checks, SGLang's "
    "strict idle check); it needs more concurrent requests than the pool's cap (3 for 16 slots, 9 for 48)",
    (Hook(CAP_TARGET, "around", reclaim_when_the_cap_holds), Hook(STORE_TARGET, "after", remember_stored)),
    options=("mamba_pool=small",),
    suites=("kl", "prefix_branching", "leaks"),
    group="option",
)
