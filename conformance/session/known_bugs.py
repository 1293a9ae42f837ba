"""Known SGLang bugs as expectations (``fixtures/known_bugs.toml``), never as permissions.

An entry is a finding a clean run on real SGLang reproduces and that was judged SGLang's
fault (an answer that differs from the cache-off answer, a stored prefix not reused when
nothing evicted it): the release range it holds for, the check that reports it, the
finding's **kind** (``conformance.checks.findings.KINDS``) and constraints on its facts (``where``),
optionally a regex that narrows it further (``match``, searched in the finding's line), a
replay program file, the SGLang issue/PR, and the facts that place it (the SGLang code, the
failure line, what each release measured).  The format
is written down in ``docs/known-bugs.md``, which is generated from the file
(``conformance/session/known_bugs_doc.py``).

* :func:`expect` -- each finding of a failing verdict (``details.findings``) is judged on
  its own; a verdict whose every finding an entry in range excuses keeps its status
  ``fail`` and its numbers, gains ``details.known_bug`` and a reason that starts
  "known SGLang bug, still present"; the test then xfails instead of failing (``suites.settle``),
  so the run stays green on it and red on anything else (a verdict with one finding no
  entry excuses stays red, the excused ones listed in ``details.known_findings``).
* :func:`check_entries` -- strict: every entry in range is replayed; one that no longer
  reproduces is red ("remove or narrow the entry").  ``hybrid-conformance known-bugs``.

Pure except :func:`load` (reads the file) and :func:`installed_release`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from conformance.errors import KitError
from conformance.checks.findings import Finding, findings_of, kind_named
from conformance.records import Verdict
from conformance.targets.registry import KIT_ENGINE_TARGETS
from conformance.session import preflight

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
#: The file (override: ``HYBRID_CONFORMANCE_KNOWN_BUGS``).
KNOWN_BUGS_ENV = "HYBRID_CONFORMANCE_KNOWN_BUGS"
DEFAULT_FILE = ROOT / "fixtures" / "known_bugs.toml"
STILL_PRESENT = "known SGLang bug, still present"
NO_LONGER = "no longer reproduces: remove or narrow the entry"
REQUIRED = ("id", "summary", "releases", "check", "kind", "replay")
#: Checks that compare SGLang with the kit's reference engine.  A program compares SGLang with
#: its own cache-off run, so no program shows their failure: an entry of such a check is
#: reproduced by its suite alone, and its replay file only carries the cell and the env.
REFERENCE_CHECKS = ("agreement",)
#: Facts that place an entry: the bug it is another sighting of, where SGLang holds it, the
#: failure line, what each release measured, and notes (controls, what the fix changes).
FACTS = ("variant_of", "code_path", "seen_as", "measured", "notes")
OPTIONAL = ("match", "where", "issue", "pr", "cells", "targets", "attempts", *FACTS)
ID = re.compile(r"[a-z0-9][a-z0-9-]*")
MEASURED = re.compile(r"(?P<release>\d+(?:\.\d+)+): (?P<result>FAIL|PASS)(?:, (?P<what>\S.*))?")
#: A ``where`` constraint on a number: ``">0"``, ``"<=512"``.
COMPARE = re.compile(r"(?P<op><=|>=|!=|<|>)\s*(?P<value>-?\d+(?:\.\d+)?(?:[eE]-?\d+)?)")
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "!=": lambda a, b: a != b,
}


def satisfies(value: Any, constraint: Any) -> bool:
    """A fact against one ``where`` constraint: a list (one of), a comparison string on a
    number (``">0"``), or a value (equal).  A missing fact satisfies nothing."""
    if value is None:
        return False
    if isinstance(constraint, list):
        return value in constraint
    if isinstance(constraint, str) and (m := COMPARE.fullmatch(constraint.strip())):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and _OPS[m["op"]](value, float(m["value"]))
    return bool(value == constraint)


@dataclass(frozen=True)
class Measurement:
    """One release's measured outcome for an entry: ``"0.5.12: FAIL, <what was seen>"``."""

    release: str
    failed: bool
    what: str = ""

    @classmethod
    def parse(cls, line: str) -> Measurement | None:
        m = MEASURED.fullmatch(line.strip())
        return m and cls(m["release"], m["result"] == "FAIL", m["what"] or "")

    @property
    def version(self) -> Version:
        return Version(self.release)

    def line(self) -> str:
        return f"{self.release}: {'FAIL' if self.failed else 'PASS'}" + (f", {self.what}" if self.what else "")


