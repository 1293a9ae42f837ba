"""Which stored prefix a radix eviction policy gives up first under KV pressure, and the
check that SGLang's first KV eviction took it.

The model is SGLang 0.5.23's (``mem_cache/evict_policy.py``; the tree core applies it only
to the full-KV component's leaf walk, a walk started by a KV shortfall; a Mamba-shortfall
walk follows the Mamba LRU list whatever the policy, ``unified_cache/components/mamba.py``).
Each policy ranks a leaf by a key, smallest evicted first:

- ``lru``: last access;
- ``lfu``: (hit count, last access);
- ``slru``: (hit count >= 2, i.e. protected, last access) -- SGLang's default protected threshold;
- ``priority``: (the highest request priority that inserted the path, last access);
- ``tlru``: (-1 when the leaf is "TEL-safe", else 0; last access).  A leaf is TEL-safe when the
  prefix cached above it is at least ``history + next_prompt_estimate - threshold`` tokens
  (``history``: the deepest the branch ever reached).  That depends on where the tree split
  each path, so the model reads the splits from SGLang's own records: every mamba state the
  tree took on a path (``state_stored``) ends a node there (:func:`path_splits`).  With a
  buffer SGLang cuts every path a chunk before its end, so every tail is free to evict and
  goes first under tlru as under LRU: tlru is judged on its whole first KV walk
  (:func:`walk_order`), not on its first victim.

The scenario (:func:`scenario`) stores prompts that share no prefix, one at a time, until the
KV pool runs short: first ``held`` (a high request priority, sent three times: the oldest
leaf, the most hit), then ``stored-1``, ``stored-2``, ... (priority 0, sent once). LRU gives up
``held`` first; LFU, SLRU and priority give up ``stored-1``.  For tlru the stored prompts are
short (TEL-safe whatever the splits): ``held`` goes first only if its own leaf is TEL-safe.  The kit observes which state each
eviction step freed (the observe plugin's ``state_evicted`` records, named by prefix length and
digest), and which pool each walk was asked to free (``evict`` records, ``asked_num_tokens``):
the states a KV-asked walk freed are its victims.  Only the first scenario state a KV walk
freed is judged; a run where no KV walk freed one fails (nothing was judged), unless
Mamba-asked walks freed the scenario's states first (a cell whose Mamba pool runs short
before its KV pool: small chunks store a state per chunk): that cell's KV order is not
observable through the states, and the verdict says so with the walks' numbers.  A tree that
walks its own LRU lists (MambaRadixCache up to 0.5.15) takes no policy: not applicable there.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from conformance.records import Verdict
from conformance.sglang_plugins.observe import LRU_LISTS
from conformance.sglang_plugins.token_digest import token_digest

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
    length: int = 0  # the prompt's tokens

    @property
    def hits(self) -> int:
        return self.sends - 1


@dataclass(frozen=True)
class Tlru:
    """The tlru policy's configuration (``--radix-eviction-policy-config``), in tokens."""

    threshold: int
    next_prompt_estimate: int

    def tel_safe(self, splits: Sequence[int], node: int | None = None) -> bool:
        """Is node ``node`` (default: the leaf) of a path whose nodes end at ``splits``
        (ascending; the last is the path's depth, also its high-water history) free to evict
        before the rest: is the prefix cached above it at least what tlru keeps of the path?"""
        i = len(splits) - 1 if node is None else node
        above = splits[i - 1] if i > 0 else 0
        depth = splits[-1] if splits else 0
        return above >= max(depth + self.next_prompt_estimate - self.threshold, 0)


#: policy -> the key that ranks a leaf (smallest evicted first), SGLang 0.5.23's evict_policy.py;
#: tlru's key also needs the path's splits (:func:`first_victim`)
POLICY_KEYS: dict[str, Callable[[Stored], tuple]] = {
    "lru": lambda s: (s.last,),
    "lfu": lambda s: (s.hits, s.last),
    "slru": lambda s: (int(s.hits >= SLRU_PROTECTED_HITS), s.last),
    "priority": lambda s: (s.priority, s.last),
}


