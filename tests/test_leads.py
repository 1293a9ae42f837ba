"""The unjudged leads of ``fixtures/leads/`` stay replayable: each is a program the kit's
loader reads, whose cell is a cell of the matrix (so ``hybrid-conformance replay`` finds its
server), and each is described in the folder's README with the failure it showed.  The
folder may hold none (every lead judged); its README then still says what became of them."""

from __future__ import annotations

from pathlib import Path

from conformance.matrix.cells import load_matrix
from conformance.programs.program import load_program

LEADS = Path(__file__).resolve().parents[1] / "fixtures" / "leads"


def test_every_open_lead_loads_names_a_matrix_cell_and_is_described():
    readme = (LEADS / "README.md").read_text()
    cells = {c.id for c in load_matrix().cells}
    for path in sorted(LEADS.glob("*.json")):
        program = load_program(path)
        assert program.steps and program.note, path.name
        assert program.cell["id"] in cells, (path.name, program.cell["id"])
        assert f"| `{path.name}`" in readme, f"{path.name} is not in the README's table of open leads"


def test_every_judged_lead_is_gone_from_the_folder():
    judged = (LEADS / "README.md").read_text().split("Judged since", 1)[1]
    named = {w.strip("`").rstrip(":,") for w in judged.split() if w.startswith("`") and ".json" in w}
    assert named, "the README names the leads it judged"
    assert not named & {p.name for p in LEADS.glob("*.json")}
