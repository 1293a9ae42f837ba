"""``hybrid-conformance history --bisect ID [--releases ...] [--write]``: the first bad and the
first good SGLang release of a known bug, found by replaying its program file.

Each release probed runs the entry's replay inside that release's venv (``ensure_venv`` /
``venv_env`` of ``conformance/commands/history.py``) through the known-bugs replayer
(``conformance/commands/known_bugs.py``: the cell, its cache-off twin, the recorded env),
whatever the entry's range says.  A failure the entry's ``match`` explains is **bad**, a pass
**good**; anything else (the release refuses the cell, another failure) is **n/a** and leaves
the search.  Releases: ``--releases``, else every release with a venv under ``--venv-dir``.

The search (:func:`search`) finds one bad release (the entry's range first, from its middle),
then bisects below it for the first bad and above it for the first good, assuming one
interval of bad releases.  The bracket it prints is checked against the entry
(:meth:`Bracket.disagreements`): its measured lines, its range, its recorded first bad /
first good (each must lie in the interval the bisect leaves for it); exit 1 when they
disagree or nothing reproduces.  ``--write`` puts the bracket into the entry's ``measured``
lines (and nothing else).  ``--sglang-source`` is not bisected (one n/a line says so).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from packaging.version import Version

from conformance.commands.history import READY, _run, default_venv_dir, ensure_venv, parse_releases, venv_env
from conformance.commands.known_bugs import replayer
from conformance.commands.report_bug import find_bug
from conformance.checks.findings import Finding
from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TARGET
from conformance.session.known_bugs import KnownBug, Measurement, known_bugs_file, load
from conformance.session.options import options_from_args

STATUSES = ("bad", "good", "na")
PROBE_TIMEOUT_S = 3600
WRITTEN = "the replay (history --bisect)"
SOURCE_NA = ("--sglang-source: n/a for --bisect: bisecting a checkout's commits needs a venv built per commit and two "
             "servers per commit, which this command does not do; the releases are bisected")


@dataclass(frozen=True)
class Probe:
    """One release's replay of the entry: ``bad`` (the entry's failure), ``good`` (passed) or ``na``."""

    release: str
    status: str
    line: str = ""

    @classmethod
    def classify(cls, bug: KnownBug, release: str, findings: Sequence[Finding] | None) -> Probe:
        """The replay's findings judged as ``known-bugs`` judges them (``KnownBug.reproduced_by``)."""
        if findings is None:
            return cls(release, "good", "the replay passed")
        if hit := next((f for f in findings if bug.reproduced_by(f)), None):
            return cls(release, "bad", f"{hit.kind}: {hit.line}")
        seen = "; ".join(f"{f.kind}: {f.line}" for f in findings)
        return cls(release, "na", f"failed otherwise than the entry says: {seen}")


@dataclass(frozen=True)
class Bracket:
    """What the bisect found; a release of ``None`` is past the releases probed."""

    probes: dict[str, Probe]
    first_bad: str | None = None
    last_good: str | None = None  # the release before first_bad that passed
    last_bad: str | None = None
    first_good: str | None = None

    def disagreements(self, bug: KnownBug) -> list[str]:
        """Where the bracket and the entry disagree (empty: the bisect reproduces the entry)."""
        if self.first_bad is None:
            return [f"the replay reproduced {bug.id} on none of the {len(self.probes)} releases probed"]
        out = []
        for p in self.probes.values():
            if p.status != "na" and (p.status == "bad") != bug.in_range(p.release):
                out.append(f"{p.release} {'fails' if p.status == 'bad' else 'passes'} the replay, "
                           f"{'outside' if p.status == 'bad' else 'inside'} the entry's releases {bug.releases!r}")
        for m in bug.measured:
            p = self.probes.get(m.release)
            if p is not None and p.status != "na" and m.failed != (p.status == "bad"):
                out.append(f"{m.release} measured {'FAIL' if m.failed else 'PASS'}, the bisect's replay {'failed' if p.status == 'bad' else 'passed'}")
        if bug.first_bad and not _inside(bug.first_bad, self.last_good, self.first_bad):
            out.append(f"recorded first bad {bug.first_bad}, the bisect puts it in ({self.last_good or 'oldest'}, {self.first_bad}]")
        if bug.first_good and not _inside(bug.first_good, self.last_bad, self.first_good):
            out.append(f"recorded first good {bug.first_good}, the bisect puts it in ({self.last_bad}, {self.first_good or 'newest'}]")
        if not bug.first_good and self.first_good:
            out.append(f"the bisect finds {self.first_good} passing after {self.last_bad}; the entry records no first good")
        return out

    def lines(self) -> list[str]:
        probed = [f"  {r}: {p.status.upper() if p.status != 'na' else 'n/a'}, {p.line[:200]}" for r, p in _ordered(self.probes)]
        below = f" (last good {self.last_good})" if self.last_good else " (the oldest release that ran the replay: maybe earlier)"
        above = f"first good {self.first_good} (last bad {self.last_bad})" if self.first_good else f"no good release after {self.last_bad} (the newest probed)"
        found = f"first bad {self.first_bad}{below}; {above}" if self.first_bad else "no release reproduces the entry"
        return [*probed, found]

    def measurements(self) -> list[Measurement]:
        """The bracket as measured lines: the first bad fails, the first good passes."""
        out = [Measurement(self.first_bad, True, WRITTEN)] if self.first_bad else []
        return out + ([Measurement(self.first_good, False, WRITTEN)] if self.first_good else [])


