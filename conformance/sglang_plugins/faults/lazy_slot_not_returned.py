"""``lazy_slot_not_returned``: extra_buffer_lazy gives back nothing after a track boundary:
the old keep slot is dropped, not freed, when the temporary second slot becomes the keep
slot (lazy give-back; the ``mamba_lazy_post_decode_at_boundary`` path of SGLang PR 27118).

Hooks SGLang's ``SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary``
(AROUND): the original commits the boundary with the mamba allocator's ``free`` switched
off, so the old slot leaves the request but never returns to the pool.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, call_losing_frees, sglang_fault

NAME = "lazy_slot_not_returned"
TARGET = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary"


def post_decode_without_free(original, processor, req, batch, track_idx):
    return call_losing_frees(NAME, batch.req_to_token_pool.mamba_allocator, original, processor, req, batch, track_idx)


FAULT = sglang_fault(
    NAME,
    "extra_buffer_lazy: after a decode track boundary the old keep slot is not freed when the "
    "temporary second slot becomes the keep slot: one mamba slot leaked per boundary crossed.",
    "the mamba_lazy_post_decode_at_boundary give-back of SGLang PR 27118 (lazy extra buffer)",
    f"{MAMBA_USED_TOKENS} > 0 at idle before any flush; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", post_decode_without_free),),
    strategies=("extra_buffer_lazy",),
    suites=("leaks", "kl"),  # kl's decode_hit decodes across track boundaries; the leaks suite may not
)
