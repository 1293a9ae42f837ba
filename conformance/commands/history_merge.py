"""``history --merge DIR...``: a night's shards (each a ``history --shard K/N --out DIR``
folder) as one ``history.json`` and ``history.html``, as the history workflow's merge job
writes them and as a user with one machine does after running shards one after another.

A row is keyed by (release, check, cell).  A FAIL no known bug marked when its shard ran is
judged again against today's known bugs (:class:`RunVerdicts`, from the verdict in the
shard's run report).  Shards that disagree on a key (one red, one
green or n/a) keep the FAIL and are listed under ``disagreements``; a key only one shard
has is kept as it is.  Each FAIL's replay file is copied under ``--out`` (``replays/<release>/``)
and linked; a FAIL matched to a known SGLang bug links its bug folder (``bugs/ID/``, written
as ``report-bug`` writes it and listed under ``known_bugs`` with its bracket and the rows it
explained, once however many shards hit it; ``known-bugs.md`` is still copied beside the
page).  Shards run by different kits (``shard.kit``: a user who ran some shards, changed the
kit, then ran others or ran a fill) do not disagree: a key's row from the newest kit that ran
it is kept, and the older kits' rows whose status it changed are listed under ``superseded``.  ``--previous FILE``
(the last night's history.json) gives ``new_since_last_night``:
the FAILs that were not FAILs then.  ``leads`` lists the request programs' FAILs no known
bug explains (not yet judged) with their replays, copied into ``--leads-dir``
(``fixtures/leads/`` locally) under ``<cell>-<release>.json``, and ``open_leads`` the
replays that folder already holds.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from conformance.commands.history import ROOT, Row, SGLANG_CPU, write_outputs
from conformance.commands.kit_identity import kit_of
from conformance.commands.night_plan import version_key
from conformance.errors import KitError
from conformance.checks.findings import findings_of
from conformance.report.known_bugs import history_hits
from conformance.session.known_bugs import KnownBug, explaining, load as load_known_bugs

PROGRAMS_CHECK = f"{SGLANG_CPU}:programs"
LEADS_DIR = ROOT / "fixtures" / "leads"
KNOWN_BUGS_PAGE = ROOT / "docs" / "known-bugs.md"
_RANK = {"fail": 0, "pass": 1, "na": 2}
_KNOWN = re.compile(r"known SGLang bug(?:, still present)? \(?([A-Za-z0-9_.-]+)\)?")


def key(row: Row) -> tuple[str, str, str]:
    return row.release, row.check, row.cell


def load_shard(folder: Path) -> dict[str, Any]:
    """A shard's history.json; KitError (one line) when the folder has none."""
    path = folder / "history.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KitError(f"--merge: {path} is not a history.json ({type(e).__name__})") from None


def _replay_in(folder: Path, replay: str, release: str) -> Path | None:
    """Where a row's replay is now: as recorded, under the shard's folder, or its
    ``replays/<release>/`` (a downloaded artifact moves the absolute path)."""
    if not replay:
        return None
    for candidate in (Path(replay), folder / replay, folder / "replays" / release / Path(replay).name):
        if candidate.is_file():
            return candidate
    return None


def known_bug_of(row: Row) -> str:
    """The row's known bug: the one it records, else the one its reason names."""
    if row.known_bug or row.status != "fail":
        return row.known_bug
    m = _KNOWN.search(row.reason)
    return m.group(1) if m else ""


class RunVerdicts:
    """The verdicts behind a shard's server rows (its ``runs/<release>-*/report.json``), to
    judge a FAIL again against today's ``fixtures/known_bugs.toml``: an entry added after the
    shard ran explains its FAIL in the merge as it would in a run of today."""

    def __init__(self, bugs: Sequence[KnownBug]) -> None:
        self.bugs = list(bugs)
        self._reports: dict[Path, list[dict]] = {}

    def _cells(self, folder: Path, release: str) -> list[dict]:
        out = []
        for report in sorted((folder / "runs").glob(f"{release}-*/report.json")):
            if report not in self._reports:
                try:
                    self._reports[report] = list(json.loads(report.read_text()).get("cells") or [])
                except (OSError, ValueError):
                    self._reports[report] = []
            out += self._reports[report]
        return out

    def known_bug(self, row: Row, folder: Path) -> str:
        """The entry in range that excuses every finding of the row's verdict, or ""."""
        name = row.check.partition(":")[2]
        if row.status != "fail" or not name:
            return ""
        for cell in self._cells(folder, row.release):
            verdict = (cell.get("checks") or {}).get(name) if cell.get("id") == row.cell else None
            found = findings_of(verdict) if isinstance(verdict, dict) else []
            why = [explaining(f, check=name, cell=row.cell, target=SGLANG_CPU, release=row.release, bugs=self.bugs) for f in found]
            if why and all(why):
                return why[0].id
        return ""


