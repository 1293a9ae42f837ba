"""Direct probes of the PD faults of real SGLang (``conformance/sglang_plugins/faults/pd_*``):
each starts a PD cell on ``sglang-cpu`` (SGLang's prefill and decode servers, Mooncake over
TCP, ``sglang_router``) with the fault, and shows the raw damage: the greedy tokens the PD
cell serves differ from those of a clean non-PD server of the same cell (a wrong or
missing shipped state), or SGLang's idle invariant breaks on the prefill server before any flush
(slots in use that neither the tree nor a session holds).  The control runs the clean PD cell and sees neither.

Four real SGLang processes per probe (minutes on a loaded 2-core machine): ``fault_probe``
only (deselected by default, see tests/conftest.py); the kit's own catch of each fault is
``hybrid-conformance mutants --target sglang-cpu --only <fault>``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from sglang_cpu_probes import cell_for, fresh_idle_metrics, probe_server, require_sglang

from conformance.checks.leaks import idle_invariant

from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.workloads.prompts import token_prompts
from conformance.workloads.runners import generate_tokens, output_ids

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(2400)]
WHERE = ("qwen3-next", "no_buffer")
#: fault -> what it damages: ``tokens`` (PD answers differ from non-PD), ``prefill_idle``
#: (idle invariant broken) or ``decode_idle`` (the decode server's, after failed transfers)
PD_PROBES: dict[str, str] = {
    "pd_state_index_off": "tokens",
    "pd_last_layer_state_unsent": "tokens",
    "pd_prefill_slot_kept": "prefill_idle",
    "pd_decode_failed_transfer_slot_kept": "decode_idle",
}
#: The cell of the decode-side fault: SGLang's own transfer-failure switch on its decode server.
TRANSFER_FAIL = "disagg_transfer_fail"


@contextlib.contextmanager
def pd_cell(tmp_path: Path, fault: str | None, cell_fault: str = "none") -> Iterator[object]:
    """The cell's PD unit with ``fault`` (or none) in both PD servers."""
    from conformance.targets.disagg import serve_pd

    require_sglang()
    saved = os.environ.pop(SGLANG_FAULT_ENV, None)
    if fault:
        os.environ[SGLANG_FAULT_ENV] = fault
    try:
        options = SimpleNamespace(target="sglang-cpu", dtype="float32", twins=False)
        with serve_pd(cell_for(*WHERE, cell_fault), options, log_dir=tmp_path / "pd") as pd:
            yield pd
    finally:
        os.environ.pop(SGLANG_FAULT_ENV, None)
        if saved is not None:
            os.environ[SGLANG_FAULT_ENV] = saved


def _damage(tmp_path: Path, fault: str | None) -> dict[str, object]:
    prompts = token_prompts([40, 75, 120], vocab_size=1000, seed=27)
    with probe_server(cell_for(*WHERE), tmp_path / "base", strict=False) as base:
        cold = [output_ids(r) for r in generate_tokens(base.client, prompts, 12)]
    with pd_cell(tmp_path, fault) as pd:
        served = [output_ids(r) for r in generate_tokens(pd.router, prompts, 12)]
        prefill_idle = idle_invariant(fresh_idle_metrics(pd.prefill))
    return {"differ": sum(a != b for a, b in zip(served, cold)), "prefill_idle": prefill_idle}


def _decode_damage(tmp_path: Path, fault: str | None) -> dict[str, object]:
    """Requests through a PD unit whose decode server fails transfers at random (SGLang's
    switch), then the decode server's idle invariant before any flush (or SGLang's own leak
    report: its strict idle check stops a leaking server)."""
    from conformance.checks.transfer_failures import is_transfer_failure
    from conformance.errors import KitError
    from conformance.matrix.faults import DISAGG_FAILURE_ENV
    from conformance.workloads.transfer_failures import record_transfer_failures

    prompts = token_prompts([40 + 9 * i for i in range(12)], vocab_size=1000, seed=28)
    with pd_cell(tmp_path, fault, TRANSFER_FAIL) as pd:
        prob = float(pd.spec.decode.env[DISAGG_FAILURE_ENV])
        rec = record_transfer_failures(pd.router, prompts, new_tokens=8, failure_prob=prob, follow_up_prompt=prompts[0], follow_up_tries=1)
        try:
            broken = idle_invariant(fresh_idle_metrics(pd.decode))
        except (AssertionError, KitError) as e:  # no idle sample: the server stopped
            broken = [str(e)[:200]]
        leak_report = "memory leak detected" in pd.log_texts()["decode"]
    return {"failed": sum(map(is_transfer_failure, rec.outcomes)), "decode_idle": broken, "leak_report": leak_report}


@pytest.mark.parametrize("fault", list(PD_PROBES))
def test_pd_fault_does_damage_on_real_sglang(fault: str, tmp_path: Path) -> None:
    if PD_PROBES[fault] == "decode_idle":
        seen = _decode_damage(tmp_path, fault)
        assert seen["failed"] and (seen["decode_idle"] or seen["leak_report"]), f"{fault}: the decode server returned to idle: {seen}"
        return
    seen = _damage(tmp_path, fault)
    if PD_PROBES[fault] == "tokens":
        assert seen["differ"], f"{fault}: the PD cell served the non-PD tokens for every prompt: {seen}"
    else:
        assert seen["prefill_idle"], f"{fault}: the prefill server's idle invariant holds: {seen}"


def test_control_pd_clean(tmp_path: Path) -> None:
    seen = _damage(tmp_path, None)
    assert seen["differ"] == 0 and not seen["prefill_idle"], seen


def test_control_pd_transfer_failures_clean(tmp_path: Path) -> None:
    seen = _decode_damage(tmp_path, None)
    assert seen["failed"] and not seen["decode_idle"] and not seen["leak_report"], seen
