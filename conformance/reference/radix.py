"""The reference engine's radix prefix cache (the kit's own, modelled on SGLang's
UnifiedRadixCache with its full-KV and mamba components).

Edges hold token ids; every token on an edge holds one KV token of the token pool.  A node
may hold a :class:`Snapshot` (a mamba slot plus the model state after the node's last
token): only such nodes can end a hit, so a hit is the deepest snapshot node on the matched
path.  Nodes on a running request's matched path are locked (``lock_ref``) and never
evicted.  Eviction is LRU: a snapshot on an inner node is dropped alone (its KV stays, as
SGLang keeps full KV when it evicts a mamba state); a leaf goes with its KV, and leaves left
without a snapshot are removed in cascade.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

_clock = itertools.count(1)


@dataclass
class Snapshot:
    """A cached state: the mamba slot that holds it, the model state, and the next-token
    log-prob row after its last token (so input logprobs need no recomputation)."""

    slot: int
    state: Any
    last_row: Any
    stale: bool = False


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    lock_ref: int = 0
    last_access: int = 0

    @property
    def depth(self) -> int:
        d, n = 0, self
        while n is not None:
            d += len(n.key)
            n = n.parent
        return d


@dataclass(frozen=True)
class Match:
    node: Node  # deepest node with a snapshot on the matched path (root when none)
    hit_len: int  # its depth: the mamba-floored hit
    kv_hit_len: int  # tokens matched by full KV


class RadixCache:
    """Prefix tree over token ids.  ``free_slot(slot)`` and ``free_tokens(n)`` give evicted
    resources back to the pools; ``stale_evict_locked`` is the evict_running_slot fault."""

    def __init__(self, free_slot: Callable[[int], None], free_tokens: Callable[[int], None]) -> None:
        self.root = Node()
        self._free_slot = free_slot
        self._free_tokens = free_tokens
        self.stale_evict_locked = False
        self.split_moves_snapshot = False  # seeded fault: a split hands the child's snapshot to the upper node
        self.evictions = 0  # snapshots and leaves evicted under pressure (not flushes)

    # ------------------------------------------------------------ lookups
    def match(self, tokens, limit: int) -> Match:
        """Longest cached prefix of ``tokens[:limit]``; refreshes LRU along the hit."""
        node, depth, kv_len = self.root, 0, 0
        best, best_len = self.root, 0
        tokens = tuple(tokens[:limit])
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_len(child.key, tokens[depth:])
            kv_len = depth + common
            if common < len(child.key):
                break
            node, depth = child, depth + common
            if node.snapshot is not None:
                best, best_len = node, depth
        now = next(_clock)
        n = best
        while n is not None:
            n.last_access = now
            n = n.parent
        return Match(best, best_len, kv_len)

    def nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                yield n
            stack.extend(n.children.values())

    # ------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------ insert
    def insert(self, tokens, snapshot: Snapshot) -> tuple[int, bool]:
        """Insert ``tokens`` with ``snapshot`` at its end.  Returns (new KV tokens now held
        by the tree, whether the snapshot was taken; False when one already exists)."""
        tokens = tuple(tokens)
        assert tokens, "empty insert"
        node, depth, new_tokens = self.root, 0, 0
        now = next(_clock)
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = Node(key=tokens[depth:], parent=node, last_access=now)
                node.children[tokens[depth]] = leaf
                new_tokens += len(leaf.key)
                node, depth = leaf, len(tokens)
                break
            common = _common_len(child.key, tokens[depth:])
            if common < len(child.key):
                child = self._split(child, common)
            node, depth = child, depth + common
            node.last_access = now
        if node.snapshot is not None:
            return new_tokens, False
        node.snapshot = snapshot
        return new_tokens, True

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; the new upper node has no snapshot."""
        parent = child.parent
        upper = Node(key=child.key[:at], parent=parent, lock_ref=child.lock_ref, last_access=child.last_access)
        parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        if self.split_moves_snapshot and child.snapshot is not None:
            upper.snapshot, child.snapshot = child.snapshot, None
        return upper

    # ------------------------------------------------------------ accounting
    def mamba_counts(self) -> tuple[int, int]:
        """(evictable, protected) snapshot slots."""
        ev = pr = 0
        for n in self.nodes():
            if n.snapshot is not None:
                if n.lock_ref:
                    pr += 1
                else:
                    ev += 1
        return ev, pr

    def kv_counts(self) -> tuple[int, int]:
        """(evictable, protected) KV tokens."""
        ev = pr = 0
        for n in self.nodes():
            if n.lock_ref:
                pr += len(n.key)
            else:
                ev += len(n.key)
        return ev, pr

    # ------------------------------------------------------------ eviction
    def evict_mamba(self, count: int) -> int:
        """Free up to ``count`` snapshot slots, least recently used first."""
        freed = 0
        while freed < count:
            cands = [n for n in self.nodes() if n.snapshot is not None and not n.snapshot.stale
                     and (n.lock_ref == 0 or self.stale_evict_locked)]
            if not cands:
                break
            if self.stale_evict_locked:  # the fault: locked (running) nodes go first
                victim = min(cands, key=lambda n: (n.lock_ref == 0, n.last_access))
            else:
                victim = min(cands, key=lambda n: n.last_access)
            self._free_slot(victim.snapshot.slot)
            freed += 1
            self.evictions += 1
            if victim.lock_ref:
                victim.snapshot.stale = True  # freed while referenced: a later free repeats it
                continue
            victim.snapshot = None
            if not victim.children:
                self._remove_leaf(victim)
        return freed

    def evict_tokens(self, count: int) -> int:
        """Free at least ``count`` KV tokens by removing unlocked leaves, LRU first."""
        freed = 0
        while freed < count:
            leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            freed += self._remove_leaf(victim)
            self.evictions += 1
        return freed

    def _remove_leaf(self, leaf: Node) -> int:
        """Remove ``leaf`` and then its parents left as snapshot-less unlocked leaves."""
        freed = 0
        node = leaf
        while node is not self.root and not node.children and node.lock_ref == 0:
            if node.snapshot is not None:
                if node is not leaf:
                    break
                self._free_slot(node.snapshot.slot)
                node.snapshot = None
            parent = node.parent
            del parent.children[node.key[0]]
            self._free_tokens(len(node.key))
            freed += len(node.key)
            node = parent
        return freed

    def reset(self) -> None:
        """Forget every entry without giving anything back (SGLang's ``tree_cache.reset``);
        the caller rebuilds the pools' free lists, as SGLang's flush does."""
        self.root = Node()

    def flush(self) -> bool:
        """Drop every entry, freeing what each held; refused (False) while any node is locked."""
        if any(n.lock_ref for n in self.nodes()):
            return False
        for n in list(self.nodes()):
            if n.snapshot is not None:
                self._free_slot(n.snapshot.slot)
            self._free_tokens(len(n.key))
        self.root = Node()
        return True


def _common_len(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
