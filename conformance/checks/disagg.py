"""PD disaggregation check: folds the PD-vs-non-PD verdicts of a cell (KL on logprobs,
GSM8K agreement or accuracy, leaks on both servers) into ``disagg`` verdicts, and reports
GSM8K accuracy as a Wilson interval against SGLang's PD threshold history rather than
against one bare threshold.

SGLang's history: its PD GSM8K threshold for hybrid models was 0.93 and was lowered to
0.90; Nemotron under PD ran at 0.63 against its 0.87 threshold.  A threshold inside the
interval is undecided at this n (the row says how many items would resolve it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from conformance.checks.stats import required_n, wilson_interval
from conformance.errors import KitError
from conformance.records import Verdict, merge

CHECK = "disagg"


@dataclass(frozen=True)
class HistoricalThreshold:
    label: str
    threshold: float
    observed: float | None = None  # an accuracy SGLang's own PD runs reported against it


SGLANG_PD_HISTORY: tuple[HistoricalThreshold, ...] = (
    HistoricalThreshold("SGLang PD GSM8K threshold, original", 0.93),
    HistoricalThreshold("SGLang PD GSM8K threshold, lowered", 0.90),
    HistoricalThreshold("Nemotron under PD (observed vs threshold)", 0.87, observed=0.63),
)


def threshold_history(correct: int, n: int, history: Sequence[HistoricalThreshold] = SGLANG_PD_HISTORY, *, confidence: float = 0.95) -> list[dict[str, Any]]:
    """Where a measured accuracy's Wilson interval lies against each historical threshold.

    ``position``: ``above`` (the whole interval clears it), ``below`` (the whole interval
    misses it) or ``undecided`` (it lies inside the interval; ``items_to_resolve`` is the n
    at which the interval's half-width would equal the distance to it).
    """
    if n <= 0:
        raise KitError("threshold_history: no GSM8K item was scored")
    low, high = wilson_interval(correct, n, confidence)
    acc = correct / n
    rows = []
    for h in history:
        position = "above" if low >= h.threshold else "below" if high < h.threshold else "undecided"
        gap = abs(acc - h.threshold)
        row: dict[str, Any] = {
            "label": h.label, "threshold": h.threshold, "accuracy": acc, "wilson_low": low, "wilson_high": high,
            "n": n, "position": position,
            "items_to_resolve": None if position != "undecided" else (required_n(acc, gap, confidence) if 0 < gap < 1 else None),
        }
        if h.observed is not None:
            row["sglang_observed"] = h.observed
        rows.append(row)
    return rows


def disagg_verdict(parts: Sequence[Verdict], *, history: Sequence[dict[str, Any]] | None = None,
                   transfer: dict[str, str] | None = None) -> Verdict:
    """One ``disagg`` verdict from its parts (fail beats pass beats skip; numbers united).

    Each part's reason is prefixed with its check name so a failure says which comparison broke;
    ``transfer`` (the PD transfer backend and protocol) goes into the details.
    """
    if not parts:
        return Verdict(CHECK, "skip", reason="no PD comparison ran")
    named = [Verdict(p.check, p.status, p.metrics, f"{p.check}: {p.reason}" if p.reason else "", p.details) for p in parts]
    out = merge(CHECK, named)
    details = {**out.details, "parts": {p.check: p.status for p in parts}}
    if transfer:
        details["transfer"] = dict(transfer)
    metrics = dict(out.metrics)
    if history:
        details["sglang_pd_threshold_history"] = list(history)
        metrics["pd_history_undecided"] = sum(1 for r in history if r["position"] == "undecided")
    return Verdict(CHECK, out.status, metrics, out.reason, details)