def scenario(kv_tokens: int, prompt_len: int, stored_len: int | None = None) -> list[Stored]:
    """The stored prompts, in send order: ``held`` of ``prompt_len`` tokens, then enough
    prompts of ``stored_len`` (default ``prompt_len``) tokens to run a pool of ``kv_tokens``
    short (two prompts past it)."""
    stored_len = stored_len or prompt_len
    n = max(kv_tokens // stored_len + 2, 2)
    held = Stored("held", HELD_PRIORITY, HELD_SENDS, HELD_SENDS - 1, prompt_len)
    return [held] + [Stored(f"stored-{i}", 0, 1, HELD_SENDS + i - 1, stored_len) for i in range(1, n + 1)]


def tlru_stored_len(tlru: Tlru, page: int = 1) -> int:
    """A prompt length TEL-safe however its path is split (history + estimate <= threshold)."""
    return max((tlru.threshold - tlru.next_prompt_estimate) // 2 // page * page, page)


def first_victim(policy: str, stored: Sequence[Stored], *, tlru: Tlru | None = None,
                 splits: Mapping[str, Sequence[int]] | None = None) -> Stored | None:
    """The leaf ``policy`` evicts first among ``stored`` (None: the policy is not modelled, or
    tlru without its configuration and the paths' splits)."""
    if not stored:
        return None
    if policy == "tlru":
        if tlru is None or splits is None:
            return None
        name = walk_order(stored, splits, tlru_node_key(tlru))[0][0]
        return next(s for s in stored if s.name == name)
    key = POLICY_KEYS.get(policy)
    return None if key is None else min(stored, key=key)


def path_splits(sequences: Mapping[str, Sequence[int]], records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Per scenario sequence, the prefix lengths where SGLang's tree took a mamba state on it
    (``state_stored`` records), ascending: each ends a node of that path."""
    out: dict[str, set[int]] = {name: set() for name in sequences}
    for r in records:
        if r.get("ev") == "state_stored":
            name = owner((int(r["len"]), str(r["key"])), sequences)
            if name is not None:
                out[name].add(int(r["len"]))
    return {name: tuple(sorted(lens)) for name, lens in out.items()}


def _walks(records: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, int, list[tuple[int, str]], bool]]:
    """Each eviction walk as (the index of the record after the walk before it, the index of
    its own ``evict`` record, the states (prefix length, digest) it freed in order, whether a
    KV shortfall asked for it).  A walk's ``state_evicted`` records precede its ``evict``
    record (the observe plugin writes the walk's record when it returns)."""
    pending: list[tuple[int, str]] = []
    start = 0
    for i, r in enumerate(records):
        if r.get("ev") == "state_evicted":
            pending.append((int(r["len"]), str(r["key"])))
        elif r.get("ev") == "evict":
            yield start, i, pending, int(r.get("asked_num_tokens", 0) or 0) > 0
            pending, start = [], i + 1


def kv_walks(records: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[int, int, list[tuple[int, str]]]], int]:
    """Each KV-asked eviction walk as (the index of the record after the walk before it --
    nothing of this walk precedes it --, the index of its own ``evict`` record, the states it
    freed in order), and the number of Mamba-only walks."""
    walks = list(_walks(records))
    return [(start, end, freed) for start, end, freed, kv in walks if kv], sum(not kv for *_, kv in walks)


def mamba_walk_victims(records: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """The states freed by walks no KV shortfall asked for (a Mamba shortfall: LRU whatever the policy)."""
    return [v for _, _, freed, kv in _walks(records) if not kv for v in freed]


def kv_walk_victims(records: Iterable[Mapping[str, Any]]) -> tuple[list[tuple[int, str]], int, int]:
    """The states freed by KV-asked eviction walks, in order, and the numbers of KV-asked
    and Mamba-only walks."""
    walks, other_walks = kv_walks(list(records))
    return [v for _, _, freed in walks for v in freed], len(walks), other_walks


def walk_order(stored: Sequence[Stored], splits: Mapping[str, Sequence[int]], key: Callable[[Stored, int, Sequence[int]], tuple]) -> list[tuple[str, int]]:
    """The nodes one KV walk frees, in order, as (prompt, node end): each prompt's path cut
    into nodes at its ``splits`` (a prompt without any: one node), the leaves ranked by
    ``key(prompt, node index, node ends)`` (smallest first), a parent joining the leaves
    when its child goes."""
    heap = []
    for s in stored:
        ends = tuple(splits.get(s.name) or (s.length,))
        heap.append((key(s, len(ends) - 1, ends), s.last, s.name, len(ends) - 1, ends, s))
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, name, i, ends, s = heapq.heappop(heap)
        order.append((name, ends[i]))
        if i > 0:
            heapq.heappush(heap, (key(s, i - 1, ends), s.last, name, i - 1, ends, s))
    return order


def tlru_node_key(tlru: Tlru) -> Callable[[Stored, int, Sequence[int]], tuple]:
    """tlru's rank of a path's node: free to evict first, then last access."""
    return lambda s, i, ends: (-1 if tlru.tel_safe(ends, i) else 0, s.last)


def owner(state: tuple[int, str], sequences: Mapping[str, Sequence[int]]) -> str | None:
    """Which scenario sequence a stored state (prefix length, digest) lies on (None: none)."""
    n, digest = state
    return next((name for name, seq in sequences.items() if n <= len(seq) and token_digest(seq[:n]) == digest), None)


def eviction_order_verdict(policy: str, stored: Sequence[Stored], sequences: Mapping[str, Sequence[int]],
                           records: Iterable[Mapping[str, Any]], *, tlru: Tlru | None = None) -> Verdict:
    """Pass when the first scenario state a KV-asked walk freed is on the prompt ``policy``
    ranks lowest; fail when another went first, when no KV walk freed one, or when the server's
    start line (in ``records``) says it records no per-node evictions (nothing judged)."""
    records = list(records)
    splits = path_splits(sequences, records) if policy == "tlru" else None
    expected = first_victim(policy, stored, tlru=tlru, splits=splits)
    if expected is None:
        return Verdict(CHECK, "skip", reason=f"eviction policy {policy}: its order is not modelled")
    if any(r.get("ev") == "start" and not r.get("state_evictions") for r in records):
        return Verdict(CHECK, "fail", {}, f"eviction policy {policy}: the observe plugin's per-node eviction hooks were not in "
                       "place on this server (its start line says state_evictions false): nothing was judged")
    lists = sorted({str(r.get("tree")) for r in records if r.get("ev") == "evict" and r.get("order") == LRU_LISTS})
    if lists and policy != "lru":
        return Verdict(CHECK, "skip", {}, f"not applicable: sglang served this cell with {', '.join(lists)}, whose eviction walks "
                       f"follow its own LRU lists (it has no eviction strategy): --radix-eviction-policy {policy} does not reach them")
    victims, n_kv, other_walks = kv_walk_victims(records)
    owners = [o for o in (owner(v, sequences) for v in victims) if o is not None]
    metrics = {"kv_walks": n_kv, "mamba_walks": other_walks, "kv_victims": len(victims), "scenario_victims": len(owners)}
    details = {"victims_in_order": owners, "stored": [s.__dict__ for s in stored]}
    if not owners and (taken := [o for o in (owner(v, sequences) for v in mamba_walk_victims(records)) if o is not None]):
        return Verdict(CHECK, "skip", metrics, f"not applicable on this cell: no KV-asked eviction walk freed a state of the {len(stored)} "
                       f"stored prompts, Mamba-asked walks (LRU whatever the policy) freed {len(taken)} of them ({n_kv} KV walks, "
                       f"{other_walks} Mamba walks): the Mamba pool runs short first, and the KV order is not observable through "
                       "the states", details)
    taken = {name for name, at in (splits if splits is not None else path_splits(sequences, records)).items() if at}
    saw_fill = bool(taken) or any(r.get("ev") == "prefill" for r in records)  # the plugin saw the fill (else: vacuous)
    if not owners and not n_kv and not other_walks and taken <= {"held"} and saw_fill:  # no state taken on the fill's prompts
        return Verdict(CHECK, "skip", metrics, f"not applicable on this cell: SGLang's tree took no Mamba state on any of the "
                       f"{len(stored) - 1} prompts the fill stored{'' if taken else ' (nor on held)'} (per-node records: they end "
                       "below the strategy's first checkpoint, or its chunked prefill skips the checkpoints), so it kept none of "
                       "their KV and no eviction walk ran", details)
    if not owners:
        return Verdict(CHECK, "fail", metrics, f"eviction policy {policy}: no KV-asked eviction walk freed a state of the "
                       f"{len(stored)} stored prompts ({n_kv} KV walks, {other_walks} Mamba walks): the fill never "
                       "ran the KV pool short, nothing was judged", details)
    if tlru is not None and policy == "tlru":
        return _tlru_verdict(tlru, stored, sequences, records, metrics, details)
    got = next(s for s in stored if s.name == owners[0])
    if got.name == expected.name:
        return Verdict(CHECK, "pass", metrics, "", details)
    return Verdict(CHECK, "fail", metrics, f"eviction policy {policy}: the first KV eviction took {_describe(got)}, while "
                   f"{_describe(expected)} ranks lower (evicted first under {policy})", details)


def _tlru_verdict(tlru: Tlru, stored: Sequence[Stored], sequences: Mapping[str, Sequence[int]], records: list[Mapping[str, Any]],
                  metrics: dict, details: dict) -> Verdict:
    """tlru trims each path's tail (a short leaf under a deep cached prefix is free to
    evict) before anything else, so one victim rarely tells it from LRU: the whole first KV
    walk that freed a scenario state is judged, against tlru's order over the tree SGLang
    had built by then (its ``state_stored`` records; states a Mamba walk already took free
    nothing when their node goes)."""
    walks, _ = kv_walks(records)
    start, end, freed = next(w for w in walks if any(owner(v, sequences) for v in w[2]))
    seen = [o for o in (owner(v, sequences) for v in freed) if o is not None]
    splits = path_splits(sequences, records[:end])  # the states the tree took before the walk ended
    before = records[:start]  # states freed before this walk began
    present = [s for s in stored if splits.get(s.name)]
    silent = {(o, n) for n, d in (v for v in (_evicted(r) for r in before) if v) if (o := owner((n, d), sequences))}

    def order(key: Callable[[Stored, int, Sequence[int]], tuple]) -> list[str]:
        return [name for name, end in walk_order(present, splits, key) if (name, end) not in silent][: len(seen)]

    model, lru = order(tlru_node_key(tlru)), order(lambda s, i, ends: (s.last,))
    metrics["differs_from_lru"] = int(model != lru)  # does this run tell tlru from plain LRU?
    details.update(first_walk=seen, tlru_order=model, lru_order=lru, held_splits=list(splits.get("held", ())))
    if seen == model:
        return Verdict(CHECK, "pass", metrics, "", details)
    return Verdict(CHECK, "fail", metrics, f"eviction policy tlru: the first KV walk freed the states of {seen}, while tlru's "
                   f"order over the tree SGLang had built (each path cut where it stored a state) is {model}", details)


def _evicted(r: Mapping[str, Any]) -> tuple[int, str] | None:
    return (int(r["len"]), str(r["key"])) if r.get("ev") == "state_evicted" else None


def _describe(s: Stored) -> str:
    return f"{s.name} (priority {s.priority}, {s.hits} hits, last access #{s.last})"
