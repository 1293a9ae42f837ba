"""``hybrid-conformance history --peer-kits [ID,...|all]``: would SGLang's own test kits have
caught each known bug?  The peer baseline of ``docs/peer-baseline.md``.

For each known bug (an entry and its variants: one row), on the release that shipped it and
on the release that fixed it, inside that release's venv (made if missing, as ``history``
makes them): the entry's replay cell is served on ``sglang-cpu`` with the entry's recorded
env, and SGLang's own kits as that release ships them (``conformance/sglang_api/peer_kits.py``)
play against it.  Then, on the bad release, the kit's own replay runs (``known-bugs``' player).

A kit test **caught** the bug when it fails on the bad release and passes on the good one;
one that fails on both is failing for another reason (not a catch); one that passes on the
bad release missed it.  SGLang's verdict on the same server is what SGLang itself said while
the kits ran: whether its server was still serving afterwards, else the cause its log names
(an idle leak check, an assertion).  ``--doc FILE`` writes the table page.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from packaging.version import Version

from conformance.checks.leaks import death_cause
from conformance.commands.bisect import Probe, probe_json, ready_releases
from conformance.commands.history import default_venv_dir
from conformance.commands.known_bugs import recorded_env, replay_cell, replayer
from conformance.commands.report_bug import find_bug
from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TARGET
from conformance.session.known_bugs import KnownBug, load
from conformance.session.options import options_from_args
from conformance.sglang_api.peer_kits import PEER_KITS, KitOutcome, PeerServer, play_kits
from conformance.targets.serving import serve_cell

ALL = "all"


@dataclass(frozen=True)
class ReleaseRun:
    """The kits, SGLang's verdict and (on the bad release) the kit's replay on one release."""

    release: str
    kits: tuple[KitOutcome, ...] = ()
    sglang: str = ""  # SGLang's own verdict on the server the kits ran on
    replay: Probe | None = None
    error: str = ""  # why nothing ran

    @classmethod
    def from_json(cls, release: str, d: dict) -> ReleaseRun:
        """A run read back (the probe inside the venv does not know its release: ``release`` fills it)."""
        replay = d.get("replay")
        return cls(release, tuple(KitOutcome.from_json(k) for k in d.get("kits") or []), str(d.get("sglang", "")),
                   Probe(replay.get("release") or release, replay["status"], replay.get("line", "")) if replay else None,
                   str(d.get("error", "")))


@dataclass(frozen=True)
class PeerRow:
    """One known bug: the kit's catch and SGLang's kits' catches, from its bad and good release."""

    bug: KnownBug
    checks: tuple[str, ...]  # the kit's checks that have an entry for it (the entry and its variants)
    bad: ReleaseRun
    good: ReleaseRun | None
    #: other known bugs on the same cell, present on the bad release and fixed by the good one:
    #: a kit test failing only on the bad release may be failing for them
    alongside: tuple[str, ...] = ()

    def caught_by_kits(self) -> list[str]:
        """``kit.test`` of every SGLang kit test that fails on the bad release and passes on the
        good (none without a good release: a failure there cannot be told from one of every release)."""
        return [f"{k.kit}.{k.test}" for k in self.bad.kits if self.verdict(k) == "caught"]

    def verdict(self, outcome: KitOutcome) -> str:
        """One kit test's verdict on this bug: caught / missed / fails on both / n/a."""
        if outcome.status == "n/a":
            return "n/a"
        if outcome.status == "pass":
            return "missed"
        if self.good is None:
            return "fails (no fixed release to compare)"
        after = next((k.status for k in self.good.kits if (k.kit, k.test) == (outcome.kit, outcome.test)), "n/a")
        return "caught" if after == "pass" else "fails on both" if after == "fail" else "fails (n/a on the good release)"

    def kit_catch(self) -> str:
        if self.bad.error:
            return f"not run: {self.bad.error}"
        r = self.bad.replay
        if r is None:
            return "replay not run"
        return f"yes: {', '.join(self.checks)} ({r.line[:120]})" if r.status == "bad" else f"no on {r.release}: {r.status} ({r.line[:120]})"

    def to_json(self) -> dict:
        return {"bug": self.bug.id, "releases": self.bug.releases, "checks": list(self.checks), "bad": _run_json(self.bad),
                "good": _run_json(self.good) if self.good else None, "caught_by_sglang_kits": self.caught_by_kits(),
                "verdicts": {f"{k.kit}.{k.test}": self.verdict(k) for k in self.bad.kits}, "alongside": list(self.alongside)}


def rows_from_json(records: Sequence[dict], bugs: Sequence[KnownBug]) -> list[PeerRow]:
    """``peer-kits.json`` read back into rows (the table re-rendered without replaying)."""
    by_id = {b.id: b for b in bugs}
    return [PeerRow(by_id[d["bug"]], tuple(d["checks"]), ReleaseRun.from_json(d["bad"]["release"], d["bad"]),
                    ReleaseRun.from_json(d["good"]["release"], d["good"]) if d.get("good") else None,
                    tuple(d.get("alongside") or ())) for d in records]


