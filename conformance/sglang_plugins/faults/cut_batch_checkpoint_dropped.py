"""``cut_batch_checkpoint_dropped``: when SGLang cuts a prefill batch at its budget, the
prefill checkpoints of the batch's other (uncut) requests are dropped: the chunked
request's bookkeeping reset applied batch-wide.

Hooks SGLang's ``ScheduleBatch.prepare_for_extend`` (AFTER): in an extend batch holding
the scheduler's ``chunked_req``, every other request's ``mamba_last_track_seqlen`` (the
length its checkpoint is cached under at finish) becomes None, as SGLang itself does only
for a request whose kept checkpoint a failed lazy allocation overwrote.  Nothing computed
changes; the states are simply never cached.  Fires only on a prefill batch SGLang cut
(more new tokens than ``chunked_prefill_size``).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "cut_batch_checkpoint_dropped"
TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"


def drop_uncut_checkpoints(result, batch, *args, **kwargs):
    chunked = getattr(batch, "chunked_req", None)
    if chunked is None or not any(r is chunked for r in batch.reqs):
        return result
    for req in batch.reqs:
        if req is not chunked and req.kv.mamba_last_track_seqlen is not None:
            fired(NAME, rid=str(req.rid)[:40], dropped=req.kv.mamba_last_track_seqlen)
            req.kv.mamba_last_track_seqlen = None
    return result


FAULT = sglang_fault(
    NAME,
    "When a prefill batch is cut at SGLang's chunked-prefill budget, the prefill checkpoints "
    "of the batch's requests that were not cut are dropped (the chunked request's reset "
    "applied to the whole batch): a later request sharing one of those prompts misses a "
    "prefix that was computed, stored nowhere, and never evicted.",
    "the chunked-prefill bookkeeping class (per-request state reset batch-wide); a stored prefix not reused",
    "a follow-up of an uncut member of a cut prefill batch hits 0 instead of its checkpoint",
    (Hook(TARGET, "after", drop_uncut_checkpoints),),
    strategies=("extra_buffer", "extra_buffer_lazy"),
    suites=("programs", "prefix_branching"),
    # SGLang cuts a batch only past its --chunked-prefill-size: on the default cell no
    # premerge program reached it (installed, fired 0 times in a 12-program run, 2026-11-26);
    # on the checkpoint-grid cell (128 tokens) a burst or a tree level does.  There it fired
    # 10x unseen in 36 programs until the oracle placed a cut request's checkpoints from the
    # seen chunk lengths (not SGLang's claim): caught in 48 programs, 61 s, clean passing
    # (2026-11-26; 17 programs with bursts followed up on a member, a generator change reverted)
    options=("chunked_prefill=grid",),
    group="programs",
)
