"""What a command line selects: the suites, the matrix cells, the xdist workers."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TIER, Cell, load_matrix
from conformance.session.options import Options, csv, options_from_args
from conformance.matrix.suites import DEFAULT as DEFAULT_SUITES, suite
from conformance.suites.perf.selection import not_selected
from conformance.targets.registry import target_for


def suites_for(asked: str | None, *, target: str, tier: str | None) -> list[str]:
    """``--suite`` (``asked``), else the default suites with the target's own first (perf:
    from the standard tier up, see ``conformance.suites.perf.selection.not_selected``)."""
    tier = tier or DEFAULT_TIER
    own = target_for(target).suites if target else ()
    default = [*(s for s in own if s != "perf" or not not_selected(target, tier, asked=False)), *DEFAULT_SUITES]
    suites = list(csv(asked) or default)
    for s in suites:
        suite(s)  # an unknown name is one line naming the allowed ones
    return suites


def selected_cells(options: Options) -> list[Cell]:
    m = load_matrix(options.matrix_path)
    return m.select(
        target=options.target,
        models=options.models,
        strategies=options.strategies,
        faults=options.faults,
        page_sizes=list(options.page_sizes) if options.page_sizes else None,
        server_options=options.server_options,
        cells=options.cells,
        tier=options.tier or DEFAULT_TIER,
    )


def selection_text(args: argparse.Namespace) -> str:
    """The selecting flags as typed (for the "selects no cell" line)."""
    flags = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("models", "strategies", "faults", "page_sizes", "server_options", "matrix") if getattr(args, k, None)]
    return ", ".join([f"tier {args.tier or DEFAULT_TIER}", *flags])


def workers(asked: str | None, *, target: str, gpus_per_worker: int = 1) -> int:
    """The xdist workers a run uses (0: none; ``asked``: ``-n``). Without ``-n``: two on CPU
    targets (fewer cores: fewer); on a GPU target one per ``--gpus-per-worker`` block of
    visible GPUs."""
    if asked is None:
        return target_for(target).placement.default_workers(gpus_per_worker, os.cpu_count() or 1)
    w = str(asked)
    if w in ("auto", "logical"):
        return os.cpu_count() or 1
    if not w.isdigit():
        raise KitError(f"-n: expected a number of workers, got {w!r}")
    return int(w)


@dataclass(frozen=True)
class Selection:
    """A verb's selection, read from its command line once, in the order its checks speak:
    the suites (``--suite``), the resolved options, the cells they select, and the
    selecting flags as typed."""

    suites: tuple[str, ...]
    options: Options
    cells: tuple[Cell, ...]
    text: str

    @classmethod
    def of(cls, args: argparse.Namespace) -> Selection:
        suites = suites_for(args.suite, target=args.target, tier=args.tier)
        options = options_from_args(args)
        return cls(tuple(suites), options, tuple(selected_cells(options)), selection_text(args))

    def workers(self, asked: str | None) -> int:
        """The xdist workers a run of this selection uses (``asked``: ``-n``; see :func:`workers`)."""
        return workers(asked, target=self.options.target, gpus_per_worker=self.options.gpus_per_worker)
