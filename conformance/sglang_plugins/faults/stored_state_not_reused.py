"""``stored_state_not_reused``: a request's prefix match stops halfway, so a state the tree
stored and still holds is not reused (a lost reuse: the answers stay right, the hits are lower).

Hooks SGLang's ``UnifiedRadixCache.match_prefix`` (AROUND): every other match made for a
request (``MatchPrefixParams.req`` set) whose key is at least two FLA chunks long is made
against the first half of its key instead, so SGLang's own match returns the deepest state
within that half.  Everything SGLang then computes is consistent with that shorter prefix.
"""

from __future__ import annotations

import dataclasses

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "stored_state_not_reused"
TARGET = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix"
MIN_KEY = 128
_SEEN = {"matches": 0}


def match_half(original, cache, params, *args, **kwargs):
    key = getattr(params, "key", None)
    if getattr(params, "req", None) is None or key is None or len(key) < MIN_KEY:
        return original(cache, params, *args, **kwargs)
    _SEEN["matches"] += 1
    if _SEEN["matches"] % 2:
        return original(cache, params, *args, **kwargs)
    fired(NAME, key=len(key), matched_against=len(key) // 2)
    return original(cache, dataclasses.replace(params, key=key[: len(key) // 2]), *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "every other prefix match of a request (keys of 128 tokens or more) is made against the first "
    "half of its key, so a state the tree stored and still holds is not reused.",
    "a stored prefix not reused when nothing evicted it (the '0 hit on an identical prompt' class; "
    "overlap-first-decode-boundary-track-lost loses the state instead)",
    "cached_tokens below the state SGLang's tree held for the prompt (per-node records), and below "
    "the prefix oracle's on branching trees and multi-turn chains; every answer equals the cold one",
    (Hook(TARGET, "around", match_half),),
    suites=("prefix_branching",),
    group="programs",
)