def alongside(bug: KnownBug, cell: str, bad: str, good: str | None, groups: dict[str, list[KnownBug]]) -> tuple[str, ...]:
    """The other known bugs with an entry on ``cell`` in range on ``bad`` and not on ``good``."""
    return tuple(head for head, entries in groups.items() if head != bug.id and any(
        cell in e.cells and e.in_range(bad) and (good is None or not e.in_range(good)) for e in entries))


def _run_json(r: ReleaseRun) -> dict:
    return {"release": r.release, "kits": [k.to_json() for k in r.kits], "sglang": r.sglang, "error": r.error,
            "replay": asdict(r.replay) if r.replay else None}


def bug_groups(bugs: Sequence[KnownBug]) -> dict[str, list[KnownBug]]:
    """Each bug's entries (the entry first, then its variants), by the entry's id."""
    groups: dict[str, list[KnownBug]] = {}
    for b in bugs:
        groups.setdefault(b.variant_of or b.id, []).append(b)
    return {k: sorted(v, key=lambda b: b.id != k) for k, v in groups.items()}


def bracket_releases(bug: KnownBug, ready: set[str]) -> tuple[str, str | None]:
    """The bad and the good release to play: of the releases measured failing (passing, after
    the bad one), the oldest (newest failing's next) with a venv ready, else the entry's
    recorded first bad (first good), whose venv is then made."""
    if bug.first_bad is None:
        raise KitError(f"history --peer-kits: {bug.id} has no measured first bad release")
    failing = sorted({m.release for m in bug.measured if m.failed} | {bug.first_bad}, key=Version)
    bad = next((r for r in failing if r in ready), bug.first_bad)
    passing = sorted((m.release for m in bug.measured if not m.failed and Version(m.release) > Version(bad)), key=Version)
    good = next((r for r in passing if r in ready), bug.first_good)
    return bad, good


# ------------------------------------------------------------------ inside a release's venv

def _probe_main(bug_id: str, log_dir: Path, with_replay: bool) -> int:
    """Serve the entry's cell, play SGLang's kits, read SGLang's verdict, replay; one JSON line."""
    bug = find_bug(bug_id, load())
    options = options_from_args(argparse.Namespace(target=DEFAULT_TARGET))
    try:
        program, cell = replay_cell(bug, options.matrix_path)
        with recorded_env(program), serve_cell(cell, options, log_dir=log_dir / "kits") as ep:
            info = ep.info or {}
            server = PeerServer(ep.base_url, str(info.get("model_path") or ""), cell.model.family, cell.track_interval,
                                ep.process.exit_reason, int(info.get("max_total_num_tokens") or 0),
                                str(info.get("mamba_scheduler_strategy") or cell.strategy.name), not info.get("disable_overlap_schedule"))
            kits = play_kits(server)
            gone = ep.process.exit_reason()
            log = Path(ep.process.log_path).read_text(errors="replace") if gone else ""
            sglang = "serving after the kits" if gone is None else f"died: {death_cause(log)[:300]}"
        result: dict = {"kits": [k.to_json() for k in kits], "sglang": sglang}
        if with_replay:
            result["replay"] = asdict(Probe.classify(bug, "", replayer(options, log_dir / "replay")(bug)))
    except KitError as e:
        result = {"error": str(e)}
    print(json.dumps(result))
    return 0


def probe_in_venv(bug: KnownBug, release: str, venv_dir: Path, log_dir: Path, with_replay: bool) -> ReleaseRun:
    """``python -m conformance.commands.peer_kits --probe ID`` in ``release``'s venv."""
    return ReleaseRun.from_json(release, probe_json("conformance.commands.peer_kits", bug, release, venv_dir, log_dir,
                                                    what="the probe", extra=["--replay"] if with_replay else []))


# ------------------------------------------------------------------ the table

