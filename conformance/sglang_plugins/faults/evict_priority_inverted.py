"""``evict_priority_inverted``: the tree keeps each path's request priority with its sign flipped.

SGLang 0.5.23's ``--radix-eviction-policy priority`` evicts the leaf with the lowest priority
value first (``PriorityStrategy``: (priority, last access)); the priority is the highest request
priority that inserted the path (``UnifiedRadixCache.insert``: ``InsertParams.priority``, from
``req.priority``).  The scheduler, with ``--schedule-low-priority-values-first``, reads low values
as urgent; this fault is that convention leaking into the cache's insert: around
``UnifiedRadixCache.checkpoint`` (whose ``checkpoint_into_tree`` takes the insert's
``InsertParams.priority`` from ``req.priority``) the request's priority is negated, and restored
after, so the tree is handed ``-priority`` and under KV pressure the most important paths go
first.  (Not the tree's ``insert`` nor ``checkpoint_into_tree``: the observe plugin's per-node
evidence hooks those.)  Every other
policy ignores the priority, so it shows only with ``eviction = priority`` and a KV shortfall
(a KV-asked walk: a Mamba-shortfall walk is LRU whatever the policy); the prefix_branching
suite's eviction-order scenario makes one.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "evict_priority_inverted"
TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint"


def insert_with_priority_inverted(original, cache, req, *args, **kwargs):
    priority = getattr(req, "priority", None)
    if not priority:
        return original(cache, req, *args, **kwargs)
    fired(NAME, priority=int(priority))
    req.priority = -priority
    try:
        return original(cache, req, *args, **kwargs)
    finally:
        req.priority = priority


FAULT = sglang_fault(
    NAME,
    "The radix insert keeps each path's request priority with its sign flipped (the scheduler's "
    "low-values-first convention applied to the cache): the priority eviction policy gives up the "
    "highest-priority prefixes first.",
    "the request priority handed to the radix tree's insert (InsertParams.priority) in the wrong "
    "convention for PriorityStrategy (lowest value evicted first)",
    "under KV pressure on an eviction = priority cell, the first KV eviction takes the high-priority "
    "prefix the policy ranks last (prefix_branching's eviction-order check, per-node evidence)",
    (Hook(TARGET, "around", insert_with_priority_inverted),),
    options=("eviction=priority",),
    suites=("prefix_branching",),
    group="option",
)
