"""docs/faults.md is generated from the fault registries and must stay in step with them."""

from pathlib import Path

from conformance.mutants.faults_doc import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "faults.md"


def test_faults_doc_is_current() -> None:
    assert DOC.read_text() == render(), "regenerate: python -m conformance.mutants.faults_doc > docs/faults.md"


def test_every_fault_has_a_paragraph() -> None:
    from conformance.mutants.pool_faults import FAULTS as POOL
    from conformance.reference.faults import FAULTS as REFERENCE
    from conformance.reference.pd import PD_FAULTS
    from conformance.sglang_plugins.faults.catalogue import faults

    text = DOC.read_text()
    for name in [*REFERENCE, *POOL, *PD_FAULTS, *faults()]:
        assert f"### `{name}`" in text
