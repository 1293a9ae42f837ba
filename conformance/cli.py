"""The ``hybrid-conformance`` command: run | preflight | plan | serve | make-twins | mutants | compare | history | fuzz | replay | known-bugs | report-bug | perf-ab.

This module is the parser wiring and ``main``; the options are declared once in
``conformance.session.options`` and the verbs' bodies live in ``conformance.commands``.

Bad arguments exit 2 with one line naming the bad value and the allowed ones;
a :class:`KitError` anywhere exits 2 with its one line; no traceback walls.
``run`` checks every need first (``conformance.session.preflight``, one line each on stdout):
a selection that matches no cell exits 5, a run this machine cannot do exits 3, each
with at most three lines on stderr and before any server starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

from conformance import __version__
from conformance.errors import KitError
from conformance.session.options import GSM8K_DIR, PROGRAM_OPTIONS, REPORT_DIR, SEED, SELECTION, SHRINK, add_arguments
from conformance.targets.registry import FUZZ_TARGET, MUTANT_TARGETS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"hybrid-conformance: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``only``, the verbs of :data:`LOADED_ARGUMENTS` other than
    ``only`` get their help line but not their options (their modules stay unimported)."""
    parser = _Parser(prog="hybrid-conformance", description="Conformance kit for Mamba state caching in SGLang hybrid models")
    parser.add_argument("--version", action="version", version=f"hybrid-conformance {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", help="run the suites through pytest and print a summary table")
    add_arguments(run, (*SELECTION, REPORT_DIR), report_dir="reports/latest")
    run.add_argument("-m", dest="markexpr", help="pytest marker expression, e.g. lazy_alloc_fail")
    run.add_argument("-k", dest="keyword", help="pytest -k expression")
    run.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers, 0 for none; a cell's tests stay on one worker "
                     "(default: min(2, cores); with --target sglang, the visible GPUs / --gpus-per-worker)")
    run.add_argument("--timeout", type=int, default=900, help="per-test timeout in seconds (pytest-timeout)")
    add_arguments(run, (GSM8K_DIR,))
    run.add_argument("--with-pool", action="store_true", help="also run the pool tier with a server target")
    run.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest after --")

    pre = sub.add_parser("preflight", help="check what a run needs (data, GPUs, SGLang and its features, ports) and start nothing")
    add_arguments(pre, SELECTION)
    pre.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers the run would use (default: as `run` picks them)")
    add_arguments(pre, (GSM8K_DIR,))

    plan = sub.add_parser("plan", help="print the cells and, for --target sglang, each exact command and env")
    add_arguments(plan, SELECTION)
    plan.add_argument("--format", choices=("table", "json"), default="table")
    plan.add_argument("--validate", action="store_true", help="check every sglang command with SGLang's own parser (CPU)")
    plan.add_argument("--releases", help="instead: tonight's release x cell plan of the history workflow over these releases "
                      "(comma list or a range, 0.5.11..0.5.23; target sglang-cpu), packed into shards (conformance/commands/night_plan.py)")
    plan.add_argument("--shards", help="with --releases: exactly N shards (default or 'auto': the fewest of at most the costs file's shard_minutes)")
    plan.add_argument("--night", help="with --releases: the night's date, YYYY-MM-DD (default: today, UTC); it picks the slice of the product")
    plan.add_argument("--fill", metavar="HISTORY_JSON", help="with --releases: plan only what this (merged) history.json still lacks of the "
                      "night's coverage: its units are not run again (history --fill FILE --shard K/N runs the shards)")
    plan.add_argument("--rerun-unexplained", action="store_true", help="with --fill: also run again each unit with a FAIL no known "
                      "bug explains that another kit ran (the merge keeps the newer kit's rows)")
    plan.add_argument("--budget", help="with --releases: the request programs' budget per cell (default: the run's own for the tier)")
    plan.add_argument("--costs", help="with --releases: the cell-costs file (default: fixtures/cell_costs.toml)")
    plan.add_argument("--costs-from", nargs="+", metavar="DIR", help="instead: print the [cells] tables of fixtures/cell_costs.toml "
                      "measured in these run report folders (their junit.xml)")

    # `serve` hands its arguments to the reference server's own parser (see main()); this
    # entry only lists it in --help.
    sub.add_parser("serve", help="start the embedded reference server (serve --help for its options)", add_help=False)

    twins = sub.add_parser("make-twins", help="generate the tiny twin models into the cache")
    twins.add_argument("names", nargs="*", help="twin names (default: all)")
    twins.add_argument("--force", action="store_true")

    mut = sub.add_parser("mutants", help="run the suites clean and once per seeded fault; print the mutation score")
    mut.add_argument("--target", choices=MUTANT_TARGETS, default=MUTANT_TARGETS[0], help="whose faults: the reference engine, the pool tier, or real SGLang on CPU")
    mut.add_argument("--only", help="comma list of fault names")
    mut.add_argument("--report-dir", default="reports/mutants")
    mut.add_argument("--fast", action="store_true", help="the CI subset")
    mut.add_argument("--programs", metavar="BUDGET", help="also run the request programs per fault with this budget (premerge, nightly, N, Ns)")
    mut.add_argument("--programs-only", action="store_true", help="only the request programs (no scripted suites)")
    add_arguments(mut, (SEED, SHRINK), seed=0)

    fuzz = sub.add_parser("fuzz", help="randomized request programs per cell (the programs suite) under a budget")
    add_arguments(fuzz, SELECTION, target=FUZZ_TARGET)
    add_arguments(fuzz, PROGRAM_OPTIONS, budget="premerge", seed=0)
    add_arguments(fuzz, (REPORT_DIR,), report_dir="reports/fuzz")
    fuzz.add_argument("-n", dest="workers", default=str(min(2, os.cpu_count() or 1)), help="pytest-xdist workers (default: %(default)s)")
    fuzz.add_argument("--timeout", type=int, default=3600, help="per-cell timeout in seconds (pytest-timeout)")
    fuzz.add_argument("--rotate", metavar="KEY", help="fuzz one cell of the selection, chosen by KEY (a commit hash; 'date': today's UTC date)")
    fuzz.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest after --")

    for name, (help_, adder) in LOADED_ARGUMENTS.items():
        verb = sub.add_parser(name, help=help_)
        if only is None or only == name:
            _load(adder)(verb)

    for p in (run, mut, fuzz):
        p.set_defaults(rerun_in_source=True)
        p.add_argument("--sglang-source", metavar="PATH", help="an SGLang git checkout: its python/ installed --no-deps in a venv keyed by "
                       "its commit; the command re-runs there and the report records the commit")

    cmp_ = sub.add_parser("compare", help="what got worse between two report.json files")
    cmp_.add_argument("old")
    cmp_.add_argument("new")
    cmp_.add_argument("--perf-threshold", type=float, help="flag a perf ratio worse by more than this fraction (e.g. 0.3), never inside the noise (default per ratio kind: TTFT ratios 0.5, decode tok/s ratios 6.0, memory 0.1; measured spread in docs/perf.md)")
    return parser


