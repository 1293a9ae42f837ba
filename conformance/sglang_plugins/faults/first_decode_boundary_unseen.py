"""``first_decode_boundary_unseen``: the track boundary a request reaches on its first decode
step is never recorded, as SGLang 0.5.13-0.5.17 did under the overlap scheduler (known bug
``overlap-first-decode-boundary-track-lost``: the boundary check read ``kv_committed_len``
after the next step had already advanced it).

Hooks SGLang's ``SchedulerBatchResultProcessor._handle_finish_state_updated_req`` (AROUND),
where 0.5.18 and later record a completed boundary from the batch's track mask: when that
step recorded the boundary at the prompt's length plus one (the first decoded token's), the
request's record of its newest checkpoint (length, slot, the one before) is put back as it
was.  The state computed at the boundary is right but never named, so the request's finish
caches its prefill checkpoint: a stored prefix lost with nothing evicted, every answer
still the cold one.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "first_decode_boundary_unseen"
TARGET = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._handle_finish_state_updated_req"
#: The request's record of its newest tracked checkpoint (``req.kv``), put back when the first boundary is dropped.
RECORD = ("mamba_last_track_seqlen", "mamba_last_track_idx", "mamba_prev_track_seqlen")


def drop_first_boundary(original, processor, req, *args, **kwargs):
    kv = getattr(req, "kv", None)
    before = {name: getattr(kv, name, None) for name in RECORD}
    out = original(processor, req, *args, **kwargs)
    first = len(req.origin_input_ids) + 1
    if kv is not None and getattr(kv, "mamba_last_track_seqlen", None) == first and before["mamba_last_track_seqlen"] != first:
        fired(NAME, rid=str(req.rid)[:40], boundary=first, kept=before["mamba_last_track_seqlen"])
        for name, value in before.items():
            setattr(kv, name, value)
    return out


FAULT = sglang_fault(
    NAME,
    "The track boundary a request reaches on its first decode step is never recorded: the "
    "state computed there is not cached at its finish, only the prefill checkpoint is.",
    "overlap-first-decode-boundary-track-lost (0.5.13-0.5.17: the boundary check read kv_committed_len already "
    "advanced by the next overlapped step; 0.5.18 subtracts the lookahead)",
    "a prompt one token short of a track boundary, decoded past it, then extended: cached_tokens stops at the "
    "prefill checkpoint while the prefix oracle owes the boundary and SGLang's tree never took that state "
    "(KL decode_hit: state_not_stored)",
    (Hook(TARGET, "around", drop_first_boundary),),
    suites=("kl",),
)
