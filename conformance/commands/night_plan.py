"""A night of the release range in CI-sized shards (``plan --releases A..B --shards N``,
``history --shard K/N``): which (release, cell) units run tonight, what each costs
(``fixtures/cell_costs.toml``, :class:`Costs`), and the shards of at most
``shard_minutes`` they are packed into (:class:`NightPlan`).

Tonight's units, in this order (:func:`plan_night`):

1. the night's slice of the full product release x cell: unit (release i, cell j) is in
   slice ``(i + j) % 7`` and the night's date picks the slice (as ``--rotate date`` picks a
   cell), so seven nights in a row run the whole product once;
2. per release, the cell that adds most axis values the release has not seen tonight, until
   it sees every axis value of the tier's cells (model, strategy, page size, track interval,
   fault, cache variant and each server-option axis);
3. for each pair of axis values the tier's cells hold together that no unit of the night
   holds yet, the cell holding most such pairs on the release with the least work: the
   tier's covering array, extended by the release;
4. each standard-tier cell on at least three releases: the newest that do not run it yet
   (they take every option of the tier).

A cell no suite of the night binds (a PD-only fault's, since the night runs no disagg suite)
is left out; the plan, each shard's history.json and the merged page name it and why.

A fill (``plan --fill HISTORY``, ``history --fill HISTORY --shard K/N``) plans only what a
merged history still lacks of steps 2-4: the units it holds are not run again, those that
ran (a pass or FAIL row) count as covered, and a unit the release refused (only n/a rows) is
not tried again; a value its n/a line quotes (SGLang's own words) is declined there, so no
other cell holding it is planned on that release, and a value whose every tried holder was
refused counts as refused there, not missing.  No slice and no once-a-night checks: a fill
tops up a night whose shards did not all run.
With ``--rerun-unexplained`` it also runs again each unit with a FAIL no known bug explains
that another kit ran (``shard.kit``; the merge then keeps the newer kit's rows).

Each release's units then fill shards first-fit (its once-a-night checks -- validate, pool,
machine -- on its first shard), and parts of different releases share a shard when both fit.
The same arguments give the same plan, so ``history --shard K/N`` runs exactly shard K of
what ``plan`` printed.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from conformance.commands.rotation import rotation_key
from conformance.errors import KitError
from conformance.matrix import axes as option_axes
from conformance.matrix.cells import TIERS, Cell
from conformance.programs.explore import default_budget, parse_budget
from conformance.sglang_api.release_pins import release_of

ROOT = Path(__file__).resolve().parents[2]
COSTS_FILE = ROOT / "fixtures" / "cell_costs.toml"
WEEK = 7  # slices of the full product: each unit once in WEEK nights
RELEASE_CHECKS = ("validate", "pool", "machine")
#: Every cell of this tier runs on at least this many releases each night (the newest that do
#: not run it yet: they take every option of the tier).
SPREAD_TIER, SPREAD_RELEASES = "standard", 3
MIN_MEASURED_S = 30.0  # a cell timed under this in all did not run (its server refused to start)  # history's once-a-night checks per release


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


@dataclass(frozen=True)
class Costs:
    """``fixtures/cell_costs.toml``: seconds on a 2-core runner, per release and per cell."""

    speedup: float
    shard_minutes: float
    install: float
    checks: Mapping[str, float]
    server_start: float
    idle: float
    paged_factor: float
    paged_before: str
    suites: Mapping[str, float]
    programs: Mapping[str, float]
    cells: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = COSTS_FILE) -> Costs:
        try:
            d = tomllib.loads(path.read_text())
            return cls(speedup=float(d["speedup"]), shard_minutes=float(d["shard_minutes"]), install=float(d["release"]["install"]),
                       checks=dict(d["release"]["checks"]), server_start=float(d["cell"]["server_start"]), idle=float(d["cell"]["idle"]),
                       paged_factor=float(d["cell"]["paged_factor"]), paged_before=str(d["cell"].get("paged_before", "0.5.23")),
                       suites=dict(d["suites"]), programs=dict(d["programs"]), cells={k: dict(v) for k, v in d.get("cells", {}).items()})
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise KitError(f"{path}: not a cell-costs file ({type(e).__name__}: {e})") from None

    def programs_seconds(self, budget: str) -> float:
        """One cell's request programs at ``budget`` (a profile, ``N`` examples, ``Ns``)."""
        if budget in self.programs:
            return float(self.programs[budget])
        b = parse_budget(budget)
        if b.seconds is not None:
            return b.seconds + self.programs["overhead"]
        return (b.examples or 0) * self.programs["per_example"] + self.programs["overhead"]

    def cell_seconds(self, cell: Cell, release: str, *, suites: Sequence[str], budget: str) -> float:
        """One worker's seconds for ``cell`` on ``release``: its server, idle probes and suites
        (a measured cell's junit times hold its server's start and idle probes: its first
        test's setup started the server)."""
        measured = self.cells.get(cell.id, {})
        total = 0.0 if measured else self.server_start + self.idle
        for s in suites:
            if s in measured:
                total += measured[s]
            else:
                total += self.programs_seconds(budget) if s == "programs" else self.suites.get(s, 0.0)
        paged = cell.page_size > 1 and version_key(release) < version_key(self.paged_before)
        return total * (self.paged_factor if paged else 1.0)

    def part_seconds(self, cells_seconds: Iterable[float], checks: Sequence[str]) -> float:
        """A release's part of a shard: its venv and probe, its once-a-night checks, its run."""
        return self.install + sum(self.checks.get(c, 0.0) for c in checks) + sum(cells_seconds) / self.speedup


