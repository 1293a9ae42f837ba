"""``hybrid-conformance known-bugs --target sglang-cpu``: replay every known SGLang bug
(``fixtures/known_bugs.toml``) the installed release is in range of; strict.

Each entry's program is played once on its cell (and the cache-off twin) with the
recorded env.  An entry whose program still fails with a finding of its kind (and facts,
and ``match``: ``KnownBug.reproduced_by``) prints
"known SGLang bug, still present"; one whose program passes (or fails otherwise) is red:
exit 1, "no longer reproduces: remove or narrow the entry".  Entries out of range are
listed and not played.  Exit 0 when every entry in range reproduced (or none is in range).

An entry of a scripted suite's check (kl, leaks, prefix_branching, gsm8k, agreement, disagg)
excuses that suite's failure, not only its program's: the suite itself runs on the entry's
cell too (``hybrid-conformance run --cells CELL --suite CHECK`` with no known bug excused),
and must fail with a finding the entry excuses (kind, ``where`` facts, ``match``).
``--programs-only`` skips those runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from conformance.errors import KitError
from conformance.checks.findings import Finding, findings_of
from conformance.session.known_bugs import KNOWN_BUGS_ENV, KnownBug, check_entries, installed_release, known_bugs_file, load
from conformance.session.options import Options, options_from_args
from conformance.session.options import DTYPE, LAUNCHER, MATRIX, TWINS, add_arguments as add_options
from conformance.programs.replay import REPLAY_TARGET
from conformance.targets.registry import FUZZ_TARGET
from conformance.matrix.cells import Cell
from conformance.programs.program import Program, load_program
from conformance.programs.replay import find_cell, play
from conformance.programs.runner import ProgramFailure


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, (REPLAY_TARGET, DTYPE, MATRIX, LAUNCHER, TWINS), target=FUZZ_TARGET)
    p.add_argument("--file", help=f"the known-bugs file (default: {known_bugs_file()})")
    p.add_argument("--log-dir", help="server logs (default: a temporary folder, printed)")
    p.add_argument("--only", help="comma list of entry ids to replay (default: every entry in range)")
    p.add_argument("--programs-only", action="store_true", help="replay the entries' programs only, not the scripted suite an entry of kl, leaks, ... excuses")
    p.add_argument("--suite-timeout", type=int, default=SUITE_TIMEOUT_S, help="seconds one entry's suite run may take (default: %(default)s)")


#: How long one entry's suite run may take before it counts as not reproduced.
SUITE_TIMEOUT_S = 3600


def replay_cell(bug: KnownBug, matrix_path: str | None = None) -> tuple[Program, Cell]:
    """The entry's replay program and the matrix cell it names (a one-line KitError when the
    file does not load or names no cell of the matrix).  Starts nothing."""
    try:
        program = load_program(str(bug.replay_path()))
        return program, find_cell(program, matrix_path)
    except KitError as e:
        raise KitError(f"bug {bug.id!r}: replay {bug.replay}: {e}") from None


@contextlib.contextmanager
def recorded_env(program: Program) -> Iterator[None]:
    """The environment the program file recorded (its seeded-fault switches), for the block."""
    saved = dict(os.environ)
    os.environ.update(program.env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def replayer(options: Options, log_dir: Path) -> Callable[[KnownBug], list[Finding] | None]:
    """bug -> its replay's findings, or None when the program passed."""
    def replay(bug: KnownBug) -> list[Finding] | None:
        program, cell = replay_cell(bug, options.matrix_path)
        with recorded_env(program):
            for outcome in play(program, cell, options, log_dir / bug.id, repeat=bug.attempts):
                if isinstance(outcome, ProgramFailure):  # the first failing play is the replay's answer
                    return outcome.findings
        return None

    return replay


def suite_cell(bug: KnownBug, cell: Cell) -> str:
    """The cell an entry's suite replays on: its program's, when the entry lists it or lists none."""
    return cell.id if not bug.cells or cell.id in bug.cells else bug.cells[0]