def markdown(rows: Sequence[PeerRow], command: str, when: str) -> str:
    """The docs page: how to read it, then one row per bug."""
    kits = ", ".join(f"`{k.name}` ({', '.join(t.removeprefix('test_') for t in k.tests)})" for k in PEER_KITS)
    skipped = "; ".join(f"`{k.name}.{t.removeprefix('test_')}` ({why})" for k in PEER_KITS for t, why in k.not_played.items())
    out = [
        "# The peer baseline: would SGLang's own test kits have caught the known bugs?",
        "",
        "Each known SGLang bug (`fixtures/known_bugs.toml`, one row per bug and its variants) was served",
        "on `sglang-cpu` on the release that shipped it and on the release that fixed it, on the cell",
        "and env of its replay, and SGLang's own HTTP test kits, as each release ships them under",
        f"`sglang/test/kits/`, played against that server: {kits}.",
        "Thresholds are SGLang's own CI values for the model family; sample counts and decode lengths",
        "are scaled to two CPU cores (`conformance/sglang_api/peer_kits.py`).",
        f"Not played here: {skipped}.",
        "",
        "How to read a row:",
        "- **caught by the kit**: the kit's own replay of the entry, on the bad release, found the entry's",
        "  finding; the checks listed are the kit checks with an entry for the bug.",
        "- **caught by SGLang's kits**: the kit tests that fail on the bad release *and pass on the good one*,",
        "  each with its failure line: whether that failure is the bug's effect is read from the line (any other",
        "  change between the two releases can fail a test too).",
        "  A test failing on both releases fails for another reason and is not counted; `none` means every",
        "  played test passed on the bad release or failed on both. Where another known bug sits on the same",
        "  cell and is fixed by the same release, the row says a catch cannot be told from it.",
        "- **SGLang's verdict**: what SGLang itself said on the server the kits ran on (still serving, or",
        "  the cause its log names when its own check or assertion stopped it), bad release / good release.",
        "",
        f"Measured {when} with `{command}` (regenerate the page with the same command and `--doc`).",
        "",
        "| bug | releases | bad / good release | caught by the kit | caught by SGLang's kits | SGLang's verdict (bad / good) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines = {f"{k.kit}.{k.test}": k.line for k in r.bad.kits}
        caught = ", ".join(f"`{c}` ({_short(lines[c])})" for c in r.caught_by_kits()) or "none"
        failing = [f"{k.kit}.{k.test}" for k in r.bad.kits if r.verdict(k).startswith("fails")]
        if failing:
            caught += (f" (failing on both releases: {', '.join(failing)})" if r.good else
                       f" (failing, with no fixed release to tell them from failures of every release: {', '.join(failing)})")
        if r.alongside and r.caught_by_kits():
            caught += f" (cannot be told from {', '.join(f'`{a}`' for a in r.alongside)}: on this cell too, fixed by the same release)"
        if r.bad.error:
            caught = f"not run: {r.bad.error[:150]}"
        good = r.good.release if r.good else "none fixed"
        sglang = f"{r.bad.sglang or r.bad.error[:80]} / {(r.good.sglang or r.good.error[:80]) if r.good else '-'}"
        out.append(f"| `{r.bug.id}` | `{r.bug.releases}` | {r.bad.release} / {good} | {_cell(r.kit_catch())} | {_cell(caught)} | {_cell(sglang)} |")
    return "\n".join(out) + "\n"


def _short(line: str) -> str:
    """A kit failure's line, short enough for a table cell."""
    return line if len(line) <= 90 else line[:87] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------ the command

def run_peer_kits(args: argparse.Namespace, probe: Callable[[KnownBug, str, bool], ReleaseRun] | None = None) -> int:
    bugs = load()
    groups = bug_groups(bugs)
    wanted = list(groups) if args.peer_kits == ALL else [find_bug(i.strip(), bugs).id for i in args.peer_kits.split(",")]
    unknown = [w for w in wanted if w not in groups]
    if unknown:
        raise KitError(f"history --peer-kits: {unknown[0]} is a variant; name its bug ({find_bug(unknown[0], bugs).variant_of})")
    venv_dir = Path(args.venv_dir).expanduser() if args.venv_dir else default_venv_dir()
    log_dir = Path(args.out) / "peer-kits"
    ready = set(ready_releases(venv_dir))
    play = probe or (lambda b, r, replay: probe_in_venv(b, r, venv_dir, log_dir / b.id, replay))
    print(f"history --peer-kits: {len(wanted)} bug(s); SGLang's kits and the kit's replay per bug's bad and good release; logs in {log_dir}")
    rows = []
    for bug_id in wanted:
        bug, *variants = groups[bug_id]
        bad_release, good_release = bracket_releases(bug, ready)
        bad = play(bug, bad_release, True)
        good = play(bug, good_release, False) if good_release else None
        cell = replay_cell(bug)[1].id
        row = PeerRow(bug, tuple(dict.fromkeys(b.check for b in (bug, *variants))), bad, good,
                      alongside(bug, cell, bad.release, good.release if good else None, groups))
        rows.append(row)
        print(f"{bug.id}: kit {row.kit_catch()}; SGLang's kits caught: {', '.join(row.caught_by_kits()) or 'none'}; "
              f"SGLang: {bad.sglang or bad.error} / {good.sglang or good.error if good else '-'}", flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "peer-kits.json").write_text(json.dumps([r.to_json() for r in rows], indent=2))
    command = "hybrid-conformance history --peer-kits " + args.peer_kits
    text = markdown(rows, command, datetime.date.today().isoformat())
    if args.doc:
        Path(args.doc).write_text(text)
        print(f"wrote {args.doc}")
    else:
        print(text)
    errors = [r.bug.id for r in rows if r.bad.error]
    return 1 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs inside a release's venv
    p = argparse.ArgumentParser(prog="python -m conformance.commands.peer_kits")
    p.add_argument("--probe", required=True, metavar="ID")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--replay", action="store_true", help="also replay the entry (the kit's verdict)")
    args = p.parse_args(argv)
    return _probe_main(args.probe, Path(args.log_dir), args.replay)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
