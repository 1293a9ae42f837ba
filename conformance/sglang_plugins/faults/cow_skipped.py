"""``cow_skipped``: a cache hit does not copy the matched mamba state into the request's slot.

Hooks SGLang's ``MambaComponent.finalize_match_result_in_cache`` (AFTER): the
copy-on-write source the match recorded is dropped and the slot is marked for clearing,
so the request continues its prefill from a zeroed recurrent state after the hit.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "cow_skipped"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.finalize_match_result_in_cache"


def skip_cow(result, component, params, *args, **kwargs):
    req = getattr(params, "req", None)
    if req is not None and req.kv.mamba_cow_src_index is not None:
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = True
        fired(NAME)
    return result


FAULT = sglang_fault(
    NAME,
    "On a cache hit the matched mamba state is not copied into the request's slot: the "
    "request continues from a zeroed recurrent state.",
    "SGLang PR 26877 class (copy-on-write of the matched mamba state skipped)",
    "every hit diverges from a cold run (KL, outputs on hit vs cold)",
    (Hook(TARGET, "after", skip_cow),),
)
