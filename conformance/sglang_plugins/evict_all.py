"""Evict, don't flush: SGLang's own eviction walk over everything its tree holds, on the kit's request.

``/flush_cache`` drops SGLang's tree without running its eviction walk, so the shapes a
program built (splits at page boundaries, session leaves, chains of checkpoints) would never
be evicted by SGLang's own code.  The programs' runner therefore ends each program (and
precedes a mid-program flush) by writing a request file beside the server's per-request
evidence file (:func:`request_path`, its content an id); the observe plugin, at its next idle
publish with no request running or waiting, removes the file and calls the tree's own
``evict`` entry point with :class:`EvictParams` covering what the tree holds (its evictable KV
tokens and Mamba states), then writes one ``evict_all`` record: the id, what the walk freed
and what the tree still holds (evictable and protected tokens and Mamba states).  The states
the walk frees are recorded per node by the observe plugin's state hooks, ``by`` the walk,
and judged like any eviction.  Both tree cores are driven: ``UnifiedRadixCache.evict`` runs
the walk over the tree core behind it (Python or Rust).  A release whose tree takes no
``EvictParams`` answers with an ``error`` record naming SGLang's own line.

Imported inside SGLang's scheduler process and by the kit: standard library only.
"""

from __future__ import annotations

import os
from typing import Any

#: The request file's suffix, beside the per-request evidence file.
REQUEST_SUFFIX = ".evict-all"
#: ``EvictResult``'s fields: what the walk freed.
FREED = ("num_tokens_evicted", "swa_num_tokens_evicted", "mamba_num_evicted")
#: What the tree still holds, each by the first of its own size readers the release has and
#: answers (``MambaRadixCache`` up to 0.5.18 raises NotImplementedError from ``evictable_size``
#: and ``protected_size`` and answers ``full_evictable_size`` / ``full_protected_size``).
HELD = {"evictable_size": ("evictable_size", "full_evictable_size"), "protected_size": ("protected_size", "full_protected_size"),
        "mamba_evictable_size": ("mamba_evictable_size",), "mamba_protected_size": ("mamba_protected_size",)}
#: What an emptied tree may still hold that a walk must have freed (protected is the live requests' and sessions').
EVICTABLE = ("evictable_size", "mamba_evictable_size")


def request_path(requests_path: str | None) -> str | None:
    """Where the kit asks ``requests_path``'s server for an eviction walk over its whole tree."""
    return requests_path + REQUEST_SUFFIX if requests_path else None


def held(tree: Any) -> dict[str, int]:
    """What the tree holds, by its own size readers (those the release has and answers)."""
    out: dict[str, int] = {}
    for name, readers in HELD.items():
        for reader in readers:
            read = getattr(tree, reader, None)
            if not callable(read):
                continue
            try:
                out[name] = int(read())
                break
            except (NotImplementedError, TypeError):  # a reader the release declares but does not answer
                continue
    return out


def serve(scheduler: Any, requests_path: str | None) -> dict[str, Any] | None:
    """Answer a pending request (None: none pending, or the scheduler is not idle yet)."""
    path = request_path(requests_path)
    if not path or not os.path.exists(path) or scheduler.running_batch.reqs or scheduler.waiting_queue:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        os.remove(path)
    except OSError:
        return None
    tree = scheduler.tree_cache
    try:  # the request was taken: it is answered, with SGLang's own error when the walk cannot run
        before = held(tree)
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        result = tree.evict(EvictParams(num_tokens=before.get("evictable_size", 0), mamba_num=before.get("mamba_evictable_size", 0)))
        return {"ev": "evict_all", "id": token, "tree": type(tree).__name__, "before": before,
                "freed": {f: int(getattr(result, f, 0) or 0) for f in FREED}, "held": held(tree)}
    except Exception as e:  # the release's tree cannot be driven this way: say which and why
        return {"ev": "evict_all", "id": token, "tree": type(tree).__name__, "error": f"{type(e).__name__}: {e}"[:300]}


def left_held(record: dict[str, Any]) -> dict[str, int]:
    """What an answered walk left that it must have freed (empty: the tree holds only root and protected nodes)."""
    return {k: v for k, v in (record.get("held") or {}).items() if k in EVICTABLE and v}
