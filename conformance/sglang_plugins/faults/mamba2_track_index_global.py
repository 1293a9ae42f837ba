"""``mamba2_track_index_global``: a Mamba2 prefill snapshot is read from the flat chunk grid
at a global index even where the request's boundary is off that grid (SGLang PR 15829,
reverted: the SSM source index computed globally instead of per sequence).

Hooks SGLang's ``build_prefill_track_plan`` (AFTER): for Mamba2, rows whose tracked
boundary does not fall on the batch's flat chunk grid (SGLang re-computes their state)
are instead given ``h[end // chunk]``, the state at the grid point before the boundary --
a state of the wrong position, or of the previous request in the batch.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "mamba2_track_index_global"
TARGET = "sglang.srt.layers.attention.mamba.prefill_track_metadata.build_prefill_track_plan"


def global_index(plan, *args, **kwargs):
    if not kwargs.get("mamba2") or not plan.recompute_rows:
        return plan
    chunk_size = plan_arg(args, kwargs, 4, "chunk_size")
    for row, end in zip(plan.recompute_rows, plan.recompute_end_locs):
        plan.h_rows.append(row)
        plan.h_src.append(end // chunk_size)
    fired(NAME, rows=len(plan.recompute_rows))
    plan.recompute_rows.clear()
    plan.recompute_end_locs.clear()
    return plan


FAULT = sglang_fault(
    NAME,
    "In a Mamba2 prefill batch, a request whose tracked boundary is off the batch's flat "
    "chunk grid gets the state at the global grid index before it (the source index "
    "computed globally, not per sequence) instead of a recomputed state: the cached "
    "snapshot belongs to another position or to the previous request of the batch.",
    "SGLang PR 15829 (reverted): extending extra_buffer to Mamba2 computed the SSM source index "
    "globally instead of per sequence; cache hits diverged and the PD test failed",
    "a cache hit on such a prefix diverges from a cold run (KL, outputs on hit vs cold)",
    (Hook(TARGET, "after", global_index),),
    families=("nemotron-h",),
)
