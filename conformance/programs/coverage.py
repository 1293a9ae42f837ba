"""The programs' coverage counters: how often SGLang was seen under memory pressure.

Every count is read from SGLang-side evidence, the observe plugin's per-request file
(:class:`conformance.programs.evidence.RequestLog`), never from what the kit sent:

* ``refused_after_match`` -- requests SGLang's prefill adder refused for lack of KV or Mamba
  room (``NO_TOKEN``) after matching a cached prefix (the plugin's ``refused`` records);
* ``matched_then_evicted`` -- of those, the ones whose matched state SGLang's tree freed
  (per-node ``state_evicted``) after the refusal and before the request's last admission;
* ``retractions`` -- requests SGLang's ``retract_decode`` retracted;
* ``eviction_walks`` -- eviction walks that evicted anything (``evict`` records);
* ``nodes_evicted`` -- tree states the eviction walk freed (per-node, ``by`` the walk);
* ``splits`` -- tree node splits (seen where the tree runs in Python; None on a Rust tree core);
* ``tree_audits`` -- tree audits run: the audit's own counter (``tree_audits_total`` on
  ``/metrics``), never the request log; :func:`program_coverage` puts it in.

A counter is None where the server records no such evidence (no per-request file: the
reference target; a release without the hook point: the start line's ``pressure``; a hook
whose observer failed on this server: its ``observer_error`` record).
:func:`vacuous_pressure` is the rule that turns a pressure cell's run red when the counters
its small pool must move stayed 0 (``AxisValue.coverage``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Sequence

from conformance.programs.evidence import RequestLog

#: counter -> the start line's ``pressure`` hook it needs (None: always read when the file exists)
NEEDS_HOOK = {"refused_after_match": "refused", "matched_then_evicted": "refused", "retractions": "retract", "splits": "split"}


@dataclass(frozen=True)
class Coverage:
    """The coverage counters of one program (or a sum of them); None: not recorded."""

    refused_after_match: int | None = None
    matched_then_evicted: int | None = None
    retractions: int | None = None
    eviction_walks: int | None = None
    nodes_evicted: int | None = None
    splits: int | None = None
    tree_audits: int | None = None

    def to_json(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def minus(self, before: "Coverage") -> "Coverage":
        """What grew since ``before`` (a counter unrecorded on either side stays None)."""
        return Coverage(**{k: None if v is None or before.to_json()[k] is None else v - before.to_json()[k]
                           for k, v in self.to_json().items()})

    @classmethod
    def total(cls, runs: Iterable["Coverage"]) -> "Coverage":
        """The sum over programs (None where no program recorded it)."""
        out: dict[str, int | None] = dict.fromkeys(f.name for f in fields(cls))
        for run in runs:
            for k, v in run.to_json().items():
                if v is not None:
                    out[k] = (out[k] or 0) + v
        return cls(**out)


def read_coverage(log: RequestLog | None) -> Coverage:
    """The cumulative counters of everything ``log`` has read so far (a program's are the
    difference of two readings, :meth:`Coverage.minus`)."""
    if log is None or not log.started:
        return Coverage()
    hooked = set(log.pressure or ()) - set(log.observer_errors)  # a hook whose observer failed recorded nothing it can vouch for
    walk_frees = sum(1 for by in log.freed_by.values() if by == "walk")
    counts: dict[str, Any] = {
        "refused_after_match": len({rid for rid, _, _ in log.refused.values()}),
        "matched_then_evicted": _matched_then_evicted(log),
        "retractions": len(log.retracted),
        "eviction_walks": len(log.evictions_at),
        "nodes_evicted": walk_frees if log.per_node else None,
        "splits": log.events.get("split", 0),
    }
    for name, hook in NEEDS_HOOK.items():
        if hook not in hooked:
            counts[name] = None
    if "tree_core" in log.observer_errors or (log.tree_core and "rust" in log.tree_core.lower()):
        counts["splits"] = None  # a Rust tree core splits inside Rust: not seen (and an unknown core may be Rust)
    return Coverage(**counts)


def program_coverage(now: Coverage, before: Coverage, audits: float | None) -> Coverage:
    """One program's counters: what grew in the request log since ``before``, and the tree
    audits the audit's own counter counted over the program (None: the server does not audit)."""
    return replace(now.minus(before), tree_audits=None if audits is None else int(audits))


def _matched_then_evicted(log: RequestLog) -> int:
    """Refused requests whose matched state the tree freed after the refusal and before the
    request's last admission (or since, when it was not admitted again yet)."""
    out = set()
    for at, (rid, n, key) in log.refused.items():
        end = log.admitted_at.get(rid)
        end = end if end is not None and end > at else float("inf")
        if any(at < e < end for e in log.states_evicted.get((n, key), ())):
            out.add(rid)
    return len(out)


def vacuous_pressure(coverage: Coverage, required: Sequence[str]) -> list[str]:
    """The counters of ``required`` that stayed 0 (a counter not recorded is named too: the
    run could not show it moved).  Empty: the pressure the cell is for was reached."""
    values = coverage.to_json()
    return [f"{name} {'not recorded' if values[name] is None else 'stayed 0'}" for name in required if not values[name]]
