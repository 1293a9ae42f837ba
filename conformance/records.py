"""Frozen records shared by targets, checks and the report: verdicts and their numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Status = Literal["pass", "fail", "skip"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check on one cell: a status, the numbers behind it and why.

    ``metrics`` holds plain JSON-able numbers (they go to report.json as they are);
    ``details`` holds larger JSON-able data for the report (curves, per-request rows).
    """

    check: str
    status: Status
    metrics: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        nums = ", ".join(f"{k}={_fmt(v)}" for k, v in self.metrics.items() if isinstance(v, (int, float)) or v is None)
        head = f"{self.check}: {self.status}"
        if self.reason:
            head += f" ({self.reason})"
        return f"{head}; {nums}" if nums else head

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "metrics": dict(self.metrics)}
        if self.reason:
            out["reason"] = self.reason
        if self.details:
            out["details"] = dict(self.details)
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def merge(check: str, verdicts: list[Verdict]) -> Verdict:
    """Combine several verdicts of one check on one cell: fail beats pass beats skip."""
    if not verdicts:
        return Verdict(check, "skip", reason="no scenario ran")
    fails = [v for v in verdicts if v.status == "fail"]
    passes = [v for v in verdicts if v.status == "pass"]
    pick = fails[0] if fails else (passes[-1] if passes else verdicts[0])
    metrics: dict[str, Any] = {}
    for v in [*verdicts, pick]:  # later (and the deciding one) win; a missing number never hides a measured one
        for key, value in v.metrics.items():
            if value is not None or key not in metrics:
                metrics[key] = value
    details: dict[str, Any] = {}
    for v in verdicts:
        details.update(v.details)
    details.pop("findings", None)
    if fails and all(v.details.get("findings") for v in fails):  # each failing part's findings, judged on their own
        details["findings"] = [f for v in fails for f in v.details["findings"]]
    return Verdict(check, pick.status, metrics, "; ".join(v.reason for v in fails) if fails else pick.reason, details)
