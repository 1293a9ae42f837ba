"""A hit against what SGLang's tree held for the prompt at the admission (the observe plugin's
per-node ``state_stored`` / ``state_evicted`` records): the rule the programs' oracle and the
scripted suites share.  Pure.

SGLang's match owes a request the longest state the tree held for a prefix of its input
(within the match limit): taken before the admission and not freed since.  A lower
``cached_tokens`` is ``hit_below_held``; so is a shortfall below a state the tree took and
then freed by anything other than its eviction walk (with a per-path cap, also an insert:
the cap runs inside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from conformance.checks.findings import Finding


@dataclass(frozen=True)
class Expected:
    """The hit SGLang owed a request: ``exact`` from its per-node records (``owed``: its
    longest state the tree held at the admission; ``freed``: the states it took and freed
    before it, with what freed them), else bounded by the prefix model alone (``why``)."""

    exact: bool
    owed: int = 0
    why: str = ""
    freed: Mapping[int, set[str]] = field(default_factory=dict)

    def finding(self, hit: int, input_len: int, *, path_cap: bool = False) -> Finding | None:
        """``hit`` against what the tree held (``path_cap``: the server caps states per path,
        so an insert's free excuses too): a ``hit_below_held`` finding, or None (also when
        the owed hit is only bounded: settled by the records, never by a permission)."""
        if not self.exact:
            return None
        facts = {"cached_tokens": hit, "input": input_len, "held": self.owed}
        if hit < self.owed:
            return Finding("hit_below_held", f"cached_tokens {hit}: SGLang held a state of {self.owed} tokens for this prompt and reused "
                           f"{hit}; nothing freed it (input {input_len} tokens; per-node records)", facts)
        excused = {"walk"} | ({"insert"} if path_cap else set())
        outside = {n: sorted(by) for n, by in self.freed.items() if n > hit and not by & excused}
        if outside:
            n = max(outside)
            return Finding("hit_below_held", f"cached_tokens {hit}: SGLang's tree took a state of {n} tokens for this prompt and freed it "
                           f"outside its eviction walk (by {', '.join(outside[n])}) before the admission (input {input_len} tokens; "
                           "per-node records)", {**facts, "freed": n, "freed_by": outside[n]})
        return None


def summary(exact: int, bounded: Mapping[str, int]) -> str:
    """Per cell, whether the hit SGLang owed each judged request was exact (``exact`` requests:
    its per-node records) or only bounded (``bounded``: why -> how many), and why."""
    if not bounded:
        return f"exact ({exact} requests)" if exact else "no request judged"
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(bounded.items(), key=lambda kv: -kv[1]))
    return f"exact for {exact} requests, bounded for {sum(bounded.values())} ({why})" if exact else f"bounded: {why}"


def tally(owed: Iterable[Expected]) -> tuple[int, dict[str, int]]:
    """(how many owed hits were exact, why -> how many were only bounded): :func:`summary`'s input."""
    exact, bounded = 0, dict[str, int]()
    for e in owed:
        if e.exact:
            exact += 1
        else:
            bounded[e.why] = bounded.get(e.why, 0) + 1
    return exact, bounded
