"""``evict_priority_inverted``: the tree keeps each path's request priority with its sign flipped.

SGLang 0.5.23's ``--radix-eviction-policy priority`` evicts the leaf with the lowest priority
value first (``PriorityStrategy``: (priority, last access)); the priority is the highest request
priority that inserted the path (``UnifiedRadixCache.insert``: ``InsertParams.priority``, from
``req.priority``).  The scheduler, with ``--schedule-low-priority-values-first``, reads low values
as urgent; this fault is that convention leaking into the cache's insert (AROUND): the tree is
handed ``-priority``, so under KV pressure the most important paths go first.  Every other
policy ignores the priority, so it shows only with ``eviction = priority`` and a KV shortfall
(a KV-asked walk: a Mamba-shortfall walk is LRU whatever the policy); the prefix_branching
suite's eviction-order scenario makes one.
"""

from __future__ import annotations

import dataclasses

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "evict_priority_inverted"
TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"


def insert_with_priority_inverted(original, cache, *args, **kwargs):
    params = plan_arg(args, kwargs, 0, "params")
    priority = getattr(params, "priority", None)
    if priority:
        fired(NAME, priority=int(priority))
        params = dataclasses.replace(params, priority=-priority)
        if "params" in kwargs:
            kwargs["params"] = params
        else:
            args = (params, *args[1:])
    return original(cache, *args, **kwargs)


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
)