@dataclass(frozen=True)
class KnownBug:
    id: str
    summary: str
    releases: str
    check: str
    kind: str
    replay: str
    match: str = ""
    where: tuple[tuple[str, Any], ...] = ()
    issue: str = ""
    pr: str = ""
    cells: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("sglang-cpu",)
    variant_of: str = ""
    code_path: str = ""
    seen_as: str = ""
    measured: tuple[Measurement, ...] = ()
    notes: tuple[str, ...] = ()
    #: plays of the replay before it counts as passed (a timing-dependent bug: it reproduces when
    #: one play fails with its kind; the plays share one server, and a death ends them)
    attempts: int = 1

    @property
    def first_bad(self) -> str | None:
        """The earliest release measured failing."""
        bad = sorted((m for m in self.measured if m.failed), key=lambda m: m.version)
        return bad[0].release if bad else None

    @property
    def first_good(self) -> str | None:
        """The earliest release measured passing after :attr:`first_bad` (None: none measured)."""
        if self.first_bad is None:
            return None
        good = sorted((m for m in self.measured if not m.failed and m.version > Version(self.first_bad)), key=lambda m: m.version)
        return good[0].release if good else None

    def in_range(self, release: str | None) -> bool:
        if not release:
            return False
        try:
            return Version(release) in SpecifierSet(self.releases)
        except InvalidVersion:
            return False

    def applies(self, *, check: str, cell: str | None, target: str, release: str | None) -> bool:
        return (check == self.check and target in self.targets and (not self.cells or cell in self.cells)
                and self.in_range(release))

    def matches(self, line: str) -> bool:
        """The optional regex, which only narrows (no ``match``: any line)."""
        return not self.match or re.search(self.match, line or "") is not None

    def excuses(self, finding: Finding) -> bool:
        """This entry explains ``finding``: its kind, every ``where`` constraint on its facts,
        and ``match`` (if any) on its line.  Cells, release and check: :meth:`applies`."""
        return (finding.kind == self.kind and all(satisfies(finding.facts.get(k), c) for k, c in self.where)
                and self.matches(finding.line))

    def reproduced_by(self, finding: Finding) -> bool:
        """Does the replay's finding reproduce this entry?  A programs entry's replay is the
        finding itself (:meth:`excuses`); another check's replay is a program of the same
        mechanism, so its kind (and ``match``) must agree, not the facts of that check
        (a kl sequence's scenario)."""
        if self.check == "programs":
            return self.excuses(finding)
        return finding.kind == self.kind and self.matches(finding.line)

    @property
    def suite_only(self) -> bool:
        """Reproduced by its check's suite alone (:data:`REFERENCE_CHECKS`): no program shows it."""
        return self.check in REFERENCE_CHECKS

    def refuse_program_replay(self, what: str) -> None:
        """``what`` replays this entry's program: one clear line when no program shows it."""
        if self.suite_only:
            raise KitError(f"{what}: bug {self.id!r} is judged against the reference engine (check {self.check}): its program "
                           f"{self.replay} only carries the cell; reproduce it with `hybrid-conformance run --target sglang-cpu "
                           f"--suite {self.check}` on its cell, or `known-bugs --only {self.id}`")

    def replay_path(self) -> Path:
        p = Path(self.replay)
        return p if p.is_absolute() else ROOT / p

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "summary": self.summary, "kind": self.kind, "issue": self.issue, "pr": self.pr, "releases": self.releases,
                "replay": self.replay, "status": STILL_PRESENT, "first_bad": self.first_bad, "first_good": self.first_good,
                "reproduce": f"hybrid-conformance report-bug {self.id}"}


def known_bugs_file() -> Path:
    return Path(os.environ.get(KNOWN_BUGS_ENV) or DEFAULT_FILE)


