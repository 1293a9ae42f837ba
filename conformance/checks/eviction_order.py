"""Which stored prefix a radix eviction policy gives up first under KV pressure, and the
check that SGLang's first KV eviction took it.

The model is SGLang 0.5.23's (``mem_cache/evict_policy.py``; the tree core applies it only
to the full-KV component's leaf walk, a walk started by a KV shortfall; a Mamba-shortfall
walk follows the Mamba LRU list whatever the policy, ``unified_cache/components/mamba.py``).
Each policy ranks a leaf by a key, smallest evicted first:

- ``lru``: last access;
- ``lfu``: (hit count, last access);
- ``slru``: (hit count >= 2, i.e. protected, last access) -- SGLang's default protected threshold;
- ``priority``: (the highest request priority that inserted the path, last access).

``tlru`` is not modelled (its key depends on how the tree split each conversation).

The scenario (:func:`scenario`) stores prompts that share no prefix, one at a time, until the
KV pool runs short: first ``held`` (a high request priority, sent three times: the oldest
leaf, the most hit), then ``stored-1``, ``stored-2``, ... (priority 0, sent once). LRU gives up
``held`` first; LFU, SLRU and priority give up ``stored-1``.  The kit observes which state each
eviction step freed (the observe plugin's ``state_evicted`` records, named by prefix length and
digest), and which pool each walk was asked to free (``evict`` records, ``asked_num_tokens``):
the states a KV-asked walk freed are its victims.  Only the first scenario state a KV walk
freed is judged; a run where no KV walk freed one fails (nothing was judged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from conformance.records import Verdict
from conformance.token_digest import token_digest

CHECK = "eviction_order"
#: SGLang's SLRU protected threshold (``SLRUStrategy(protected_threshold=2)``, the adapter's default).
SLRU_PROTECTED_HITS = 2
#: The scenario: the held prompt's request priority and sends; every other prompt is sent once at priority 0.
HELD_PRIORITY, HELD_SENDS = 10, 3


@dataclass(frozen=True)
class Stored:
    """One prompt of the scenario as the tree saw it: its request priority, how many times
    its path was inserted (a re-insert counts a hit), and when it was last accessed (send order)."""

    name: str
    priority: int
    sends: int
    last: int

    @property
    def hits(self) -> int:
        return self.sends - 1


#: policy -> the key that ranks a leaf (smallest evicted first), SGLang 0.5.23's evict_policy.py
POLICY_KEYS: dict[str, Callable[[Stored], tuple]] = {
    "lru": lambda s: (s.last,),
    "lfu": lambda s: (s.hits, s.last),
    "slru": lambda s: (int(s.hits >= SLRU_PROTECTED_HITS), s.last),
    "priority": lambda s: (s.priority, s.last),
}


def scenario(kv_tokens: int, prompt_len: int) -> list[Stored]:
    """The stored prompts, in send order: enough to run a pool of ``kv_tokens`` short (two
    prompts past it)."""
    n = max(kv_tokens // prompt_len + 2, 2)
    held = Stored("held", HELD_PRIORITY, HELD_SENDS, HELD_SENDS - 1)
    return [held] + [Stored(f"stored-{i}", 0, 1, HELD_SENDS + i - 1) for i in range(1, n + 1)]


def first_victim(policy: str, stored: Sequence[Stored]) -> Stored | None:
    """The leaf ``policy`` evicts first among ``stored`` (None: the policy is not modelled)."""
    key = POLICY_KEYS.get(policy)
    return None if key is None or not stored else min(stored, key=key)


def kv_walk_victims(records: Iterable[Mapping[str, Any]]) -> tuple[list[tuple[int, str]], int, int]:
    """The states (prefix length, digest) freed by KV-asked eviction walks, in order, and the
    numbers of KV-asked and Mamba-only walks.  A walk's ``state_evicted`` records precede its
    ``evict`` record (the observe plugin writes the walk's record when it returns)."""
    victims: list[tuple[int, str]] = []
    pending: list[tuple[int, str]] = []
    kv_walks = other_walks = 0
    for r in records:
        if r.get("ev") == "state_evicted":
            pending.append((int(r["len"]), str(r["key"])))
        elif r.get("ev") == "evict":
            if int(r.get("asked_num_tokens", 0) or 0) > 0:
                kv_walks += 1
                victims += pending
            else:
                other_walks += 1
            pending = []
    return victims, kv_walks, other_walks


def owner(state: tuple[int, str], sequences: Mapping[str, Sequence[int]]) -> str | None:
    """Which scenario sequence a stored state (prefix length, digest) lies on (None: none)."""
    n, digest = state
    return next((name for name, seq in sequences.items() if n <= len(seq) and token_digest(seq[:n]) == digest), None)


def eviction_order_verdict(policy: str, stored: Sequence[Stored], sequences: Mapping[str, Sequence[int]],
                           records: Iterable[Mapping[str, Any]]) -> Verdict:
    """Pass when the first scenario state a KV-asked walk freed is on the prompt ``policy``
    ranks lowest; fail when another went first, when no KV walk freed one, or when the server's
    start line (in ``records``) says it records no per-node evictions (nothing judged)."""
    expected = first_victim(policy, stored)
    if expected is None:
        return Verdict(CHECK, "skip", reason=f"eviction policy {policy}: its order is not modelled")
    records = list(records)
    if any(r.get("ev") == "start" and not r.get("state_evictions") for r in records):
        return Verdict(CHECK, "fail", {}, f"eviction policy {policy}: the observe plugin's per-node eviction hooks were not in "
                       "place on this server (its start line says state_evictions false): nothing was judged")
    victims, kv_walks, other_walks = kv_walk_victims(records)
    owners = [o for o in (owner(v, sequences) for v in victims) if o is not None]
    metrics = {"kv_walks": kv_walks, "mamba_walks": other_walks, "kv_victims": len(victims), "scenario_victims": len(owners)}
    details = {"victims_in_order": owners, "stored": [s.__dict__ for s in stored]}
    if not owners:
        return Verdict(CHECK, "fail", metrics, f"eviction policy {policy}: no KV-asked eviction walk freed a state of the "
                       f"{len(stored)} stored prompts ({kv_walks} KV walks, {other_walks} Mamba walks): the fill never "
                       "ran the KV pool short, nothing was judged", details)
    got = next(s for s in stored if s.name == owners[0])
    if got.name == expected.name:
        return Verdict(CHECK, "pass", metrics, "", details)
    return Verdict(CHECK, "fail", metrics, f"eviction policy {policy}: the first KV eviction took {_describe(got)}, while "
                   f"{_describe(expected)} ranks lower (evicted first under {policy})", details)


def _describe(s: Stored) -> str:
    return f"{s.name} (priority {s.priority}, {s.hits} hits, last access #{s.last})"