# ------------------------------------------------------------------ others

def cmd_serve(serve_args: list[str]) -> int:
    """``serve`` takes the reference server's own options (and its --help) as they are."""
    from conformance.reference.server import main as serve_main  # deferred: the reference server imports torch; only `serve` needs it

    return int(serve_main(serve_args) or 0)


#: Each verb's body; ``conformance.commands`` ones as ``module:function``, loaded when that
#: verb runs (``run`` brings pytest, the report and hypothesis; ``--help`` needs none of them).
COMMANDS: dict[str, str] = {
    "run": "conformance.commands.run:cmd_run", "preflight": "conformance.commands.preflight:cmd_preflight",
    "plan": "conformance.commands.plan:cmd_plan", "fuzz": "conformance.commands.fuzz:cmd_fuzz",
    "make-twins": "conformance.commands.make_twins:cmd_make_twins", "compare": "conformance.commands.compare:cmd_compare",
    "mutants": "conformance.mutants.command:cmd_mutants", "history": "conformance.commands.history_verb:cmd_history",
    "replay": "conformance.programs.replay:replay",
    "known-bugs": "conformance.commands.known_bugs:cmd_known_bugs",
    "report-bug": "conformance.commands.report_bug:cmd_report_bug", "perf-ab": "conformance.commands.perf_ab:cmd_perf_ab",
}


#: Verbs whose options are declared in their own (heavier) module: help line, ``module:function``
#: adding the options; :func:`main` loads only the verb it runs.
LOADED_ARGUMENTS: dict[str, tuple[str, str]] = {
    "replay": ("play one program file (a shrunk finding) against a target", "conformance.programs.replay:add_arguments"),
    "known-bugs": ("replay every known SGLang bug in range (fixtures/known_bugs.toml); red when one no longer reproduces",
                   "conformance.commands.known_bugs:add_arguments"),
    "perf-ab": ("paired A/B perf: two servers of a cell, one slowed by a graded seeded fault; a paired test per run",
                "conformance.commands.perf_ab:add_arguments"),
    "report-bug": ("write a folder an SGLang engineer can act on for one known bug: "
                   "README, the server command, a standalone repro script, a regression test", "conformance.commands.report_bug:add_arguments"),
    "history": ("run the pool tier (and more) on each SGLang release of a list, print release x check", "conformance.commands.history:add_arguments"),
}


def _load(entry: str) -> Callable:
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def command(name: str) -> Callable[[argparse.Namespace], int]:
    return _load(COMMANDS[name])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
    args = parser.parse_args(argv) if argv[:1] != ["serve"] else argparse.Namespace(command="serve")
    if not args.command:
        parser.print_help()
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if getattr(args, "rerun_in_source", False) and args.sglang_source:  # run / fuzz / mutants against a checkout: re-run in its venv
            return _load("conformance.commands.history:rerun_in_source")(argv, args.sglang_source)
        if args.command == "serve":
            return cmd_serve(argv[1:])
        return command(args.command)(args)
    except KitError as e:
        print(f"hybrid-conformance: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybrid-conformance: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `plan | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