def _inside(release: str, low: str | None, high: str | None) -> bool:
    """``release`` in the interval (low, high] (None: unbounded)."""
    v = Version(release)
    return (low is None or v > Version(low)) and (high is None or v <= Version(high))


def _ordered(probes: dict[str, Probe]) -> list[tuple[str, Probe]]:
    return sorted(probes.items(), key=lambda kv: Version(kv[0]))


def search(bug: KnownBug, releases: Sequence[str], probe: Callable[[str], Probe]) -> Bracket:
    """Bisect ``releases`` for ``bug`` (``probe`` replays one release); one bad interval assumed."""
    live = sorted(dict.fromkeys(releases), key=Version)
    seen: dict[str, Probe] = {}

    def status(r: str) -> str:
        if r not in seen:
            seen[r] = probe(r)
            if seen[r].status not in STATUSES:
                raise KitError(f"bisect: release {r}: status {seen[r].status!r} is not one of {', '.join(STATUSES)}")
        return seen[r].status

    in_range = [r for r in live if bug.in_range(r)]
    middle = len(in_range) // 2
    candidates = sorted(in_range, key=lambda r: abs(in_range.index(r) - middle)) + [r for r in live if r not in in_range]
    anchor = next((r for r in candidates if status(r) == "bad"), None)
    live = [r for r in live if seen.get(r, Probe(r, "")).status != "na"]
    if anchor is None:
        return Bracket(seen)
    hi = _first(live, 0, live.index(anchor), "bad", status)  # below the anchor (the anchor itself when none)
    first_bad, last_good = live[hi], live[hi - 1] if hi > 0 else None
    hi = _first(live, live.index(anchor) + 1, len(live), "good", status)
    return Bracket(seen, first_bad, last_good, live[hi - 1], live[hi] if hi < len(live) else None)


def _first(live: list[str], lo: int, hi: int, want: str, status: Callable[[str], str]) -> int:
    """The index of the first release of ``live[lo:hi]`` whose status is ``want`` (``hi``: none),
    by bisection; an n/a release met on the way leaves ``live``."""
    while lo < hi:
        mid = (lo + hi) // 2
        s = status(live[mid])
        if s == "na":
            del live[mid]
            hi -= 1
        elif s == want:
            hi = mid
        else:
            lo = mid + 1
    return hi


# ------------------------------------------------------------------ a release's replay

def probe_json(module: str, bug: KnownBug, release: str, venv_dir: Path, log_dir: Path, *, what: str,
               extra: Sequence[str] = ()) -> dict:
    """``python -m <module> --probe ID --log-dir <log_dir>/<release> [extra]`` inside
    ``release``'s venv (made if missing): its last JSON line, or ``{"error": why}`` when the
    venv cannot be made or ``what`` (the probe, for the message) printed none."""
    try:
        venv = ensure_venv(release, venv_dir)
    except KitError as e:
        return {"error": f"no venv: {e}"}
    argv = [str(venv / "bin" / "python"), "-m", module, "--probe", bug.id, "--log-dir", str(log_dir / release), *extra]
    out = _run(argv, timeout=PROBE_TIMEOUT_S, env=venv_env(venv) | {"HYBRID_CONFORMANCE_KNOWN_BUGS": str(known_bugs_file())})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"{what} exited {out.returncode}: {(out.stderr.strip().splitlines() or ['(no output)'])[-1][:300]}"}
    return json.loads(lines[-1])


def probe_in_venv(bug: KnownBug, release: str, venv_dir: Path, log_dir: Path) -> Probe:
    """Replay ``bug`` inside ``release``'s venv (made if missing): ``python -m
    conformance.commands.bisect --probe ID`` there, its one JSON line classified."""
    result = probe_json("conformance.commands.bisect", bug, release, venv_dir, log_dir, what="the replay")
    if result.get("error"):
        return Probe(release, "na", result["error"])
    found = result.get("findings")
    return Probe.classify(bug, release, None if found is None else [Finding.from_json(f) for f in found])


def _probe_main(bug_id: str, log_dir: Path) -> int:
    """In a release's venv: replay one entry, print ``{"findings": [...] or null}`` or ``{"error": line}``."""
    bug = find_bug(bug_id, load())
    try:
        found = replayer(options_from_args(argparse.Namespace(target=DEFAULT_TARGET)), log_dir)(bug)
        print(json.dumps({"findings": None if found is None else [f.to_json() for f in found]}))
    except KitError as e:
        print(json.dumps({"error": str(e)}))
    return 0


# ------------------------------------------------------------------ --write

