"""``lazy_alloc_fail_still_inserts``: extra_buffer_lazy, when the boundary allocation of the
second ping-pong slot fails, the boundary state is not written, yet the request still
records the boundary and inserts its keep slot there (SGLang PR 27118, alloc-fail path).

Hooks SGLang's ``ScheduleBatch.prepare_for_decode`` (AFTER): for a request at a track
boundary whose second slot could not be allocated (0.5.23 then tracks in place, into the
keep slot), the device track mask row is cleared, so the in-place write is lost while
the scheduler's bookkeeping still advances to the boundary.  Fires only when the
allocation fails: ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1`` or a full mamba pool.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "lazy_alloc_fail_still_inserts"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"


def drop_in_place_track(result, batch, *args, **kwargs):
    marks = getattr(batch, "mamba_track_mask_cpu", None)
    mask = getattr(batch, "mamba_track_mask", None)
    if not marks or mask is None:
        return result
    for i, (req, at_boundary) in enumerate(zip(batch.reqs, marks)):
        kv = req.kv
        if not at_boundary or kv.mamba_ping_pong_track_buffer is None or kv.mamba_next_track_idx is None:
            continue
        if kv.mamba_ping_pong_empty[1 - kv.mamba_next_track_idx]:  # the second slot was not allocated
            mask[i] = False
            fired(NAME, rid=str(req.rid)[:40])
    return result


FAULT = sglang_fault(
    NAME,
    "extra_buffer_lazy: when the boundary allocation of the second ping-pong slot fails, "
    "0.5.23 tracks the boundary in place in the keep slot; with this fault that write is "
    "lost while the tracked length still advances, so the keep slot's older state is "
    "inserted at the boundary when the request finishes.",
    "SGLang PR 27118 alloc-fail path (tracking must degrade in place or skip the insert)",
    "a later hit at the boundary continues from a stale state: KL and outputs on hit vs cold diverge",
    (Hook(TARGET, "after", drop_in_place_track),),
    strategies=("extra_buffer_lazy",),
    cell_fault="lazy_alloc_fail",
)
