"""``hybrid-conformance replay FILE --target ...``: play one program file, judged as in the suite.

The file names its cell (looked up in the matrix) and the seeded-fault environment it was
found under (applied to the server unless ``--no-recorded-env``).  The cell's server and
its cache-off twin start, the program runs ``--repeat`` times, and each run prints
PASS or the finding with the step trace.  Exit 1 when a run failed (the finding
reproduced), 0 when every run passed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from conformance.errors import KitError
from conformance.matrix.cells import Cell, load_matrix
from conformance.session.options import DTYPE, GPUS, LAUNCHER, MATRIX, TARGET, TWINS, Options, add_arguments as add_options, options_from_args
from conformance.programs.program import Program, load_program
from conformance.targets.registry import FUZZ_TARGET, HTTP_TARGETS, target_help
from conformance.programs.runner import ProgramFailure
from conformance.programs.bind import serve_cold, target_for
from conformance.programs.runner import run_program
from conformance.targets.serving import serve_cell


def find_cell(program: Program, matrix_path: str | None) -> Cell:
    cell_id = program.cell.get("id")
    if not cell_id:
        raise KitError("program file names no cell (its 'cell' has no 'id'); write it with the suite or add the cell id")
    matrix = load_matrix(matrix_path)
    cells = {c.id: c for c in matrix.select(tier="nightly", faults=list(matrix.faults))}  # with overlaid faults' cells
    if cell_id not in cells:
        raise KitError(f"program file's cell {cell_id!r} is not in the matrix; known: {', '.join(sorted(cells)[:6])} ...")
    return cells[cell_id]


#: ``replay --target``: the targets that serve a program's requests over HTTP.
REPLAY_TARGET = dataclasses.replace(TARGET, choices=HTTP_TARGETS, help=f"{target_help(HTTP_TARGETS)} (default: {{default}})")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a program file written by the programs suite (or by hand)")
    add_options(p, (REPLAY_TARGET, DTYPE, MATRIX, LAUNCHER, GPUS, TWINS), target=FUZZ_TARGET)
    p.add_argument("--repeat", type=int, default=1, help="play the program this many times (timing can matter)")
    p.add_argument("--log-dir", help="server logs (default: a temporary folder, printed)")
    p.add_argument("--no-recorded-env", action="store_true", help="do not apply the seeded-fault env the file was found under")


def replay(args: argparse.Namespace) -> int:
    program = load_program(args.file)
    cell = find_cell(program, args.matrix)
    if args.repeat < 1:
        raise KitError(f"--repeat must be >= 1, got {args.repeat}")
    if program.env and not args.no_recorded_env:
        os.environ.update(program.env)
        print("applied the recorded env: " + " ".join(f"{k}={v}" for k, v in program.env.items()))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hc-replay-"))
    print(f"replaying {args.file} ({len(program.steps)} steps) on {args.target} cell {cell.id}; server logs in {log_dir}")
    failures = 0
    for i, outcome in enumerate(play(program, cell, options_from_args(args), log_dir, args.repeat)):
        if isinstance(outcome, ProgramFailure):
            failures += 1
            print(f"run {i + 1}: FAIL at {outcome} [{', '.join(dict.fromkeys(f.kind for f in outcome.findings))}]")
            print("\n".join(outcome.trace[-40:]))
            continue
        print(f"run {i + 1}: PASS ({outcome.requests} requests, {outcome.hits} hits, {outcome.compared_tokens} tokens compared, "
              f"{outcome.idle_checks} idle checks, {outcome.seconds:.1f}s)" + _late(outcome.late_aborts))
    print(f"{failures}/{args.repeat} runs failed")
    return 1 if failures else 0


def play(program: Program, cell: Cell, options: Options, log_dir: Path, repeat: int = 1) -> Iterator[Any]:
    """Serve ``cell`` and its cache-off twin, play ``program`` ``repeat`` times: each run's
    ``RunStats`` or its ``ProgramFailure``.  A play that leaves either server dead gets the
    next play fresh servers (their logs under ``log_dir/launch-N``), so one death is one
    failed play, not every play after it."""
    played, launch = 0, 0
    while played < repeat:
        here = log_dir if launch == 0 else log_dir / f"launch-{launch + 1}"
        launch += 1
        with serve_cell(cell, options, log_dir=here) as ep, serve_cold(cell, options, here) as cold:
            target = target_for(ep, cold)
            while played < repeat:
                played += 1
                try:
                    yield run_program(program, target)
                except ProgramFailure as f:
                    yield f
                    if _dead(ep) or _dead(cold):
                        break


def _late(rids: list[str]) -> str:
    """The PASS line's warning that a play did not abort what the program aborts."""
    if not rids:
        return ""
    return f"; not played as written: {', '.join(rids)} finished before its abort was sent"


def _dead(ep: Any) -> bool:
    """Has the endpoint's server process exited (False for one the kit did not start)?"""
    return ep.process is not None and ep.process.exit_reason() is not None


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the CLI verb is the entry point
    p = argparse.ArgumentParser(prog="hybrid-conformance replay")
    add_arguments(p)
    try:
        return replay(p.parse_args(argv))
    except KitError as e:
        print(f"hybrid-conformance: error: {e}", file=sys.stderr)
        return 2
