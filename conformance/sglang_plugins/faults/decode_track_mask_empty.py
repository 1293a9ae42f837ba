"""``decode_track_mask_empty``: the device track mask of a decode step reaches the kernel
empty while the scheduler's host copy says a request is at a track boundary (SGLang PR
20522, which precomputed the ``mamba_track_mask`` rows to remove a device-to-host copy;
the empty mask is its edge case).

Hooks SGLang's ``ScheduleBatch.prepare_for_decode`` (AFTER): when a row is at a boundary
(``mamba_track_mask_cpu``), the device mask is cleared, so the boundary state is never
copied into the track slot; the result processor still records the boundary, and the
untouched track slot is inserted into the radix cache under it.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, sglang_fault, zero_device_track_mask

NAME = "decode_track_mask_empty"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"


def empty_device_mask(result, batch, *args, **kwargs):
    zero_device_track_mask(NAME, batch, "mamba_track_mask_cpu")
    return result


FAULT = sglang_fault(
    NAME,
    "At a decode track boundary the kernel receives an empty track mask while the "
    "scheduler's precomputed host mask marks the boundary: the state is never copied into "
    "the track slot, the boundary is still recorded, and the stale track slot is cached under it.",
    "SGLang PR 20522 (precomputed mamba_track_mask indices to drop a D2H copy; the empty mask is the edge case)",
    "a hit on a prefix cached at a decode boundary continues from a stale state (KL decode_hit)",
    (Hook(TARGET, "after", empty_device_mask),),
)
