"""Reuse efficiency: reported, never judged.

Per request whose owed hit SGLang's per-node records gave exactly, three numbers:

* **KV held** -- the KV tokens SGLang's tree held for its prompt: the longest prefix it shares
  with the prompt + output of a request answered before it was sent (since the last flush;
  the last output token has no KV; a strip-thinking request keeps its prompt only),
  page-floored.  When SGLang's eviction walk ran after that request was prefilled and before
  this one was admitted, KV may have gone: the figure is then at most (``kv_at_most``).
* **rule allows** -- the hit SGLang's storage rule allowed: its longest mamba state the tree
  held for the prompt at the admission, within the match limit (the oracle's owed hit).
* **returned** -- the ``cached_tokens`` SGLang returned.

KV held above what the rule allows is what the rule costs (a repeat of a prompt whose KV the
tree holds, answered with a hit of 0: SGLang stores mamba states only at checkpoints); it is
no finding.  Returned below what the rule allows is, elsewhere (``hit_below_held``).  Pure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

Key = tuple[int, ...]


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kv_held(tokens: Sequence[int], inserted: Iterable[tuple[str, Key]], page_size: int) -> tuple[int, str | None]:
    """(KV tokens the tree held for ``tokens``, the id of the sequence that gave them; None:
    none): the longest prefix ``tokens`` shares with a sequence the tree took (``inserted``:
    (id, its tokens)), page-floored."""
    best, who = 0, None
    for rid, seq in inserted:
        n = shared_prefix(tokens, seq) // page_size * page_size
        if n > best:
            best, who = n, rid
    return best, who


@dataclass(frozen=True)
class Reuse:
    """One request's reuse: the KV the tree held for its prompt, the hit SGLang's storage rule
    allowed, the hit it returned; ``kv_at_most``: an eviction walk may have lowered the KV figure."""

    kv_held: int
    rule_allows: int
    returned: int
    kv_at_most: bool = False


@dataclass
class ReuseTally:
    """A cell's reuse, summed over the requests counted, with counts of the cases a user reads
    (``details.reuse``): sums of the three numbers, the requests whose KV the rule did not
    allow in full, of those the ones it allowed nothing of, the requests given less than the
    rule allowed, the KV figures that are upper bounds, and the judged requests left out (their
    owed hit was only bounded: no per-node records, a session's turn, ...)."""

    requests: int = 0
    kv_held: int = 0
    rule_allows: int = 0
    returned: int = 0
    kv_beyond_rule: int = 0
    kv_held_none_allowed: int = 0
    returned_below_rule: int = 0
    kv_at_most: int = 0
    left_out: int = 0

    def note(self, r: Reuse | None) -> None:
        """Count one judged request (None: its owed hit was only bounded, left out)."""
        if r is None:
            self.left_out += 1
            return
        self.requests += 1
        self.kv_held += r.kv_held
        self.rule_allows += r.rule_allows
        self.returned += r.returned
        self.kv_beyond_rule += r.kv_held > r.rule_allows
        self.kv_held_none_allowed += r.kv_held > 0 and r.rule_allows == 0
        self.returned_below_rule += r.returned < r.rule_allows
        self.kv_at_most += r.kv_at_most

    @classmethod
    def total(cls, tallies: Iterable[ReuseTally]) -> ReuseTally:
        out = cls()
        for t in tallies:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(t, f.name))
        return out

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ReuseTally:
        return cls(**{f.name: int(raw.get(f.name) or 0) for f in fields(cls)})
