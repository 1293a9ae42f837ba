"""The known SGLang bugs a run hit, one row per bug (report.md, report.html, the terminal):
its bracket of releases (first bad / first good measured), the cells and checks it
explained, its replay, and where its bug folder is (``bugs/ID/`` beside the report, written
by ``hybrid-conformance run``; ``hybrid-conformance report-bug ID`` writes it anywhere)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: The bug folders' place inside a report directory.
BUGS_DIR = "bugs"


@dataclass(frozen=True)
class BugHit:
    """One known bug and every (cell, check) of the run it explained."""

    id: str
    summary: str
    releases: str
    first_bad: str | None
    first_good: str | None
    replay: str
    where: tuple[str, ...]

    @property
    def bracket(self) -> str:
        bad = f"first bad {self.first_bad}" if self.first_bad else "first bad not measured"
        good = f"first good {self.first_good}" if self.first_good else "no fixed release measured"
        return f"releases {self.releases}: {bad}, {good}"

    @property
    def folder(self) -> str:
        return f"{BUGS_DIR}/{self.id}/README.md"

    @property
    def reproduce(self) -> str:
        return f"hybrid-conformance report-bug {self.id}"

    def line(self) -> str:
        return (f"known SGLang bug {self.id} ({self.bracket}) explained {len(self.where)} failure(s): {', '.join(self.where)}; "
                f"replay {self.replay}; reproduce: {self.reproduce}")


def bug_hits(report: Mapping[str, Any]) -> list[BugHit]:
    """The report's ``known_bugs`` rows grouped by bug, in the order first seen."""
    hits: dict[str, dict[str, Any]] = {}
    for row in report.get("known_bugs") or []:
        entry = hits.setdefault(str(row.get("id")), {"row": row, "where": []})
        entry["where"].append(f"{row.get('cell')} {row.get('check')}")
    return [BugHit(bug_id, str(e["row"].get("summary", "")), str(e["row"].get("releases", "")), e["row"].get("first_bad"),
                   e["row"].get("first_good"), str(e["row"].get("replay", "")), tuple(e["where"])) for bug_id, e in hits.items()]
