"""``pd_prefill_slot_kept``: after a successful transfer the prefill server does not return
the request's mamba slot.

Hooks SGLang's ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue``
(AROUND): while the scheduler releases the requests whose transfer finished, the mamba
allocator's frees are lost (``suppressed_frees``), so every finished PD request leaves a
slot behind on the prefill side.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, call_losing_frees, sglang_fault

NAME = "pd_prefill_slot_kept"
TARGET = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue"


def lose_frees(original, scheduler, *args, **kwargs):
    allocator = scheduler.req_to_token_pool.mamba_allocator
    return call_losing_frees(NAME, allocator, original, scheduler, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "PD: when a request's KV and state transfer finished, the prefill server releases the "
    "request but its mamba slots are not returned to the pool.",
    "PD slot-release class (a slot not freed on the transfer's completion path)",
    "prefill server: mamba slots in use at idle before any flush (disagg leaks on both servers)",
    (Hook(TARGET, "around", lose_frees),),
    strategies=("no_buffer",),
    suites=("disagg",),
    group="pd",
)
