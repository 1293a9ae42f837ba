"""``cached_tokens_overreport``: ``meta_info.cached_tokens`` reports the full-attention KV
prefix match instead of the mamba-floored prefix the request actually reused.

Hooks SGLang's ``UnifiedRadixCache.match_prefix`` (AFTER: notes the match's
``full_kv_hit_length`` on the request) and ``ScheduleBatch.prepare_for_extend`` (AFTER:
where SGLang counts a request's cached tokens, raises the count to that KV match).
Nothing that is computed changes; only the number reported to the client does.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "cached_tokens_overreport"
MATCH_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix"
COUNT_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
_NOTE = "_hybrid_conformance_kv_hit"


def note_kv_hit(result, cache, params, *args, **kwargs):
    req = getattr(params, "req", None)
    if req is not None:
        setattr(req, _NOTE, int(getattr(result, "full_kv_hit_length", 0) or 0))
    return result


def report_kv_hit(result, batch, *args, **kwargs):
    for req in batch.reqs:
        kv_hit = getattr(req, _NOTE, None)
        if kv_hit is None:
            continue
        delattr(req, _NOTE)
        if kv_hit > req.cached_tokens:
            fired(NAME, reported=kv_hit, reused=req.cached_tokens)
            req.cached_tokens = kv_hit
    return result


FAULT = sglang_fault(
    NAME,
    "meta_info.cached_tokens reports the full-attention KV prefix match instead of the "
    "mamba-floored hit that was reused.",
    "reporting the full-KV hit of a hybrid cache (cached_tokens misreport)",
    "cached_tokens disagrees with the prefix oracle (too high) on branching trees",
    (Hook(MATCH_TARGET, "after", note_kv_hit), Hook(COUNT_TARGET, "after", report_kv_hit)),
    suites=("prefix_branching",),
)