def axis_values(cell: Cell) -> frozenset[tuple[str, str]]:
    """Every axis value a cell sets or takes by default, as (axis, value) pairs."""
    own = {("model", cell.model.id), ("strategy", cell.strategy.name), ("page_size", str(cell.page_size)),
           ("track_interval", str(cell.track_interval)), ("fault", cell.fault.name), ("cache_variant", cell.cache_variant.name)}
    return frozenset(own | {(v.axis, v.name) for v in option_axes.values_of(cell)})


def _pairs(values: frozenset[tuple[str, str]]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    return {(a, b) for a, b in itertools.combinations(sorted(values), 2) if a[0] != b[0]}


def parse_release_range(text: str) -> list[str]:
    """``0.5.11..0.5.23`` -> every patch release between (both included); else ``[text]``."""
    if ".." not in text:
        return [text]
    lo, _, hi = text.partition("..")
    a, b = release_of(lo.strip()), release_of(hi.strip())
    if not a or not b or a.split(".")[:-1] != b.split(".")[:-1] or version_key(a) > version_key(b):
        raise KitError(f"--releases: {text!r} is not a range of one minor series (e.g. 0.5.11..0.5.23)")
    stem = ".".join(a.split(".")[:-1])
    return [f"{stem}.{p}" for p in range(version_key(a)[-1], version_key(b)[-1] + 1)]


def night_of(text: str | None) -> datetime.date:
    """``--night``: a date (YYYY-MM-DD) or, by default (or ``date``), today's UTC date, the
    key ``--rotate date`` uses."""
    try:
        return datetime.date.fromisoformat(rotation_key(text or "date"))
    except ValueError:
        raise KitError(f"--night: expected a date like 2026-11-28, got {text!r}") from None


@dataclass(frozen=True)
class Fill:
    """What a merged (or shard's) history.json already holds of the server units:
    (release, cell) -> True when a row of it passed or failed (it ran), False when all its
    rows are n/a (the release refused the cell)."""

    source: str
    units: Mapping[tuple[str, str], bool]
    #: units to run again: a FAIL no known bug explains, run by another kit than ``kit``
    rerun: frozenset[tuple[str, str]] = frozenset()
    #: a refused unit's n/a line (SGLang's own), by unit
    reasons: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def declined(self, release: str, cells: Iterable[Cell]) -> set[tuple[str, str]]:
        """The axis values ``release`` turned down in SGLang's own words: a value of a refused
        cell that its n/a line quotes (``has no 'extra_buffer_lazy'``, ``'python' is not
        registered``, ``invalid choice: 'tlru'``).  No cell holding one is planned there."""
        out: set[tuple[str, str]] = set()
        for c in cells:
            why = self.reasons.get((release, c.id), "")
            out |= {(a, v) for a, v in axis_values(c) if why and (f"'{v}'" in why or f'"{v}"' in why)}
        return out

    @classmethod
    def load(cls, path: str | Path, *, rerun_unexplained_for: str | None = None) -> Fill:
        """KitError (one line) when the file is not a history.json.  ``rerun_unexplained_for``:
        this kit's commit; the units whose unexplained FAIL only other kits ran go in ``rerun``."""
        try:
            doc = json.loads(Path(path).read_text())
            rows = doc["rows"]
            units: dict[tuple[str, str], bool] = {}
            reasons: dict[tuple[str, str], str] = {}
            for row in rows:
                if row.get("cell"):
                    k = (row["release"], row["cell"])
                    units[k] = units.get(k, False) or row["status"] in ("pass", "fail")
                    if row["status"] == "na":
                        reasons.setdefault(k, str(row.get("reason") or ""))
            kits: dict[tuple[str, str], set[str]] = {}
            for shard in doc.get("shards") or [doc.get("shard") or {}]:
                commit = str((shard.get("kit") or {}).get("commit") or "")
                for release, part in (shard.get("parts") or {}).items():
                    for cell in part.get("cells") or []:
                        kits.setdefault((release, cell), set()).add(commit)
            rerun = frozenset() if rerun_unexplained_for is None else frozenset(
                (r["release"], r["cell"]) for r in rows if r.get("cell") and r["status"] == "fail" and not r.get("known_bug")
                and rerun_unexplained_for not in kits.get((r["release"], r["cell"]), set()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise KitError(f"--fill: {path} is not a history.json with rows ({type(e).__name__}: {e})") from None
        return cls(str(path), units, rerun, {k: why for k, why in reasons.items() if not units[k]})


@dataclass(frozen=True)
class Unit:
    release: str
    cell: Cell
    seconds: float  # one worker's
    why: str  # slice | axis | pair | spread | rerun


@dataclass(frozen=True)
class Part:
    """What one shard runs of one release: its once-a-night checks (if this is its first
    shard) and some of its cells."""

    release: str
    checks: tuple[str, ...]
    units: tuple[Unit, ...]
    seconds: float

    @property
    def cells(self) -> tuple[str, ...]:
        return tuple(u.cell.id for u in self.units)


@dataclass(frozen=True)
class Shard:
    index: int  # 1-based
    parts: tuple[Part, ...]
    #: the night's cells no suite of the night binds, each with why (the plan's ``left_out``)
    left_out: tuple[tuple[str, str], ...] = ()

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.parts)

    def part(self, release: str) -> Part | None:
        return next((p for p in self.parts if p.release == release), None)


@dataclass(frozen=True)
class NightPlan:
    night: str
    slice: int
    tier: str
    budget: str
    releases: tuple[str, ...]
    cells: tuple[Cell, ...]
    units: tuple[Unit, ...]
    shards: tuple[Shard, ...]
    limit_s: float
    #: the tier's cells no suite of the night binds (a PD-only fault's cells when the night
    #: runs no disagg suite), each with why: not planned, and every report of the night says so
    left_out: tuple[tuple[str, str], ...] = ()
    #: a fill's history file and the (release, cell) units that ran there (they count as covered)
    fill: str = ""
    prior: frozenset[tuple[str, str]] = frozenset()
    #: a fill's units the history's releases refused (n/a rows only): their values count as refused, not missing
    refused: frozenset[tuple[str, str]] = frozenset()
    #: (release, axis, value) a fill's history shows the release turning down (Fill.declined)
    declined: tuple[tuple[str, str, str], ...] = ()

    def shard(self, spec: str) -> Shard:
        """``K/N`` -> shard K; KitError when N is not this plan's count or K is out of range."""
        k, _, n = spec.partition("/")
        if not (k.isdigit() and n.isdigit()) or not 1 <= int(k) <= int(n):
            raise KitError(f"--shard: expected K/N with 1 <= K <= N, got {spec!r}")
        if int(n) != len(self.shards):
            raise KitError(f"--shard {spec}: tonight's plan has {len(self.shards)} shards, not {n} (plan --shards {n} says why)")
        return self.shards[int(k) - 1]

    def coverage(self) -> dict[str, Any]:
        """What the night covers: axis values per release, pairs, units of the product."""
        values = set().union(*(axis_values(c) for c in self.cells)) if self.cells else set()
        pairs = set().union(*(_pairs(axis_values(c)) for c in self.cells)) if self.cells else set()
        by_id = {c.id: c for c in self.cells}
        held_units = {(u.release, u.cell.id) for u in self.units} | {(r, c) for r, c in self.prior if c in by_id}
        seen = {r: set().union(*(axis_values(by_id[c]) for rr, c in held_units if rr == r)) for r in self.releases}
        covered = set().union(*(_pairs(axis_values(by_id[c])) for _, c in held_units))
        spread = [c.id for c in self.cells if TIERS.index(c.tier) <= TIERS.index(SPREAD_TIER)]
        held = {c: sum(1 for _, cc in held_units if cc == c) for c in spread}
        # a value no unit holds on a release whose every tried holder the release refused: it does not accept it
        refused = {r: (set().union(*(axis_values(by_id[c]) for rr, c in self.refused if rr == r and c in by_id))
                       | {(a, v) for rr, a, v in self.declined if rr == r}) - seen[r] for r in self.releases}
        return {"axis_values": len(values),
                "releases_missing_values": {r: sorted(f"{a}={v}" for a, v in values - s - refused[r]) for r, s in seen.items() if values - s - refused[r]},
                "releases_refused_values": {r: sorted(f"{a}={v}" for a, v in vs) for r, vs in refused.items() if vs},
                "spread_cells": len(spread), "spread_cells_short": sorted(c for c, n in held.items() if n < min(SPREAD_RELEASES, len(self.releases))),
                "pairs": len(pairs), "pairs_covered": len(pairs & covered), "units": len(self.units),
                "product": len(self.releases) * len(self.cells), "slice": f"{self.slice + 1} of {WEEK}",
                "left_out": [{"cell": c, "why": why} for c, why in self.left_out]}

    def to_json(self) -> dict[str, Any]:
        return {"night": self.night, "slice": self.slice + 1, "week": WEEK, "tier": self.tier, "budget": self.budget,
                **({"fill": self.fill, "prior_units": len(self.prior)} if self.fill else {}),
                "releases": list(self.releases), "limit_minutes": self.limit_s / 60, "coverage": self.coverage(),
                "shards": [{"index": s.index, "minutes": round(s.seconds / 60, 1),
                            "parts": [{"release": p.release, "checks": list(p.checks), "cells": list(p.cells), "minutes": round(p.seconds / 60, 1)}
                                      for p in s.parts]} for s in self.shards]}

    def render(self) -> str:
        cov = self.coverage()
        what = (f"fill of {self.fill} ({len(self.prior)} units ran there)" if self.fill
                else f"night {self.night} (slice {cov['slice']} of the release x cell product)")
        lines = [f"{what}, tier {self.tier}, programs budget {self.budget}: "
                 f"{len(self.releases)} releases x {len(self.cells)} cells = {cov['product']} units, {cov['units']} {'to run' if self.fill else 'tonight'}; "
                 f"{len(self.shards)} shards of at most {self.limit_s / 60:.0f} min"]
        for s in self.shards:
            lines.append(f"shard {s.index}/{len(self.shards)}  {s.seconds / 60:5.1f} min")
            for p in s.parts:
                checks = f"{','.join(p.checks)} + " if p.checks else ""
                lines.append(f"    {p.release}: {checks}{len(p.units)} cells ({p.seconds / 60:.1f} min): {' '.join(p.cells)}")
        missing, refused = cov["releases_missing_values"], cov["releases_refused_values"]
        lines.append(f"coverage: every release sees all {cov['axis_values']} axis values"
                     + (f" it accepts ({sum(map(len, refused.values()))} release-values refused: n/a there)" if refused else "")
                     + (f" except {missing}" if missing else "") + f"; {cov['pairs_covered']} of {cov['pairs']} pairs of axis values on some release"
                     + f"; {cov['spread_cells'] - len(cov['spread_cells_short'])} of {cov['spread_cells']} {SPREAD_TIER} cells on at least "
                     f"{SPREAD_RELEASES} releases")
        lines += [f"left out: {c}: {why}" for c, why in self.left_out]
        return "\n".join(lines)


def plan_night(releases: Sequence[str], cells: Sequence[Cell], costs: Costs, *, night: datetime.date, tier: str,
               budget: str | None, suites: Sequence[str], checks: Sequence[str] = RELEASE_CHECKS, shards: int | None = None,
               fill: Fill | None = None) -> NightPlan:
    """Tonight's units and shards (module docstring); ``shards``: exactly that many (KitError
    when they cannot each stay under the limit), None for the fewest; either way balanced
    (the smallest cap under the limit that packs into that many).  ``fill``: only what that
    history lacks (no slice; its units are not planned again)."""
    budget = budget or default_budget(tier)
    checks = () if fill else checks  # a fill tops up server units; the once-a-night checks ran with the night
    day = night.toordinal() % WEEK
    left_out = tuple((c.id, f"no suite of the night binds it (its suites: {', '.join(c.fault.suites)}; the night runs {', '.join(suites)})")
                     for c in cells if not any(c.fault.binds_suite(s) for s in suites))
    out_ids = {cid for cid, _ in left_out}
    cells = [c for c in cells if c.id not in out_ids]
    cost = {(r, c.id): costs.cell_seconds(c, r, suites=suites, budget=budget) for r in releases for c in cells}
    units: dict[tuple[str, str], Unit] = {}
    ids = {c.id for c in cells}
    tried = {k for k in (fill.units if fill else {}) if k[1] in ids}  # a fill's history: not planned again
    ran = {k for k in tried if fill and fill.units[k]}  # ... and these count as covered

    def add(r: str, c: Cell, why: str) -> None:
        units.setdefault((r, c.id), Unit(r, c, cost[(r, c.id)], why))

    declined = {r: fill.declined(r, cells) if fill else set() for r in releases}
    values = {c.id: axis_values(c) for c in cells}

    def free(r: str, c: Cell) -> bool:
        return (r, c.id) not in units and (r, c.id) not in tried and not values[c.id] & declined[r]

    for (i, r), (j, c) in itertools.product(enumerate(releases), enumerate(cells)):
        if (i + j) % WEEK == day and not fill:
            add(r, c, "slice")
    wanted = set().union(*values.values()) if cells else set()
    for r in releases:
        seen = set().union(*(values[c] for rr, c in [*units, *ran] if rr == r))
        while options := [c for c in cells if free(r, c) and values[c.id] - seen]:
            best = max(options, key=lambda c: (len(values[c.id] - seen), -cost[(r, c.id)]))
            add(r, best, "axis")
            seen |= values[best.id]
    pairs = {c.id: _pairs(values[c.id]) for c in cells}
    uncovered = set().union(*pairs.values()) - set().union(*(pairs[c] for _, c in [*units, *ran])) if cells else set()
    while uncovered:
        pair = min(uncovered)
        holders = sorted((c for c in cells if pair in pairs[c.id]), key=lambda c: (-len(pairs[c.id] & uncovered), cost[(releases[0], c.id)]))
        load = {r: sum(u.seconds for u in units.values() if u.release == r) for r in releases}
        best = next((c for c in holders if any(free(r, c) for r in releases)), None)
        if best is None:  # a fill: every unit holding it already ran or was refused
            uncovered.discard(pair)
            continue
        add(min((r for r in releases if free(r, best)), key=lambda r: (load[r], releases.index(r))), best, "pair")
        uncovered -= pairs[best.id]
    for c in (c for c in cells if TIERS.index(c.tier) <= TIERS.index(SPREAD_TIER)):
        held = sum(1 for r in releases if (r, c.id) in units or (r, c.id) in ran)
        for r in [r for r in reversed(releases) if free(r, c)][:max(0, SPREAD_RELEASES - held)]:
            add(r, c, "spread")
    by_id = {c.id: c for c in cells}
    for r, cid in sorted(fill.rerun if fill else (), key=lambda k: (version_key(k[0]), k[1])):
        if r in releases and cid in by_id:
            add(r, by_id[cid], "rerun")
    ordered = sorted(units.values(), key=lambda u: (releases.index(u.release), cells.index(u.cell)))
    limit = costs.shard_minutes * 60
    packed = _pack(ordered, releases, costs, checks, limit)
    if shards is None:  # the fewest, then balanced as if asked for that many
        shards = len(packed)
    if shards:
        if len(packed) > shards:
            raise KitError(f"--shards {shards}: tonight needs {len(packed)} shards of at most {costs.shard_minutes:.0f} min "
                           f"({len(ordered)} units of {len(releases)} releases x {len(cells)} cells, budget {budget})")
        total = sum(p.seconds for s in packed for p in s)
        cap = max(total / shards, max((costs.part_seconds([u.seconds], ()) for u in ordered), default=0.0))
        while cap < limit:
            trial = _pack(ordered, releases, costs, checks, cap)
            if len(trial) <= shards:
                packed = trial
                break
            cap = min(limit, cap * 1.05 + 1)
        packed += [[] for _ in range(shards - len(packed))]
    return NightPlan(night.isoformat(), day, tier, budget, tuple(releases), tuple(cells), tuple(ordered),
                     tuple(Shard(i + 1, tuple(s), left_out) for i, s in enumerate(packed)), limit, left_out,
                     fill=fill.source if fill else "", prior=frozenset(ran), refused=frozenset(tried - ran),
                     declined=tuple((r, a, v) for r in releases for a, v in sorted(declined[r])))


def _pack(units: Sequence[Unit], releases: Sequence[str], costs: Costs, checks: Sequence[str], cap: float) -> list[list[Part]]:
    """Each release's units first-fit into parts under ``cap`` (its checks on its first part),
    then the parts first-fit (largest first) into shards under ``cap``."""
    parts: list[Part] = []
    for r in releases:
        mine = [u for u in units if u.release == r]
        chunks: list[list[Unit]] = []
        for u in sorted(mine, key=lambda u: -u.seconds):
            for i, chunk in enumerate(chunks):
                if costs.part_seconds([x.seconds for x in chunk + [u]], checks if i == 0 else ()) <= cap:
                    chunk.append(u)
                    break
            else:
                chunks.append([u])
        if not chunks and checks:
            chunks.append([])
        for i, chunk in enumerate(chunks):
            chunk.sort(key=lambda u: mine.index(u))
            own = tuple(checks) if i == 0 else ()
            parts.append(Part(r, own, tuple(chunk), costs.part_seconds([u.seconds for u in chunk], own)))
    shards: list[list[Part]] = []
    for p in sorted(parts, key=lambda p: -p.seconds):
        for s in shards:
            if sum(x.seconds for x in s) + p.seconds <= cap and all(x.release != p.release for x in s):
                s.append(p)
                break
        else:
            shards.append([p])
    for s in shards:
        s.sort(key=lambda p: releases.index(p.release))
    shards.sort(key=lambda s: (releases.index(s[0].release), -len(s[0].checks), s[0].cells))
    return shards


def measured_costs(report_dirs: Sequence[Path]) -> dict[str, dict[str, float]]:
    """cell id -> suite -> seconds, from the junit.xml of ``run`` report folders: a suite
    test's time (its module under ``conformance/suites/<suite>/``) goes to the cell its
    ``@<cell id>`` group names; a cell timed in several folders keeps the last.  A cell with
    a test that failed on setup (its server refused to start or died) is left out: its first
    test timed the failed start, not the cell's run."""
    out: dict[str, dict[str, float]] = {}
    for d in report_dirs:
        junit = Path(d) / "junit.xml"
        if not junit.is_file():
            continue
        per: dict[str, dict[str, float]] = {}
        unserved: set[str] = set()
        for case in ET.parse(junit).getroot().iter("testcase"):
            name, classname = case.get("name", ""), f".{case.get('classname', '')}"
            if "@" not in name or ".suites." not in classname:
                continue
            suite = classname.split(".suites.", 1)[1].split(".")[0]
            cell = per.setdefault(name.rsplit("@", 1)[1], {})
            cell[suite] = cell.get(suite, 0.0) + float(case.get("time") or 0.0)
            if any((e.get("message") or "").startswith(SETUP_FAILURE) for e in case.iter("error")):
                unserved.add(name.rsplit("@", 1)[1])
        out.update({c: v for c, v in per.items() if c not in unserved})
    return out


#: How pytest's junit.xml opens the error of a test whose fixtures (the cell's server) failed.
SETUP_FAILURE = "failed on setup"


def costs_toml(measured: Mapping[str, Mapping[str, float]]) -> str:
    """``[cells."<id>"]`` tables for ``fixtures/cell_costs.toml``; a cell whose suites took
    under ``MIN_MEASURED_S`` in all (its server never started) is left to the defaults."""
    lines = []
    for cell in sorted(c for c in measured if sum(measured[c].values()) >= MIN_MEASURED_S):
        lines.append(f'[cells."{cell}"]')
        lines += [f"{suite} = {math.ceil(s * 10) / 10}" for suite, s in sorted(measured[cell].items())]
    return "\n".join(lines)
