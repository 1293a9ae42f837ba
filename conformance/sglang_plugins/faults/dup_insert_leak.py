"""``dup_insert_leak``: a prefill checkpoint inserted under a key the tree already holds
keeps its donated mamba slot instead of giving it back.

Hooks SGLang's ``MambaComponent.cleanup_after_caching_req`` (AROUND): for a checkpoint of
a running request (``is_finished`` false) whose insert found the state already cached
(``insert_result.mamba_exist``), the donated value is dropped instead of freed.  Two
requests that checkpoint the same prefix (identical or overlapping prompts in flight, or
one sent again) leak one slot per duplicate.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "dup_insert_leak"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.cleanup_after_caching_req"


def cleanup_keeping_duplicate(original, component, req, *args, **kwargs):
    is_finished = plan_arg(args, kwargs, 0, "is_finished")
    result = kwargs.get("insert_result", args[1] if len(args) > 1 else None)
    params = kwargs.get("insert_params", args[2] if len(args) > 2 else None)
    if is_finished or result is None or not result.mamba_exist or params is None or params.mamba_value is None:
        return original(component, req, *args, **kwargs)
    value, params.mamba_value = params.mamba_value, None
    try:
        out = original(component, req, *args, **kwargs)
    finally:
        params.mamba_value = value
    fired(NAME, slots=int(value.numel()))
    return out


FAULT = sglang_fault(
    NAME,
    "When a prefill checkpoint is inserted under a key the tree already holds, the duplicate "
    "donated mamba slot is not given back: one slot leaked per duplicate insert.",
    "the 'value already exists' branch of a radix insert (cleanup of an unused donated mamba value)",
    f"{MAMBA_USED_TOKENS} > 0 at idle before any flush; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", cleanup_keeping_duplicate),),
    suites=("leaks", "prefix_branching"),  # the leak burst repeats one prefix; trees send concurrent siblings
    group="programs",
)