def write_measured(path: Path, bug: KnownBug, add: Sequence[Measurement]) -> list[Measurement]:
    """Put ``add`` into ``bug``'s ``measured`` lines in ``path`` (sorted by release); a release
    already measured the same way is left as it is, one measured the other way is a KitError.
    Only that array of that entry changes.  The lines written."""
    known = {m.release: m for m in bug.measured}
    clash = [m for m in add if m.release in known and known[m.release].failed != m.failed]
    if clash:
        raise KitError(f"--write: {bug.id}: {clash[0].release} is measured {'FAIL' if known[clash[0].release].failed else 'PASS'} "
                       "already; the bisect says otherwise: settle it by hand")
    new = [m for m in add if m.release not in known]
    if not new:
        return []
    text = path.read_text()
    start = re.search(rf'^id = "{re.escape(bug.id)}"$', text, re.M)
    if start is None:
        raise KitError(f"--write: {path} has no line id = \"{bug.id}\"")
    end = text.find("\n[[bug]]", start.end())
    end = len(text) if end < 0 else end
    entry = text[start.start():end]
    lines = {m.release: m.line() for m in (*bug.measured, *new)}  # a loaded line reads back as it was written
    block = "measured = [\n" + "".join(f"    {json.dumps(lines[r])},\n" for r in sorted(lines, key=Version)) + "]"
    old = re.search(r"^measured = \[(?:[^\n]*\]$|.*?^\]$)", entry, re.M | re.S)
    if old is not None:
        entry = entry[: old.start()] + block + entry[old.end():]
    elif "\nnotes = [" in entry:
        entry = entry.replace("\nnotes = [", "\n" + block + "\nnotes = [", 1)
    else:
        entry = entry.rstrip("\n") + "\n" + block + "\n" + entry[len(entry.rstrip("\n")) + 1:]
    updated = text[: start.start()] + entry + text[end:]
    with tempfile.TemporaryDirectory() as tmp:  # the file must still load, with the new lines checked against the range
        (Path(tmp) / "known_bugs.toml").write_text(updated)
        load(Path(tmp) / "known_bugs.toml")
    path.write_text(updated)
    return new


# ------------------------------------------------------------------ the command

def ready_releases(venv_dir: Path) -> list[str]:
    """Releases with a finished venv under ``venv_dir``."""
    out = []
    for ready in venv_dir.glob(f"sglang-*/{READY}"):
        release = json.loads(ready.read_text()).get("release")
        if release and "spec" not in json.loads(ready.read_text()):
            out.append(release)
    return sorted(out, key=Version)


def run_bisect(args: argparse.Namespace, probe: Callable[[KnownBug, str], Probe] | None = None) -> int:
    bug = find_bug(args.bisect, load())
    bug.refuse_program_replay("history --bisect")
    venv_dir = Path(args.venv_dir).expanduser() if args.venv_dir else default_venv_dir()
    if args.sglang_source:
        print(f"history --bisect: {SOURCE_NA}")
    releases = parse_releases(args.releases) if args.releases else ready_releases(venv_dir)
    if not releases:
        raise KitError(f"history --bisect: no release to replay: no venv under {venv_dir}; give --releases")
    log_dir = Path(args.out) / "bisect" / bug.id
    print(f"history --bisect {bug.id}: replaying {bug.replay} on sglang-cpu over {', '.join(releases)}; server logs in {log_dir}")
    replay = probe or (lambda b, r: probe_in_venv(b, r, venv_dir, log_dir))
    bracket = search(bug, releases, lambda r: _logged(replay(bug, r)))
    print("\n".join(bracket.lines()))
    problems = bracket.disagreements(bug)
    recorded = f"recorded: first bad {bug.first_bad or '-'}, first good {bug.first_good or '-'}"
    if args.format == "json":
        print(json.dumps({"bug": bug.id, **{k: v for k, v in asdict(bracket).items() if k != "probes"},
                          "probes": [asdict(p) for _, p in _ordered(bracket.probes)], "disagreements": problems}, indent=2))
    print(f"{recorded}: " + ("the bisect agrees" if not problems else "the bisect disagrees: " + "; ".join(problems)))
    if args.write:
        if problems:
            print("--write: nothing written (the bisect disagrees with the entry)")
        else:
            written = write_measured(known_bugs_file(), bug, bracket.measurements())
            print(f"--write: {len(written)} measured line(s) into {known_bugs_file()}" + (": " + "; ".join(m.line() for m in written) if written else "")
                  + ("; regenerate docs/known-bugs.md: python -m conformance.session.known_bugs_doc > docs/known-bugs.md" if written else ""))
    return 1 if problems else 0


def _logged(p: Probe) -> Probe:
    print(f"  replayed {p.release}: {p.status}", file=sys.stderr, flush=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs inside a release's venv
    p = argparse.ArgumentParser(prog="python -m conformance.commands.bisect")
    p.add_argument("--probe", required=True, metavar="ID", help="replay this entry once and print one JSON line")
    p.add_argument("--log-dir", required=True)
    args = p.parse_args(argv)
    return _probe_main(args.probe, Path(args.log_dir))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
