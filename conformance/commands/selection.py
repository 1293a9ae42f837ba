"""What a command line selects: the suites, the matrix cells, the xdist workers."""

from __future__ import annotations

import argparse
import os

from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TIER, Cell, load_matrix
from conformance.session.options import csv, page_sizes
from conformance.matrix.suites import DEFAULT as DEFAULT_SUITES, suite
from conformance.suites.perf.selection import not_selected
from conformance.targets.registry import target_for


def suites_for(args: argparse.Namespace) -> list[str]:
    """``--suite``, else the default suites with the target's own first (perf: from the
    standard tier up, see ``conformance.suites.perf.selection.not_selected``)."""
    tier, target = getattr(args, "tier", None) or DEFAULT_TIER, getattr(args, "target", "")
    own = target_for(target).suites if target else ()
    default = [*(s for s in own if s != "perf" or not not_selected(target, tier, asked=False)), *DEFAULT_SUITES]
    suites = list(csv(getattr(args, "suite", None)) or default)
    for s in suites:
        suite(s)  # an unknown name is one line naming the allowed ones
    return suites


def selected_cells(args: argparse.Namespace) -> list[Cell]:
    m = load_matrix(args.matrix)
    sizes = page_sizes(args.page_sizes)
    return m.select(
        target=args.target,
        models=csv(args.models),
        strategies=csv(args.strategies),
        faults=csv(args.faults),
        page_sizes=list(sizes) if sizes else None,
        server_options=csv(getattr(args, "server_options", None)),
        tier=args.tier or DEFAULT_TIER,
    )


def selection_text(args: argparse.Namespace) -> str:
    flags = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("models", "strategies", "faults", "page_sizes", "server_options", "matrix") if getattr(args, k, None)]
    return ", ".join([f"tier {args.tier or DEFAULT_TIER}", *flags])


def workers(args: argparse.Namespace) -> int:
    """The xdist workers a run uses (0: none). Without ``-n``: two on CPU targets (fewer
    cores: fewer); on a GPU target one per ``--gpus-per-worker`` block of visible GPUs."""
    w = getattr(args, "workers", None)
    if w is None:
        return target_for(args.target).placement.default_workers(getattr(args, "gpus_per_worker", 1), os.cpu_count() or 1)
    w = str(w)
    if w in ("auto", "logical"):
        return os.cpu_count() or 1
    if not w.isdigit():
        raise KitError(f"-n: expected a number of workers, got {w!r}")
    return int(w)
