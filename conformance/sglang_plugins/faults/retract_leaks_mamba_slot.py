"""``retract_leaks_mamba_slot``: a retracted request's release loses its mamba frees.

When SGLang retracts running requests (a decode that runs the KV pool short, or its own
``SGLANG_TEST_RETRACT`` switch), ``schedule_batch.release_req`` gives each one's KV row
back through ``release_kv_cache`` and resets the request for a later prefill
(``Req.reset_for_retract`` clears ``mamba_pool_idx``).  This fault hooks ``release_req``
(AROUND) to mark the retraction and ``release_kv_cache`` (AROUND) to lose the mamba
allocator's frees while it runs for the marked request: its working and ping-pong slots stay
allocated with nobody naming them.  The request is prefilled again later and answers right;
only the pools show it.  It fires only on retraction: ``forced_retract`` is its cell.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, losing_release_frees, plan_arg, sglang_fault

NAME = "retract_leaks_mamba_slot"
RETRACT_TARGET = "sglang.srt.managers.schedule_batch.release_req"
RELEASE_TARGET = "sglang.srt.mem_cache.common.release_kv_cache"
_RETRACTING: list[int] = []  # id() of the request release_req is retracting


def marking_the_retraction(original, *args, **kwargs):
    req = plan_arg(args, kwargs, 0, "req")
    _RETRACTING.append(id(req))
    try:
        return original(*args, **kwargs)
    finally:
        _RETRACTING.remove(id(req))


release_losing_retracted_frees = losing_release_frees(NAME, lambda req: id(req) in _RETRACTING)


FAULT = sglang_fault(
    NAME,
    "A retracted request's release loses its mamba frees: its working and ping-pong slots stay "
    "allocated with no owner; the request is prefilled again and answers right.",
    "retraction paths that give back the KV row but not the mamba state (release_req / release_kv_cache)",
    f"the tree audit's slot_owned names each leaked slot at the next batch (used, held by no node and no request); "
    f"{MAMBA_USED_TOKENS} > 0 at idle after a retraction; SGLang's strict idle check logs 'memory leak detected', "
    "or its allocator runs out of slots and asserts",
    (Hook(RETRACT_TARGET, "around", marking_the_retraction), Hook(RELEASE_TARGET, "around", release_losing_retracted_frees)),
    suites=("programs",),
    cell_fault="forced_retract",
    group="programs",
)
