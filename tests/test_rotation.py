"""``fuzz --rotate KEY`` (conformance/commands/rotation.py): premerge fuzzes one premerge
cell of real SGLang chosen by the PR's commit hash, so successive PRs cover all of them
(issue 26: before, always the most permissive extra_buffer_lazy + lazy_alloc_fail cell)."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from conformance.commands.rotation import rotate, rotated_cell, rotation_key
from conformance.commands.selection import selected_cells
from conformance.errors import KitError
from conformance.session.options import options_from_args


def _cells(args: argparse.Namespace) -> list:
    return selected_cells(options_from_args(args))


def _args(**kw) -> argparse.Namespace:
    base = dict(matrix=None, page_sizes=None, models=None, strategies=None, faults=None, server_options=None, tier="premerge", target="sglang-cpu")
    return argparse.Namespace(**{**base, **kw})


def test_the_key_picks_one_cell_deterministically_and_keys_cover_every_cell() -> None:
    cells = _cells(_args())
    assert len(cells) == 8
    picked = {rotated_cell(cells, f"{i:040x}").id for i in range(64)}
    assert picked == {c.id for c in cells}  # 64 commit-like keys reach all 8 premerge cells
    narrowed, line = rotate(_args(rotate="0ed07d0"))
    again, _ = rotate(_args(rotate="0ed07d0"))
    assert [c.id for c in _cells(narrowed)] == [c.id for c in _cells(again)] and len(_cells(narrowed)) == 1
    assert line.startswith("rotation: cell ") and "of 8, key '0ed07d0'" in line


def test_every_premerge_cell_can_be_rotated_to_alone() -> None:
    """A lazy_alloc_fail cell and its clean twin differ only by the fault: each is selected alone."""
    cells = _cells(_args())
    keys = {rotated_cell(cells, f"{i:040x}").id: f"{i:040x}" for i in range(64)}
    for key in keys.values():
        narrowed, _ = rotate(_args(rotate=key))  # rotate itself refuses a narrowing that selects more than the cell
        assert len(_cells(narrowed)) == 1
    assert rotation_key("date").count("-") == 2 and rotation_key("abc") == "abc"


def test_an_empty_selection_is_one_line() -> None:
    with pytest.raises(KitError, match="--rotate: the selection holds no cell"):
        rotated_cell([], "x")


def test_rotate_with_a_bad_selection_is_one_line_as_typed(tmp_path) -> None:
    env = {**os.environ, "HYBRID_CONFORMANCE_PREFLIGHT_ONLY": "1"}
    out = subprocess.run(["hybrid-conformance", "fuzz", "--target", "sglang-cpu", "--tier", "premerge", "--rotate", "nope-this-is-bad", "--models", "nope"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len([ln for ln in out.stderr.splitlines() if ln.strip()]) == 1, out.stderr
