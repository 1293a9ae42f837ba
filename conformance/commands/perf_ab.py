"""``hybrid-conformance perf-ab --target sglang-cpu``: the paired A/B perf mode.

Two servers of one cell in one run, both with the seeded fault ``step_slowdown`` at grade 0
(``conformance/suites/perf/ab.py``); per repeat a fresh pair, then per grade one paired run that
slows a randomly drawn side by that fraction of each model step and asks the paired test
(``conformance/checks/perf_ab.py``) whether that side got slower.  Grade 0 is the clean pair.
Prints one verdict line per run and the flagged count per grade; exit 0 when every verdict
says what was done (a slowed side flagged, a clean pair not), 1 otherwise.  Detection rates
measured with it: docs/perf.md.

``--fault NAME``: instead of the grades, per repeat a fresh pair with the seeded SGLang fault
NAME (at its defaults) on a randomly drawn side and no fault on the other; ``--fault none``
is a clean pair.  ``--json PATH`` writes every run's row (``mutants`` reads it to score a
fault through the paired test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from conformance.errors import KitError
from conformance.targets.registry import PERF_AB, accepting, target_help
from conformance.checks.perf_ab import ALPHA
from conformance.session.options import DTYPE, LAUNCHER, MATRIX, TARGET, add_arguments as add_options
from conformance.suites.perf.ab import AbPlan
from conformance.checks.perf_ab import MIN_PAIRS
from conformance.matrix.cells import load_matrix
from conformance.session.options import options_from_args
from conformance.suites.perf import ab
from conformance.session.preflight import preflight_only
from conformance.sglang_plugins.faults.step_slowdown import parse_grade
from conformance.sglang_plugins.faults.spec import FaultInstallError
from conformance.targets import preimport
from conformance.sglang_plugins.faults.catalogue import faults

#: The targets ``perf-ab`` takes: their servers load the kit's SGLang plugins (the graded fault lives there).
AB_TARGETS = accepting(PERF_AB)


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = dataclasses.replace(TARGET, choices=AB_TARGETS, help=f"{target_help(AB_TARGETS)} (default: {{default}})")
    add_options(p, (target, DTYPE, MATRIX, LAUNCHER), target=AB_TARGETS[0])
    p.add_argument("--cell", default="qwen3-next-80b-extra_buffer-p1-t256", help="the matrix cell both servers serve (default: %(default)s)")
    p.add_argument("--grades", default=None, help="comma list of slowdowns, fractions of a model step's work; 0 = the clean pair (default: 0,0.1)")
    p.add_argument("--fault", default=None, help="instead of --grades: this seeded SGLang fault (docs/faults.md) on one drawn side, none on the other ('none': a clean pair)")
    p.add_argument("--json", default=None, help="write every run's row (grade or fault, side, verdict, p-values) to this file")
    p.add_argument("--repeats", type=int, default=1, help="fresh server pairs (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=AbPlan.pairs, help="prompts per paired run, each sent to both servers (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=ALPHA, help="the stated false-flag rate of a clean pair (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", help="server logs (default: a temporary folder, printed)")


def cmd_perf_ab(args: argparse.Namespace) -> int:
    if args.fault is not None and args.grades is not None:
        raise KitError("--fault and --grades: give one (a seeded fault on one side, or graded step slowdowns)")
    fault = _fault_named(args.fault)
    try:
        grades = [0.0] if args.fault is not None else [parse_grade(g, "--grades") for g in (args.grades or "0,0.1").split(",")]
    except FaultInstallError as e:
        raise KitError(str(e)) from None
    if args.pairs < MIN_PAIRS or args.repeats < 1 or not 0 < args.alpha < 1:
        raise KitError(f"--pairs must be >= {MIN_PAIRS}, --repeats >= 1 and --alpha between 0 and 1 (got {args.pairs}, {args.repeats}, {args.alpha:g})")
    cells = {c.id: c for c in load_matrix(args.matrix).cells}
    if args.cell not in cells:
        near = [c for c in cells if c.startswith(args.cell.split("-")[0])][:5]
        raise KitError(f"--cell: no cell {args.cell!r} in the matrix (e.g. {', '.join(near) or next(iter(cells))})")
    cell = cells[args.cell]
    runs = args.repeats * len(grades)
    doing = f"fault {args.fault}" if args.fault is not None else f"grades {args.grades or '0,0.1'}"
    if preflight_only():
        print(f"preflight only: perf-ab would time {runs} paired runs of {args.pairs} pairs on {cell.id} ({doing})")
        return 0
    opts = options_from_args(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="perf-ab-"))
    print(f"perf-ab: {runs} paired runs of {args.pairs} pairs on {cell.id}; server logs {log_dir}", flush=True)
    wrong = 0
    flagged: dict[float, int] = {g: 0 for g in grades}
    rows = []
    common = {"repeats": args.repeats, "plan": AbPlan(pairs=args.pairs), "alpha": args.alpha, "seed": args.seed, "work_dir": log_dir}
    runs_of = (ab.fault_runs(cell, opts, fault=fault, **common) if args.fault is not None
               else ab.graded_runs(cell, opts, grades=grades, **common))
    try:
        for run in runs_of:
            wrong += not run.right
            flagged[run.grade] += run.verdict.flagged
            rows.append(run.row())
            if args.json:  # after every run: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"cell": cell.id, "alpha": args.alpha, "runs": rows}, indent=1))
            print(f"pair {run.repeat + 1}, {run.what}: {run.verdict.line()}" + ("" if run.right else "  <- WRONG"), flush=True)
    finally:
        preimport.stop_all()
    if args.fault is not None:
        print(f"flagged: {sum(flagged.values())}/{args.repeats} ({doing}); false-flag rate {args.alpha:g}")
    else:
        print("flagged: " + ", ".join(f"+{g:.0%} {n}/{args.repeats}" for g, n in flagged.items()) + f"; false-flag rate {args.alpha:g}")
    return 1 if wrong else 0


def _fault_named(name: str | None) -> str | None:
    """The seeded SGLang fault ``--fault`` names (None: no fault, or 'none'); one line when unknown."""
    if name is None or name == "none":
        return None
    known = faults()
    if name not in known:
        raise KitError(f"--fault: unknown seeded SGLang fault {name!r} (docs/faults.md; 'none' for a clean pair)")
    return name
