"""One fault record for every layer: each registry holds :class:`conformance.matrix.faults.SeededFault`
of its own layer, and each fault env var name is spelled once, in ``conformance/matrix/faults.py``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.matrix import faults as record
from conformance.mutants.faults_doc import all_faults

ROOT = Path(__file__).resolve().parents[1]


def test_every_registry_holds_the_one_record_of_its_layer() -> None:
    from conformance.mutants.pool_faults import FAULTS as POOL
    from conformance.reference.faults import FAULTS as REFERENCE
    from conformance.reference.pd import PD_FAULTS
    from conformance.sglang_plugins.faults.catalogue import faults

    for layer, registry in (("reference", REFERENCE), ("reference-pd", PD_FAULTS), ("pool", POOL), ("sglang", faults())):
        assert registry and all(type(f) is record.SeededFault and f.layer == layer and f.name == n for n, f in registry.items())
    for f in all_faults():
        assert f.description and f.real_bug and f.injected_at and f.observable, f.name
        assert f.switch == f"{record.LAYERS[f.layer].env}={f.name}"
    assert all(f.patch is not None for f in POOL.values()) and all(f.hooks for f in faults().values())


def test_a_fault_of_an_unknown_layer_or_named_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="layer 'gpu'"):
        record.SeededFault("x", "gpu", "d", "b")
    with pytest.raises(ValueError, match="declared twice"):
        record.registry(record.SeededFault("x", "pool", "d", "b"), record.SeededFault("x", "pool", "d", "b"))


def test_a_fault_of_an_unknown_group_is_refused_and_every_group_has_faults() -> None:
    from conformance.errors import KitError
    from conformance.sglang_plugins.faults.catalogue import in_group

    with pytest.raises(ValueError, match="group 'gpu'"):
        record.SeededFault("x", "pool", "d", "b", group="gpu")
    with pytest.raises(KitError, match="fault group 'gpu'"):
        in_group("gpu")
    assert {f.group for f in all_faults()} == set(record.GROUPS)  # every group holds a fault (not vacuous)
    assert in_group("pd") == ("pd_state_index_off", "pd_last_layer_state_unsent", "pd_prefill_slot_kept", "pd_decode_failed_transfer_slot_kept")
    assert sum(len(in_group(g)) for g in record.GROUPS) == len(all_faults()) - sum(f.layer != "sglang" for f in all_faults())


def test_each_fault_env_name_is_spelled_once() -> None:
    names = {record.FAULT_ENV, record.PD_FAULT_ENV, record.SGLANG_FAULT_ENV, record.LAZY_ALLOC_FAIL_ENV, record.DISAGG_FAILURE_ENV}
    spelled = []
    for path in [*(ROOT / "conformance").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(ROOT)}: {node.value}")
    assert sorted(spelled) == sorted(f"conformance/matrix/faults.py: {n}" for n in names)


def test_the_record_module_imports_nothing_of_the_kit_or_heavy() -> None:
    code = "import sys, conformance.matrix.faults; print(sorted(m for m in sys.modules if m.startswith(('conformance.', 'torch', 'sglang'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['conformance.matrix', 'conformance.matrix.faults']"  # its package's __init__ is a docstring
