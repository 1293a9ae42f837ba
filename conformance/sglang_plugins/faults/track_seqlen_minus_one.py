"""``track_seqlen_minus_one``: the prefill snapshot position handed to the kernel is one
token short (track off-by-one).

Hooks SGLang's ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` (AFTER):
the entry's ``track_seqlen`` (where the kernel takes the snapshot) becomes one less,
while the key the snapshot is cached under (``mamba_last_track_seqlen``) is unchanged.
An extend that ends exactly on the chunk grid then snapshots the state one chunk early,
and one that ends one token past it the state one token late.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "track_seqlen_minus_one"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend"


def one_short(entry, batch, req, *args, **kwargs):
    if not entry.track_mask or entry.track_seqlen <= req.prefix_len + 1:
        return entry
    chunk = getattr(batch.model_config.hf_text_config, "mamba_chunk_size", 64)
    if (entry.track_seqlen - req.prefix_len) % chunk in (0, 1):  # the kernel's source changes
        fired(NAME, seqlen=entry.track_seqlen)
    return entry._replace(track_seqlen=entry.track_seqlen - 1)


FAULT = sglang_fault(
    NAME,
    "The position where the kernel snapshots a prefill's recurrent state is one token short of "
    "what SGLang computes, while the snapshot is still cached under SGLang's key: an extend "
    "ending on the chunk grid caches the state one chunk early, one ending a token past it "
    "the state one token late.",
    "off-by-one in the track seqlen (the +1 / last-position logic of "
    "_mamba_radix_cache_v2_req_prepare_for_extend and _init_track_ssm_indices)",
    "hits continue from a state of the wrong position: KL and outputs on hit vs cold diverge",
    (Hook(TARGET, "after", one_short),),
)
