"""``hybrid-conformance known-bugs --target sglang-cpu``: replay every known SGLang bug
(``fixtures/known_bugs.toml``) the installed release is in range of; strict.

Each entry's program is played once on its cell (and the cache-off twin) with the
recorded env.  An entry whose program still fails with a finding of its kind (and facts,
and ``match``: ``KnownBug.reproduced_by``) prints
"known SGLang bug, still present"; one whose program passes (or fails otherwise) is red:
exit 1, "no longer reproduces: remove or narrow the entry".  Entries out of range are
listed and not played.  Exit 0 when every entry in range reproduced (or none is in range).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from conformance.errors import KitError
from conformance.checks.findings import Finding
from conformance.session.known_bugs import KnownBug, check_entries, installed_release, known_bugs_file, load
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


def cmd_known_bugs(args: argparse.Namespace) -> int:
    if args.file and not Path(args.file).is_file():
        raise KitError(f"--file: {args.file} does not exist")
    bugs = load(args.file)
    release = installed_release()
    in_range = [b for b in bugs if args.target in b.targets and b.in_range(release)]
    for b in bugs:
        if b not in in_range:
            print(f"{b.id}: not played (releases {b.releases}, targets {', '.join(b.targets)}; installed sglang {release}, target {args.target})")
    if not in_range:
        print(f"{len(bugs)} known SGLang bug(s) in {args.file or known_bugs_file()}, none in range of sglang {release} on {args.target}")
        return 0
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hc-known-bugs-"))
    print(f"replaying {len(in_range)} known SGLang bug(s) on sglang {release}; server logs in {log_dir}")
    results = check_entries(in_range, target=args.target, release=release, replay=replayer(options_from_args(args), log_dir))
    for r in results:
        print(r.line)
    bad = [r for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} still present" + (f"; {len(bad)} no longer as recorded: red" if bad else ""))
    return 1 if bad else 0
