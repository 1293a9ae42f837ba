"""The known SGLang bugs a run hit, one row per bug (report.md, report.html, the terminal):
its bracket of releases (first bad / first good measured), the cells and checks it
explained, its replay, and where its bug folder is (``bugs/ID/`` beside the report, written
by ``hybrid-conformance run``; ``hybrid-conformance report-bug ID`` writes it anywhere).

The same record lists the bugs a history hit (``history.json``'s ``known_bugs``,
``history.html``): :func:`row_hits` groups the FAIL rows matched to a bug, each place a
(release, check, cell) row, and :func:`history_hits` reads them back from the document."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

#: The bug folders' place inside a report directory.
BUGS_DIR = "bugs"
#: A history row's place, as history.json's ``known_bugs[].where`` names it.
ROW_KEYS = ("release", "check", "cell")


@dataclass(frozen=True)
class BugHit:
    """One known bug and every place it explained: a run's (cell, check), a history's
    (release, check, cell) rows (``rows``, shown as ``where``)."""

    id: str
    summary: str
    releases: str
    first_bad: str | None
    first_good: str | None
    replay: str
    where: tuple[str, ...]
    rows: tuple[tuple[str, str, str], ...] = ()  # a history's (release, check, cell) rows it explained (a run: none)
    written: bool = True  # its bug folder is there (a history: False when it could not be written)

    @classmethod
    def of(cls, bug: Mapping[str, Any], where: Iterable[str], rows: Iterable[tuple[str, str, str]] = ()) -> BugHit:
        """A hit of ``bug`` (a known-bug entry's JSON: ``KnownBug.to_json()`` or a record of ours)."""
        return cls(str(bug.get("id")), str(bug.get("summary") or ""), str(bug.get("releases") or ""), bug.get("first_bad"),
                   bug.get("first_good"), str(bug.get("replay") or ""), tuple(where), tuple(rows))

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

    def to_json(self) -> dict[str, Any]:
        """history.json's record; ``folder`` is "" when the bug folder was not written."""
        return {"id": self.id, "summary": self.summary, "releases": self.releases, "first_bad": self.first_bad,
                "first_good": self.first_good, "replay": self.replay, "folder": self.folder if self.written else "",
                "where": [dict(zip(ROW_KEYS, r)) for r in self.rows]}

    def line(self) -> str:
        return (f"known SGLang bug {self.id} ({self.bracket}) explained {len(self.where)} failure(s): {', '.join(self.where)}; "
                f"replay {self.replay}; reproduce: {self.reproduce}")


def bug_hits(report: Mapping[str, Any]) -> list[BugHit]:
    """The report's ``known_bugs`` rows grouped by bug, in the order first seen."""
    hits: dict[str, dict[str, Any]] = {}
    for row in report.get("known_bugs") or []:
        entry = hits.setdefault(str(row.get("id")), {"row": row, "where": []})
        entry["where"].append(f"{row.get('cell')} {row.get('check')}")
    return [BugHit.of(e["row"], e["where"]) for e in hits.values()]


def _place(row: tuple[str, str, str]) -> str:
    release, check, cell = row
    return f"{release} {check}" + (f" [{cell}]" if cell else "")


def row_hits(rows: Iterable[Any], bugs: Mapping[str, Mapping[str, Any]]) -> list[BugHit]:
    """A history's FAIL rows (``known_bug`` set) grouped by bug, in the order first seen;
    ``bugs``: the entries' JSON by id (an id not there keeps only its id)."""
    places: dict[str, list[tuple[str, str, str]]] = {}
    for r in rows:
        if r.status == "fail" and r.known_bug:
            places.setdefault(r.known_bug, []).append((r.release, r.check, r.cell))
    return [BugHit.of(bugs.get(bug_id) or {"id": bug_id}, map(_place, where), where) for bug_id, where in places.items()]


def history_hits(doc: Mapping[str, Any]) -> list[BugHit]:
    """history.json's ``known_bugs`` records as hits (none: the document predates them)."""
    out = []
    for rec in doc.get("known_bugs") or []:
        rows = [(str(w.get("release") or ""), str(w.get("check") or ""), str(w.get("cell") or "")) for w in rec.get("where") or []]
        out.append(replace(BugHit.of(rec, map(_place, rows), rows), written=bool(rec.get("folder"))))
    return out
