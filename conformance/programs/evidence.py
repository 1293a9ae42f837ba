"""What SGLang was seen doing during a program, for the oracle's relaxations to rest on.

The oracle allows a hit below the best stored prefix only where something in the same run
shows why: an eviction counted on SGLang's eviction path, a prefill that SGLang's
scheduler cut.  Both are cumulative counters on ``/metrics`` (exported by the kit's
observe plugin inside real SGLang, ``conformance/sglang_plugins/observe.py``, and by the
reference server under the same names).  The runner scrapes them whenever answers
arrive, stamped with the program clock (the sequence numbers of requests' send and
answer), so a relaxation asks "did the counter grow between these two moments?".
Pure bookkeeping: the runner does the I/O.
"""

from __future__ import annotations

from typing import Any, Mapping

#: evidence name -> the counter on /metrics it is read from
COUNTERS: dict[str, str] = {
    "evictions": "hybrid_conformance:evictions_total",
    "prefill_cuts": "hybrid_conformance:prefill_cuts_total",
}


def missing_counters(values: Mapping[str, float]) -> list[str]:
    """The evidence counters a ``/metrics`` scrape lacks."""
    return [metric for metric in COUNTERS.values() if metric not in values]


class Evidence:
    """Scrapes of the evidence counters since the last flush, in program-clock order."""

    def __init__(self) -> None:
        self.scrapes: list[tuple[int, dict[str, float | None]]] = []

    def reset(self, seq: int, values: Mapping[str, float]) -> None:
        """A flush (or the program's start): the baseline every window starts from."""
        self.scrapes = []
        self.note(seq, values)

    def note(self, seq: int, values: Mapping[str, float]) -> None:
        self.scrapes.append((seq, {name: values.get(metric) for name, metric in COUNTERS.items()}))

    def stale(self, seq: int) -> bool:
        """No scrape was taken at or after clock ``seq`` (a window ending there would be
        read against an older scrape: scrape again before judging it)."""
        return not any(s >= seq for s, _ in self.scrapes)

    def grew(self, name: str, lo: int, hi: int) -> bool | None:
        """Did counter ``name`` grow between clock ``lo`` and clock ``hi``?  Read at the last
        scrape at or before ``lo`` (else the baseline) and the first at or after ``hi``
        (else the latest).  None: the counter is not exported (no evidence either way)."""
        if not self.scrapes:
            return None
        before = [v for s, v in self.scrapes if s <= lo] or [self.scrapes[0][1]]
        after = [v for s, v in self.scrapes if s >= hi] or [self.scrapes[-1][1]]
        a, b = before[-1].get(name), after[0].get(name)
        if a is None or b is None:
            return None
        return b > a


#: The gauges the hit oracle sizes its eviction bound by (besides the evidence counters).
ORACLE_GAUGES = ("hybrid_conformance:mamba_total",)


def refuse_missing(values: Mapping[str, float], *, target: str, attempts: Any = None) -> None:
    """On a target whose servers load the kit's plugins (real SGLang), a gauge or counter
    the oracle depends on that ``/metrics`` lacks is a KitError, not a silently permissive
    oracle.  ``attempts``: more scrapes to try first (the observe plugin publishes at the
    first idle moment)."""
    from conformance.errors import KitError
    from conformance.targets.registry import target_for

    if not target_for(target).kit_plugins:
        return
    for more in [None, *(attempts or ())]:
        values = more() if more is not None else values
        missing = [m for m in (*ORACLE_GAUGES, *COUNTERS.values()) if m not in values]
        if not missing:
            return
    raise KitError(f"the server's /metrics lacks {', '.join(missing)}: the programs' oracle depends on it "
                   "(is the observe plugin loaded? see its <log>.plugins.jsonl)")
