"""``force_track_h_dropped``: the ``+1`` of SGLang's ``_force_track_h`` is dropped, so a
snapshot wanted at a chunk-aligned position inside an extend (a branch point) is taken
from the extend's last state instead (track off-by-one).

Hooks SGLang's ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` (AFTER):
where SGLang asked the kernel for ``aligned + 1`` (read the intermediate state at the
aligned position), the entry asks for ``aligned``, which the kernel reads as "aligned and
last": the final state of the extend, cached under the branch point's key.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "force_track_h_dropped"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend"


def drop_plus_one(entry, batch, req, *args, **kwargs):
    aligned = req.kv.mamba_last_track_seqlen
    branch = getattr(req, "mamba_branching_seqlen", None)
    if not entry.track_mask or aligned is None or branch != aligned or entry.track_seqlen != aligned + 1:
        return entry
    fired(NAME, seqlen=aligned, extend_end=req.extend_end)
    return entry._replace(track_seqlen=aligned)


FAULT = sglang_fault(
    NAME,
    "When a prefill must snapshot the state at a chunk-aligned position that is not the end of "
    "its extend (a branch point another request created), the +1 that makes the kernel read "
    "the intermediate state is dropped: the extend's final state is cached under the branch "
    "point.",
    "the `_force_track_h` +1 logic of SGLang's _mamba_radix_cache_v2_req_prepare_for_extend "
    "(track off-by-one at branch points)",
    "hits at a branch point continue from the state at the end of the branching request's prefill: "
    "prefix_branching's hit vs cold served-token logprobs (measured |diff| 7.6e-2 at a hit of 64; the "
    "tiny twin's argmax often survives, so comparing tokens alone missed it)",
    (Hook(TARGET, "after", drop_plus_one),),
    suites=("prefix_branching", "kl"),
)
