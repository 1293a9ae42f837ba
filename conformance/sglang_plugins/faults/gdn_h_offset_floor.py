"""``gdn_h_offset_floor``: index misalignment in a batched gated-delta-net prefill: each
request's offset into the per-chunk states ``h`` is counted with floor instead of ceil.

Hooks SGLang's ``build_prefill_track_plan`` (AFTER): for the gated delta net (not Mamba2)
every request after one whose extend length is not a multiple of the chunk reads its
snapshot from the wrong entry of ``h`` -- a chunk state of the previous request or an
earlier chunk of its own -- and that state is cached under the request's prefix.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "gdn_h_offset_floor"
TARGET = "sglang.srt.layers.attention.mamba.prefill_track_metadata.build_prefill_track_plan"


def floor_offsets(plan, *args, **kwargs):
    if kwargs.get("mamba2") or not plan.h_rows:
        return plan
    extend_lens = plan_arg(args, kwargs, 2, "extend_lens")
    chunk_size = plan_arg(args, kwargs, 4, "chunk_size")
    floor_offset = [0]
    for n in extend_lens:
        floor_offset.append(floor_offset[-1] + n // chunk_size)
    shifted = [floor_offset[row] + plan.chunk_indices[row] for row in plan.h_rows]
    if shifted != plan.h_src:
        fired(NAME, rows=sum(a != b for a, b in zip(shifted, plan.h_src)))
        plan.h_src[:] = shifted
    return plan


FAULT = sglang_fault(
    NAME,
    "In a batched gated-delta-net prefill, each request's offset into the per-chunk states "
    "is counted with floor instead of ceil of the previous requests' chunk counts: a request "
    "after one whose length is not a chunk multiple caches the state of an earlier chunk "
    "(its own or the previous request's) under its prefix.",
    "index misalignment in the track-source arithmetic (per-sequence h offsets of "
    "_init_track_ssm_indices / build_prefill_track_plan)",
    "cache hits on prefixes first cached by a non-first request of a batch diverge from cold runs (KL)",
    (Hook(TARGET, "after", floor_offsets),),
)
