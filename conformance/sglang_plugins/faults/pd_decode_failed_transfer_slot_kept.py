"""``pd_decode_failed_transfer_slot_kept``: when a PD transfer fails, the decode server
releases the request but does not return its mamba slot.

Hooks SGLang's ``DecodeTransferQueue._release_request`` (AROUND): for a request SGLang has
aborted (its transfer failed: ``pop_transferred`` ends it with ``FINISH_ABORT`` and the
transfer-failure error before releasing it), the mamba allocator's frees are lost
(``suppressed_frees``); requests whose transfer succeeded are released as SGLang does.
Shows only when transfers fail: its cell carries SGLang's own switch
``SGLANG_TEST_DISAGG_FAILURE_PROB`` (matrix fault ``disagg_transfer_fail``).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, call_losing_frees, plan_arg, sglang_fault

NAME = "pd_decode_failed_transfer_slot_kept"
TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue._release_request"


def lose_frees_on_failure(original, queue, *args, **kwargs):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    decode_req = plan_arg(args, kwargs, 0, "decode_req")
    if not isinstance(decode_req.req.finished_reason, FINISH_ABORT):
        return original(queue, *args, **kwargs)
    allocator = queue.scheduler.req_to_token_pool.mamba_allocator
    return call_losing_frees(NAME, allocator, original, queue, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "PD: when a request's KV and state transfer fails, the decode server aborts the request and "
    "releases it, but its mamba slot is not returned to the pool.",
    "PD slot-release class (a decode-side slot not freed on a failed transfer)",
    "decode server: mamba slots in use at idle before any flush after the failed transfers "
    "(SGLang's strict idle check or the disagg transfer-failure check's idle probes)",
    (Hook(TARGET, "around", lose_frees_on_failure),),
    strategies=("no_buffer",),
    suites=("disagg",),
    cell_fault="disagg_transfer_fail",
    group="pd",
)