def suite_findings(report: dict, cell_id: str, check: str) -> list[Finding] | None:
    """The findings of ``check`` on ``cell_id`` in a run's report.json (None: it passed); a
    verdict that is missing, errored or skipped is one finding saying so (it did not reproduce)."""
    cell = next((c for c in report.get("cells", ()) if c.get("id") == cell_id), None)
    verdict = (cell or {}).get("checks", {}).get(check)
    if verdict is None:
        seen = ", ".join(f"{k} {v.get('status')}: {str(v.get('reason', ''))[:160]}" for k, v in (cell or {}).get("checks", {}).items())
        return [Finding("unclassified", f"the {check} suite gave no verdict on {cell_id}" + (f" ({seen})" if seen else ""))]
    if verdict.get("status") == "pass":
        return None
    return findings_of(verdict) or [Finding("unclassified", f"{check} {verdict.get('status')}: {verdict.get('reason', '')}")]


#: The tier a suite replay selects its one cell from: the nightly tier holds every matrix cell
#: (an entry's cell may be an option cell no smaller tier runs).
SUITE_TIER = "nightly"


def suite_replayer(args: argparse.Namespace, log_dir: Path) -> Callable[[KnownBug], list[Finding] | None]:
    """bug -> the findings of its check's suite run on its cell, or None when the suite passed."""
    def replay(bug: KnownBug) -> list[Finding] | None:
        program, cell = replay_cell(bug, args.matrix)
        cell_id = suite_cell(bug, cell)
        out = log_dir / bug.id / f"suite-{bug.check}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").unlink(missing_ok=True)  # an earlier run's report is not this one's
        no_bugs = out / "no-known-bugs.toml"
        no_bugs.write_text("# the suite replay excuses nothing: its failure is judged against the entry\n")
        argv = [sys.executable, "-m", "conformance.cli", "run", "--target", args.target, "--cells", cell_id, "--suite", bug.check,
                "--tier", SUITE_TIER, "--report-dir", str(out), "-n", "0", *(["--matrix", args.matrix] if args.matrix else []),
                *(["--dtype", args.dtype] if getattr(args, "dtype", None) else [])]
        env = {**os.environ, **program.env, KNOWN_BUGS_ENV: str(no_bugs)}
        print(f"{bug.id}: running the {bug.check} suite on {cell_id}: hybrid-conformance {' '.join(argv[3:])}", flush=True)
        try:
            with (out / "run.log").open("w") as log:
                subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.suite_timeout, check=False)
        except subprocess.TimeoutExpired:
            return [Finding("unclassified", f"the {bug.check} suite on {cell_id} did not finish in {args.suite_timeout} s (log {out / 'run.log'})")]
        try:
            report = json.loads((out / "report.json").read_text())
        except (OSError, ValueError) as e:
            return [Finding("unclassified", f"the {bug.check} suite on {cell_id} wrote no report ({e}; log {out / 'run.log'})")]
        return suite_findings(report, cell_id, bug.check)

    return replay


def cmd_known_bugs(args: argparse.Namespace) -> int:
    if args.file and not Path(args.file).is_file():
        raise KitError(f"--file: {args.file} does not exist")
    bugs = load(args.file)
    release = installed_release()
    only = {x.strip() for x in (args.only or "").split(",") if x.strip()}
    unknown = sorted(only - {b.id for b in bugs})
    if unknown:
        raise KitError(f"--only: no entry {', '.join(unknown)} in {args.file or known_bugs_file()}")
    in_range = [b for b in bugs if args.target in b.targets and b.in_range(release) and (not only or b.id in only)]
    for b in bugs:
        if b not in in_range and (not only or b.id in only):
            print(f"{b.id}: not played (releases {b.releases}, targets {', '.join(b.targets)}; installed sglang {release}, target {args.target})")
    if not in_range:
        print(f"{len(bugs)} known SGLang bug(s) in {args.file or known_bugs_file()}, none in range of sglang {release} on {args.target}")
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hc-known-bugs-"))
    print(f"replaying {len(in_range)} known SGLang bug(s) on sglang {release}; server logs in {log_dir}")
    results = check_entries(in_range, target=args.target, release=release, replay=replayer(options_from_args(args), log_dir),
                            suite_replay=None if args.programs_only else suite_replayer(args, log_dir))
    for r in results:
        print(r.line)
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} still present" + (f"; {len(bad)} no longer as recorded: red" if bad else ""))
    return 1 if bad else 0
