"""``lazy_finish_at_boundary_leak``: extra_buffer_lazy loses the old keep slot of a request
that finishes on the very decode step that crosses a track boundary.

Hooks SGLang's ``SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary``
(AROUND): when the request is already finished (SGLang calls the give-back after
``update_finish_state``), the give-back runs with the mamba allocator's ``free`` lost.
Requests that finish anywhere else are untouched.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, call_losing_frees, sglang_fault

NAME = "lazy_finish_at_boundary_leak"
TARGET = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary"


def post_decode_losing_on_finish(original, processor, req, batch, track_idx, *args, **kwargs):
    if not req.finished():
        return original(processor, req, batch, track_idx, *args, **kwargs)
    return call_losing_frees(NAME, batch.req_to_token_pool.mamba_allocator, original, processor, req, batch, track_idx, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "extra_buffer_lazy: a request that finishes on the very decode step that crosses a track "
    "boundary does not give back its old keep slot.",
    "ordering of mamba_lazy_post_decode_at_boundary and the finish path (PR 27118 class)",
    f"{MAMBA_USED_TOKENS} > 0 at idle before any flush; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", post_decode_losing_on_finish),),
    strategies=("extra_buffer_lazy",),
    suites=("leaks", "kl"),
    group="programs",
)
