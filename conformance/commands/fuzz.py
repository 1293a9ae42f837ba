"""The ``fuzz`` verb: a ``run`` of the request-program suite under a budget."""

from __future__ import annotations

import argparse

from conformance.commands.run import cmd_run
from conformance.session.options import PROGRAM_OPTIONS, forward
from conformance.programs.explore import parse_budget
from conformance.commands.rotation import rotate


def cmd_fuzz(args: argparse.Namespace) -> int:
    parse_budget(args.budget)  # one line before anything starts
    if args.rotate:
        args, line = rotate(args)
        print(line, flush=True)
    extra = forward(args, PROGRAM_OPTIONS)
    run_args = argparse.Namespace(**{**vars(args), "suite": "programs", "markexpr": None, "keyword": None, "gsm8k_dir": None,
                                     "with_pool": False, "pytest_args": [*extra, *args.pytest_args]})
    return cmd_run(run_args)
