"""``hybrid-conformance report-bug ID [--out DIR]``: a folder an SGLang engineer can act on
without reading the kit, for one entry of ``fixtures/known_bugs.toml``.

It writes (default ``reports/bugs/ID/``) every :data:`~conformance.commands.bug_artefacts.ARTEFACTS`
file: ``README.md`` (one page in SGLang's terms), ``server_command.sh`` (the entry's cell on
``sglang-cpu``, its LaunchSpec as the kit runs it), ``repro.py`` (the request sequence,
standalone) and ``test_regression.py`` (SGLang's own test style, a real model on a GPU).
Starts nothing.  An unknown ID is one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from pathlib import Path
from typing import Iterable

from conformance.commands.bug_artefacts import ARTEFACTS, LAUNCHER_FLAGS, PORT, BugCase
from conformance.commands.bug_plan import plan_for
from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TARGET
from conformance.programs.program import load_program
from conformance.report.known_bugs import BUGS_DIR, BugHit, bug_hits
from conformance.programs.replay import find_cell
from conformance.session.known_bugs import KnownBug, installed_release, known_bugs_file, load
from conformance.session.options import DTYPE, MATRIX, Options, add_arguments as add_options, options_from_args
from conformance.targets.registry import target_for
from conformance.targets.serving import spec_for
from conformance.targets.sglang_cpu import SGLANG_SELF_CHECKS

DEFAULT_OUT = Path("reports") / "bugs"
GPU_TARGET = "sglang"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the entry's id in fixtures/known_bugs.toml")
    p.add_argument("--out", help=f"the folder to write (default: {DEFAULT_OUT}/ID)")
    add_options(p, (DTYPE, MATRIX))
    p.set_defaults(target=DEFAULT_TARGET)  # the folder's command is the sglang-cpu server's


def find_bug(bug_id: str, bugs: list[KnownBug]) -> KnownBug:
    """The entry named ``bug_id``; KitError naming the closest ids otherwise."""
    by_id = {b.id: b for b in bugs}
    if bug_id in by_id:
        return by_id[bug_id]
    close = difflib.get_close_matches(bug_id, list(by_id), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(by_id)} known (hybrid-conformance known-bugs lists them)"
    raise KitError(f"unknown bug id {bug_id!r} in {known_bugs_file()}{hint}")


def _without_launcher_flags(args: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in LAUNCHER_FLAGS:
            skip = True
        else:
            out.append(a)
    return tuple(out)


def case_for(bug: KnownBug, options: Options) -> BugCase:
    """The entry with its program, cell, launch specs and plan resolved."""
    bug.refuse_program_replay("report-bug")
    program = load_program(bug.replay_path())
    cell = find_cell(program, options.matrix_path)
    spec = spec_for(cell, options, port=PORT)
    spec = dataclasses.replace(spec, env={**spec.env, **program.env})  # the recorded env, as replay applies it
    gpu = target_for(GPU_TARGET).launcher(options)
    gpu_args = _without_launcher_flags(gpu.server_args(cell, model_path=cell.model.hf_path, port=PORT))
    exact = target_for(options).exact_mode({"dtype": options.dtype or "float32"})
    plan = plan_for(program, cell, spec.argv, exact=exact, title=f"SGLang bug {bug.id}: {bug.summary[:160]}")
    return BugCase(bug, program, cell, installed_release() or "?", spec, gpu_args, {**dict(cell.env), **SGLANG_SELF_CHECKS, **program.env}, plan)


def write_folder(case: BugCase, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [a.write(case, folder) for a in ARTEFACTS]


def cmd_report_bug(args: argparse.Namespace) -> int:
    bug = find_bug(args.id, load())
    case = case_for(bug, options_from_args(args))
    folder = Path(args.out) if args.out else DEFAULT_OUT / bug.id
    for path, artefact in zip(write_folder(case, folder), ARTEFACTS):
        print(f"{path}: {artefact.what}")
    print(f"report-bug {bug.id}: first bad {bug.first_bad or '?'}, first good {bug.first_good or 'none measured'}; "
          f"reproduce: bash {folder / 'server_command.sh'}, then python3 {folder / 'repro.py'} --url http://127.0.0.1:{PORT}")
    return 0


def write_bug_folders(report: dict, report_dir: Path, options: Options) -> list[str]:
    """A bug folder (``report_dir/bugs/ID/``) for every known bug the run hit; one line per
    folder written or not written (why), for the run's output."""
    return [line for _, line in write_hit_folders(bug_hits(report), report_dir, options)]


def write_hit_folders(hits: Iterable[BugHit], out_dir: Path, options: Options) -> list[tuple[BugHit, str]]:
    """A bug folder (``out_dir/bugs/ID/``) for each hit (a run's or a history's), each hit with
    ``written`` set and its line (the folder, or why it was not written)."""
    bugs = {b.id: b for b in load()}
    out = []
    for hit in hits:
        folder = out_dir / BUGS_DIR / hit.id
        try:
            write_folder(case_for(bugs[hit.id], options), folder)
            out.append((dataclasses.replace(hit, written=True), f"bug folder: {folder}"))
        except (KeyError, KitError, OSError) as e:
            out.append((dataclasses.replace(hit, written=False), f"bug folder for {hit.id} not written: {type(e).__name__}: {e}"))
    return out