def _entry(raw: object, where: str) -> KnownBug:
    if not isinstance(raw, dict):
        raise KitError(f"{where}: an entry must be a table ([[bug]])")
    name = raw.get("id", "?")
    for key in REQUIRED:
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise KitError(f"{where}: bug {name!r} needs {key} = \"...\" (a non-empty string)")
    unknown = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise KitError(f"{where}: bug {name!r} has unknown field {unknown[0]!r}; known: {', '.join(REQUIRED + OPTIONAL)}")
    if not ID.fullmatch(raw["id"]):
        raise KitError(f"{where}: bug id {raw['id']!r} must be a slug of a-z, 0-9 and '-'")
    kind_named(raw["kind"], f"{where}: bug {name!r}")
    if "match" in raw and (not isinstance(raw["match"], str) or not raw["match"].strip()):
        raise KitError(f"{where}: bug {name!r}: match must be a non-empty regular expression (or left out)")
    try:
        re.compile(raw.get("match", ""))
    except re.error as e:
        raise KitError(f"{where}: bug {name!r}: match is not a regular expression ({e})") from None
    where_ = _where(raw.get("where", {}), where, name)
    try:
        releases = SpecifierSet(raw["releases"])
    except InvalidSpecifier:
        raise KitError(f"{where}: bug {name!r}: releases {raw['releases']!r} is not a version range like \">=0.5.20,<0.5.24\"") from None
    lists = {}
    for key in ("cells", "targets", "measured", "notes"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(x, str) for x in value)):
            raise KitError(f"{where}: bug {name!r}: {key} must be a list of strings")
        if value is not None:
            lists[key] = tuple(value)
    if set(lists.get("targets", ())) & set(KIT_ENGINE_TARGETS):
        raise KitError(f"{where}: bug {name!r}: a reference-engine failure is a kit bug, not a known SGLang bug")
    texts = {}
    for key in ("variant_of", "code_path", "seen_as"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise KitError(f"{where}: bug {name!r}: {key} must be a non-empty string")
        if key in raw:
            texts[key] = raw[key].strip()
    if "seen_as" in texts and not re.search(raw.get("match", ""), texts["seen_as"]):
        raise KitError(f"{where}: bug {name!r}: its match does not match its seen_as (the failure line the entry documents)")
    lists["measured"] = tuple(_measurement(line, releases, where, name) for line in lists.get("measured", ()))
    attempts = raw.get("attempts", 1)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 10:
        raise KitError(f"{where}: bug {name!r}: attempts must be a whole number from 1 to 10 (plays of a timing-dependent replay)")
    return KnownBug(**{k: raw[k] for k in REQUIRED}, match=raw.get("match", ""), where=where_, issue=str(raw.get("issue", "")),
                    pr=str(raw.get("pr", "")), attempts=attempts, **lists, **texts)


def _where(raw: Any, where: str, name: str) -> tuple[tuple[str, Any], ...]:
    """``where = { fact = constraint }``: each constraint a value, a list of values, or a
    comparison on a number (``">0"``)."""
    if not isinstance(raw, dict):
        raise KitError(f"{where}: bug {name!r}: where must be a table of fact = constraint")
    for fact, c in raw.items():
        ok = isinstance(c, (bool, int, float)) or isinstance(c, list) and all(isinstance(x, (str, int, float, bool)) for x in c)
        if isinstance(c, str):
            ok = bool(c.strip()) and (c.strip()[0] not in "<>!" or COMPARE.fullmatch(c.strip()) is not None)
        if not ok:
            raise KitError(f"{where}: bug {name!r}: where.{fact} = {c!r} must be a value, a list of values, or a comparison like \">0\"")
    return tuple(sorted(raw.items()))


def _measurement(line: str, releases: SpecifierSet, where: str, name: str) -> Measurement:
    """One ``measured`` line, checked against the entry's range: a release measured failing
    lies in it (else the range is too narrow), one measured passing outside it (else the
    strict replay of that release would be red)."""
    m = Measurement.parse(line)
    if m is None:
        raise KitError(f"{where}: bug {name!r}: measured line {line!r} must read \"<release>: FAIL|PASS[, what was seen]\"")
    if m.failed != (m.version in releases):
        fix = "widen the range" if m.failed else "narrow the range"
        raise KitError(f"{where}: bug {name!r}: measured {m.release} {'FAIL' if m.failed else 'PASS'} lies "
                       f"{'outside' if m.failed else 'inside'} releases {str(releases)!r} ({fix})")
    return m


def load(path: str | os.PathLike[str] | None = None) -> list[KnownBug]:
    """The entries of the known-bugs file (none when it does not exist); KitError naming
    the entry and field when it is malformed."""
    p = Path(path) if path is not None else known_bugs_file()
    if not p.exists():
        return []
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise KitError(f"{p}: not valid TOML ({e})") from None
    bugs = [_entry(b, str(p)) for b in raw.get("bug", [])]
    seen: set[str] = set()
    for b in bugs:
        if b.id in seen:
            raise KitError(f"{p}: bug id {b.id!r} appears twice")
        seen.add(b.id)
        if not b.replay_path().is_file():
            raise KitError(f"{p}: bug {b.id!r}: replay file {b.replay} does not exist")
    bases = {b.id for b in bugs if not b.variant_of}
    for b in bugs:
        if b.variant_of and (b.variant_of == b.id or b.variant_of not in bases):
            raise KitError(f"{p}: bug {b.id!r}: variant_of {b.variant_of!r} must name another entry of this file that is not itself a variant")
    return bugs


def installed_release() -> str | None:
    return preflight.sglang_version()


#: A check judged by another's entries: a cell's teardown re-reads the leaks suite's idle probes.
JUDGED_AS = {"teardown": "leaks"}


def explaining(finding: Finding, *, check: str, cell: str | None, target: str, release: str | None,
               bugs: Iterable[KnownBug] | None = None) -> KnownBug | None:
    """The first entry in range (check, target, cell, release) that excuses ``finding``, or None."""
    check = JUDGED_AS.get(check, check)
    for bug in load() if bugs is None else bugs:
        if bug.applies(check=check, cell=cell, target=target, release=release) and bug.excuses(finding):
            return bug
    return None


def expect(verdict: Verdict, *, cell: str | None, target: str, release: str | None, bugs: Iterable[KnownBug] | None = None) -> Verdict:
    """``verdict`` as the report files it: a failure whose every finding an in-range entry
    excuses is marked a known SGLang bug, still present; one with a finding no entry excuses
    stays a plain failure (the excused ones named in ``details.known_findings``)."""
    if verdict.status != "fail":
        return verdict
    bugs = load() if bugs is None else list(bugs)
    found = findings_of(verdict)
    why = [(f, explaining(f, check=verdict.check, cell=cell, target=target, release=release, bugs=bugs)) for f in found]
    known = [(f, b) for f, b in why if b is not None]
    if not known:
        return verdict
    if len(known) < len(why):
        rows = [{"kind": f.kind, "line": f.line[:200], "known_bug": b.id} for f, b in known]
        return dataclasses.replace(verdict, details={**verdict.details, "known_findings": rows})
    ids = list(dict.fromkeys(b.id for _, b in known))
    first = known[0][1]
    reason = f"{STILL_PRESENT} ({', '.join(ids)}{', ' + first.issue if first.issue else ''}): {verdict.reason}"
    return dataclasses.replace(verdict, reason=reason, details={**verdict.details, "known_bug": first.to_json()})


def is_known_bug(verdict: Verdict) -> bool:
    return verdict.status == "fail" and "known_bug" in verdict.details


@dataclass(frozen=True)
class Replayed:
    bug: KnownBug
    reproduced: bool
    line: str

    @property
    def ok(self) -> bool:
        return self.reproduced


def check_entries(bugs: Iterable[KnownBug], *, target: str, release: str | None,
                  replay: Callable[[KnownBug], list[Finding] | None],
                  suite_replay: Callable[[KnownBug], list[Finding] | None] | None = None) -> list[Replayed]:
    """Replay every entry in range for ``target``/``release``: ``replay(bug)`` returns the
    replay's findings, or None when the program passed.  Strict: a pass, or findings the
    entry does not excuse (another kind, facts outside its ``where``), is not a reproduction.
    ``suite_replay(bug)``, for an entry of a scripted suite's check (kl, leaks, ...): the
    findings of that suite run on the entry's cell, which must reproduce the very failure the
    entry excuses (kind, ``where`` facts and ``match``: :meth:`KnownBug.excuses`).  A variant of
    another check replaying its programs base's own file reproduces when that program shows the
    base's finding (the programs stop at the cause: a tree rule broken before the answers)."""
    bugs = list(bugs)
    programs = {b.id: b for b in bugs if b.check == "programs"}
    out = []
    for bug in bugs:
        if target not in bug.targets or not bug.in_range(release):
            continue
        if bug.suite_only:
            if suite_replay is None:
                out.append(Replayed(bug, False, f"{bug.id}: not reproduced: only the {bug.check} suite shows it, and --programs-only plays no suite"))
            else:
                out.append(_judged(bug, suite_replay(bug), bug.excuses, f"the {bug.check} suite", f" (the {bug.check} suite)", release))
            continue
        base = programs.get(bug.variant_of or "")
        if bug.check == "programs" or base is None or bug.replay != base.replay:
            base = None  # only a variant of another check playing its programs base's own file reproduces on the base
        reproduces = bug.reproduced_by if base is None else (lambda f, bug=bug, base=base: bug.reproduced_by(f) or base.excuses(f))
        out.append(_judged(bug, replay(bug), reproduces, "the replay", "", release))
        if suite_replay is not None and bug.check != "programs":
            suite = f"the {bug.check} suite"
            out.append(_judged(bug, suite_replay(bug), bug.excuses, suite, f" ({suite})", release))
    return out


def _judged(bug: KnownBug, found: list[Finding] | None, reproduces: Callable[[Finding], bool], what: str, suffix: str,
            release: str | None) -> Replayed:
    """One verdict line: ``what`` names the run judged, ``suffix`` follows a reproduction's line."""
    if found is None:
        return Replayed(bug, False, f"{bug.id}: {NO_LONGER} ({what} passed on sglang {release})")
    if not any(reproduces(f) for f in found):
        seen = "; ".join(f"{f.kind}: {f.line}" for f in found)
        return Replayed(bug, False, f"{bug.id}: {what} failed otherwise than the entry says ({seen[:200]}): a different finding")
    return Replayed(bug, True, f"{bug.id}: {STILL_PRESENT} on sglang {release}{suffix}")