def newest_kit_per_unit(docs: Sequence[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], tuple[int, str]]:
    """The newest kit that ran each release x cell unit (a shard runs a unit whole): an older
    kit's rows of that unit are superseded even where the newer kit has no row of the same
    check (a start-up error filed under ``test`` that the newer kit's run of the unit passed
    under ``programs``).  Release-level rows (no cell) are compared key by key."""
    newest: dict[tuple[str, str], tuple[int, str]] = {}
    for _, doc in docs:
        mine = kit_of(doc.get("shard"))
        for raw in doc.get("rows") or []:
            unit = (raw.get("release", ""), raw.get("cell", ""))
            if unit[1] and (unit not in newest or mine[0] > newest[unit][0]):
                newest[unit] = mine
    return newest


def merge(folders: Sequence[Path], out_dir: Path, *, previous: dict | None = None, leads_dir: Path | None = None) -> dict[str, Any]:
    """The merged document (written with its page under ``out_dir``)."""
    kept: dict[tuple[str, str, str], Row] = {}
    seen: dict[tuple[str, str, str], dict[str, str]] = {}
    kit: dict[tuple[str, str, str], tuple[int, str]] = {}  # the newest kit that ran each key
    superseded: list[dict[str, str]] = []
    probes: dict[str, str] = {}
    shards = []
    verdicts = RunVerdicts(load_known_bugs())
    docs = [(folder, load_shard(folder)) for folder in folders]
    newest = newest_kit_per_unit(docs)
    for folder, doc in docs:
        probes.update(doc.get("probes") or {})
        shards.append({"folder": str(folder), **(doc.get("shard") or {})})
        mine = kit_of(doc.get("shard"))
        for raw in doc.get("rows") or []:
            row = Row(**raw)
            unit = newest.get((row.release, row.cell))
            if unit is not None and unit[0] > mine[0]:  # a newer kit ran this release x cell unit: its rows stand
                superseded.append({"release": row.release, "check": row.check, "cell": row.cell, "status": row.status,
                                   "folder": str(folder), "kit": mine[1][:12], "by": unit[1][:12]})
                continue
            found = _replay_in(folder, row.replay, row.release)
            if found is not None:
                target = out_dir / "replays" / row.release / found.name
                target.parent.mkdir(parents=True, exist_ok=True)
                if found.resolve() != target.resolve():
                    shutil.copy2(found, target)
                row = replace(row, replay=str(target))
            row = replace(row, known_bug=known_bug_of(row) or verdicts.known_bug(row, folder))
            k = key(row)
            if k in kit and kit[k][0] != mine[0]:  # another kit ran it: the newer one's rows stand
                older, newer = ((mine, kit[k]) if mine[0] < kit[k][0] else (kit[k], mine))
                gone = {str(folder): row.status} if older is mine else seen.pop(k)
                superseded += [{"release": k[0], "check": k[1], "cell": k[2], "status": st, "folder": f, "kit": older[1][:12],
                                "by": newer[1][:12]} for f, st in gone.items()]
                if older is mine:
                    continue
                del kept[k]
            kit[k] = mine
            seen.setdefault(k, {})[str(folder)] = row.status
            old = kept.get(k)
            if old is None or _RANK[row.status] < _RANK[old.status]:
                kept[k] = row
    # an older kit's row that the newer kit's agrees with says nothing: only the ones it changed are listed
    superseded = [x for x in superseded if (k := (x["release"], x["check"], x["cell"])) not in kept or x["status"] != kept[k].status]
    releases = sorted({k[0] for k in kept}, key=version_key)
    rows = sorted(kept.values(), key=lambda r: (version_key(r.release), r.check, r.cell))
    disagreements = [{"release": k[0], "check": k[1], "cell": k[2], "statuses": v} for k, v in seen.items() if len(set(v.values())) > 1]
    doc: dict[str, Any] = {"rows": [asdict(r) for r in rows], "probes": probes, "shards": shards, "disagreements": disagreements,
                           "superseded": superseded,
                           "left_out": [{"cell": c, "why": why} for c, why in sorted({(x["cell"], x["why"]) for s in shards for x in s.get("left_out") or []})],
                           "new_since_last_night": new_since(rows, previous), "leads": leads(rows, leads_dir),
                           "open_leads": sorted(p.name for p in (leads_dir or LEADS_DIR).glob("*.json")) if (leads_dir or LEADS_DIR).is_dir() else []}
    if any(r.known_bug for r in rows) and KNOWN_BUGS_PAGE.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(KNOWN_BUGS_PAGE, out_dir / "known-bugs.md")
    write_outputs(out_dir, doc, releases)
    return doc


