"""The ``preflight`` verb, and the preflight every ``run`` does first: one line per need on
stdout; a refusal is at most three lines on stderr (exit 5: no cell selected, 3: the
machine cannot do the run)."""

from __future__ import annotations

import argparse
import sys

from conformance.commands.selection import Selection
from conformance.session.preflight import Preflight, Request, run_preflight


def preflight_for(selection: Selection, n_workers: int) -> Preflight:
    """The preflight of a selection run on ``n_workers`` xdist workers (0: none)."""
    options = selection.options
    req = Request(
        target=options.target, cells=selection.cells, suites=selection.suites, gsm8k_dir=options.gsm8k_dir,
        gpus_per_worker=options.gpus_per_worker, workers=max(1, n_workers), twins=options.twins, selection=selection.text,
    )
    return run_preflight(req, on_line=lambda line: print(line.render(), flush=True))


def refuse(pre: Preflight) -> int:
    """At most three stderr lines: the first failure, what can run instead, how many more."""
    first = pre.failures[0]
    print(f"hybrid-conformance: error: {first.text}", file=sys.stderr)
    if first.hint:
        print(f"hybrid-conformance: hint: {first.hint}", file=sys.stderr)
    if len(pre.failures) > 1:
        print(f"hybrid-conformance: {len(pre.failures) - 1} more preflight failure(s) listed above", file=sys.stderr)
    return 5 if first.name == "selection" else 3


def cmd_preflight(args: argparse.Namespace) -> int:
    selection = Selection.of(args)
    pre = preflight_for(selection, selection.workers(args.workers))
    return 0 if pre.ok else refuse(pre)
