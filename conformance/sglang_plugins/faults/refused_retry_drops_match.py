"""``refused_retry_drops_match``: a request refused after its prefix match is retried without it.

SGLang's prefill adder (``PrefillAdder.add_one_req``) refuses a waiting request that matched a
cached prefix when the KV or Mamba room left cannot hold its extend (``NO_TOKEN``); the request
stays in the waiting queue and is matched again at every later scheduling round until it is
admitted.  This fault marks each request refused after a match (AROUND the adder) and makes
every later match made for it (AROUND ``UnifiedRadixCache.match_prefix``, the request's
``MatchPrefixParams.req``) against an empty key: the retry starts from nothing although the
tree still holds the state it matched.  Everything SGLang then computes is consistent with
that empty prefix, so the answers stay right; only the hit is lower.  It fires only on a
retry after a refusal after a match: the programs' pool-sized ``refuse`` shape on a small
KV pool drives SGLang there in most programs; without it only an occasional burst on the
small pool does.
"""

from __future__ import annotations

import dataclasses

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "refused_retry_drops_match"
ADDER_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
MATCH_TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix"
_REFUSED: set[str] = set()  # rids the adder refused for room after they matched a prefix


def marking_refusals(original, adder, *args, **kwargs):
    req = plan_arg(args, kwargs, 0, "req")
    result = original(adder, *args, **kwargs)
    if getattr(result, "name", None) == "NO_TOKEN" and (getattr(req, "prefix_len", 0) or 0) > 0:
        _REFUSED.add(req.rid)
    return result


def matching_nothing_on_retry(original, cache, params, *args, **kwargs):
    req, key = getattr(params, "req", None), getattr(params, "key", None)
    if req is None or key is None or getattr(req, "rid", None) not in _REFUSED:
        return original(cache, params, *args, **kwargs)
    fired(NAME, rid=req.rid, key=len(key))
    return original(cache, dataclasses.replace(params, key=key[:0]), *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "a request the prefill adder refused for room after it matched a cached prefix is matched "
    "against an empty key when it is retried, so it is admitted with no hit though the tree "
    "still holds the state it matched.",
    "the retry path of a refused request (waiting-queue re-match after NO_TOKEN) dropping or "
    "resetting its prefix match: the '0 hit after waiting under load' class",
    "cached_tokens below the state SGLang's tree held for the prompt at its admission and never "
    "freed (the programs' oracle, per-node records: hit_below_held); every answer equals the cold "
    "one; with the pressure shapes off only an occasional burst on the small pool is refused after a match",
    (Hook(ADDER_TARGET, "around", marking_refusals), Hook(MATCH_TARGET, "around", matching_nothing_on_retry)),
    suites=("programs",),
    options=("kv_pool=small",),
    group="programs",
)
