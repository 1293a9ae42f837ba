"""The ``preflight`` verb, and the preflight every ``run`` does first: one line per need on
stdout; a refusal is at most three lines on stderr (exit 5: no cell selected, 3: the
machine cannot do the run)."""

from __future__ import annotations

import argparse
import sys

from conformance.commands.selection import selected_cells, selection_text, suites_for, workers
from conformance.matrix.cells import Cell
from conformance.session.preflight import Preflight, Request, run_preflight


def preflight_for(args: argparse.Namespace, cells: list[Cell], suites: list[str]) -> Preflight:
    req = Request(
        target=args.target, cells=tuple(cells), suites=tuple(suites), gsm8k_dir=getattr(args, "gsm8k_dir", None),
        gpus_per_worker=args.gpus_per_worker, workers=max(1, workers(args)), twins=args.twins, selection=selection_text(args),
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
    suites = suites_for(args)
    pre = preflight_for(args, selected_cells(args), suites)
    return 0 if pre.ok else refuse(pre)
