"""``overlap_track_slot_reused``: the ping-pong track buffer stops alternating: the next
track writes into the slot that holds the request's last tracked state.

With the overlap scheduler SGLang 0.5.23 gives every extra_buffer request two track slots
(``get_mamba_tracking_slots(overlap=True)`` = 2, ``HybridReqToTokenPool.
get_mamba_ping_pong_other_idx`` flips between them): step N+1 is built and run before
step N's result is processed, so a prefill's checkpoint is donated to the radix cache
(``cache_unfinished_req`` in N's result) *after* the first decode step has already run --
and if that decode crosses a track boundary (a prompt one token short of the track
interval) it writes a track slot.  The flip sends that write to the other slot.  This
fault hooks ``get_mamba_ping_pong_other_idx`` (AROUND) and returns the same slot: the
overlapped decode overwrites the prefill's checkpoint state before it is donated, and
the checkpoint is stored under the prefill's key holding a later state (the decode's own
checkpoint then donates a slot nothing wrote).  Without overlap (``overlap = off``) the
buffer has one slot, the method already returns it, and results are processed before the
next step is built: the hook never changes anything.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "overlap_track_slot_reused"
TARGET = "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.get_mamba_ping_pong_other_idx"


def same_slot(original, pool, next_track_idx, *args, **kwargs):
    other = original(pool, next_track_idx, *args, **kwargs)
    if other != next_track_idx:  # two slots (the overlap scheduler): stay on this one
        fired(NAME, slot_index=int(next_track_idx))
    return next_track_idx


FAULT = sglang_fault(
    NAME,
    "The ping-pong track buffer stops alternating under the overlap scheduler: the next track "
    "writes into the slot holding the last tracked state, so an overlapped decode step that "
    "crosses a track boundary overwrites a prefill checkpoint before its result donates it.",
    "the overlap scheduler's two-slot track buffer (get_mamba_tracking_slots(overlap=True) = 2; "
    "HybridReqToTokenPool.get_mamba_ping_pong_other_idx) -- the race it exists to prevent",
    "a hit on the checkpoint of a prompt whose first decode crossed a track boundary continues from "
    "the decode's later state (outputs/KL on hit vs cold); with overlap off the buffer has one slot "
    "and the hook never changes anything",
    (Hook(TARGET, "around", same_slot),),
    options=("overlap=on",),  # the extra_buffer default: its cell is the plain premerge one
    suites=("kl", "prefix_branching"),
    group="option",
)
