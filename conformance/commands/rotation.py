"""``fuzz --rotate KEY``: one cell of the selection, chosen by a key that changes from run
to run (premerge passes the PR's commit hash, or ``date`` for today's UTC date), so the
premerge job fuzzes every premerge cell of real SGLang over time instead of always the
same (most permissive) one.  Deterministic: the same key picks the same cell."""

from __future__ import annotations

import argparse
import datetime
import hashlib

from conformance.commands.selection import selected_cells
from conformance.errors import KitError
from conformance.matrix.cells import Cell
from conformance.session.options import options_from_args


def rotation_key(key: str) -> str:
    """``date``: today's UTC date (one cell a day); anything else is used as given."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat() if key == "date" else key


def rotated_cell(cells: list[Cell], key: str) -> Cell:
    if not cells:
        raise KitError("--rotate: the selection holds no cell")
    return cells[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(cells)]


def rotate(args: argparse.Namespace) -> tuple[argparse.Namespace, str]:
    """``args`` narrowed to the rotated cell (the command line ``run`` hands on to pytest), and
    the line that says which and why."""
    key = rotation_key(args.rotate)
    cells = selected_cells(options_from_args(args))
    cell = rotated_cell(cells, key)
    narrowed = argparse.Namespace(**{**vars(args), "models": cell.model.id, "strategies": cell.strategy.name, "faults": cell.fault.name,
                                     "page_sizes": str(cell.page_size)})
    if [c.id for c in selected_cells(options_from_args(narrowed))] != [cell.id]:
        raise KitError(f"--rotate: cell {cell.id} cannot be selected alone by model, strategy, fault and page size")
    index = [c.id for c in cells].index(cell.id)
    return narrowed, f"rotation: cell {cell.id} ({index + 1} of {len(cells)}, key {key!r})"
