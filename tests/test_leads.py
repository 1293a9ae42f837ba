"""The unjudged leads of ``fixtures/leads/`` stay replayable: each is a program the kit's
loader reads, whose cell is a cell of the matrix (so ``hybrid-conformance replay`` finds its
server), and each is described in the folder's README with the failure it showed."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.matrix import load_matrix
from conformance.programs.program import load_program

LEADS = Path(__file__).resolve().parents[1] / "fixtures" / "leads"
FILES = sorted(LEADS.glob("*.json"))


def test_there_are_leads_and_a_readme():
    assert FILES and (LEADS / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_lead_loads_names_a_matrix_cell_and_is_described(path: Path):
    program = load_program(path)
    assert program.steps and program.note
    cells = {c.id for c in load_matrix().cells}
    assert program.cell["id"] in cells, program.cell["id"]
    assert f"`{path.name}`" in (LEADS / "README.md").read_text()