def new_since(rows: Sequence[Row], previous: dict | None) -> list[dict[str, str]] | None:
    """The FAILs whose (release, check, cell) was not a FAIL last night; None without a previous night."""
    if previous is None:
        return None
    before = {key(Row(**r)) for r in previous.get("rows") or [] if r.get("status") == "fail"}
    return [{"release": r.release, "check": r.check, "cell": r.cell, "reason": r.reason} for r in rows if r.status == "fail" and key(r) not in before]


def leads(rows: Sequence[Row], leads_dir: Path | None) -> list[dict[str, str]]:
    """The programs' FAILs no known bug explains, each with its replay (copied into
    ``leads_dir`` as ``<cell>-<release>.json`` when given)."""
    out = []
    for r in rows:
        if r.check != PROGRAMS_CHECK or r.status != "fail" or r.known_bug:
            continue
        kept = ""
        if leads_dir is not None and r.replay and Path(r.replay).is_file():
            leads_dir.mkdir(parents=True, exist_ok=True)
            kept = str(shutil.copy2(r.replay, leads_dir / f"{r.cell}-{r.release}.json"))
        out.append({"release": r.release, "cell": r.cell, "replay": r.replay, "kept": kept, "reason": r.reason})
    return out


def run_merge(args) -> int:
    """``history --merge DIR...``: writes ``--out``; exit 1 when the merged night has a FAIL."""
    folders = [Path(d) for d in args.merge]
    previous = None
    if args.previous:
        prev = Path(args.previous)
        if prev.is_file():
            previous = json.loads(prev.read_text())
        else:
            print(f"hybrid-conformance: history --merge: no previous night at {prev}; nothing is new", flush=True)
    out_dir = Path(args.out)
    doc = merge(folders, out_dir, previous=previous, leads_dir=Path(args.leads_dir) if args.leads_dir else None)
    fails = [r for r in doc["rows"] if r["status"] == "fail"]
    print(f"history --merge: {len(folders)} shards, {len(doc['rows'])} rows, {len(fails)} FAIL, {len(doc['disagreements'])} disagreements, "
          f"{len(doc['superseded'])} rows superseded by a newer kit, "
          f"{len(doc['leads'])} leads; {out_dir / 'history.json'} and {out_dir / 'history.html'}")
    for r in fails:
        bug = f" (known bug {r['known_bug']})" if r["known_bug"] else ""
        print(f"  FAIL {r['release']} {r['check']} [{r['cell']}]{bug}: {r['reason'][:200]}")
    for hit in history_hits(doc):
        folder = out_dir / hit.folder if hit.written else f"not written (hybrid-conformance report-bug {hit.id} says why)"
        print(f"  known SGLang bug {hit.id} ({hit.bracket}): {len(hit.rows)} FAIL row(s); bug folder: {folder}")
    if doc["new_since_last_night"]:
        print(f"  new since the last night: {len(doc['new_since_last_night'])}")
    return 1 if fails else 0
