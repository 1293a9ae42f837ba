"""Perf suite (server targets): one timed workload per cell, filed as the ``perf`` check.

Record (``conformance.workloads.perf``) while holding the run's quiet lock exclusively,
judge (``conformance.checks.perf``), and name the cells the report divides by (the
model's ``no_buffer`` cell, and for ``extra_buffer_lazy`` its ``extra_buffer`` sibling).
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.checks.perf import perf_verdict
from conformance.matrix.cells import Matrix, baseline_id
from conformance.suites.perf import quiet
from conformance.matrix.strategy import BASELINE
from conformance.session.suite_support import no_prefill_stores, on_cpu, settle, vocab_size
from conformance.workloads.perf import CPU_PLAN, GPU_PLAN, engine_label, record_perf

pytestmark = pytest.mark.perf


def pairing(cell, matrix: Matrix) -> dict[str, str | None]:
    """The cells a perf ratio of ``cell`` divides by, by id (None: the cell is its own)."""
    out = {"baseline_cell": baseline_id(cell, matrix.strategies.get(BASELINE)), "extra_buffer_cell": None}
    if cell.strategy.lazy and cell.strategy.eager.name in matrix.strategies:
        sibling = dataclasses.replace(cell, strategy=matrix.strategies[cell.strategy.eager.name], fault=matrix.faults["none"])
        out["extra_buffer_cell"] = sibling.id
    return out


def test_perf(endpoint, matrix: Matrix, record_verdict, pytestconfig, tmp_path_factory):
    plan = CPU_PLAN if on_cpu(endpoint) else GPU_PLAN
    folder = quiet.shared_dir(pytestconfig, tmp_path_factory)
    with quiet.exclusive(folder) as alone:
        recording = record_perf(
            endpoint.client, plan, vocab_size=vocab_size(endpoint), engine=engine_label(endpoint.target, endpoint.info), quiet=alone,
            hit_na=no_prefill_stores(endpoint),
        )
    verdict = perf_verdict(recording)
    verdict = dataclasses.replace(verdict, details={**verdict.details, **pairing(endpoint.cell, matrix)})
    settle(record_verdict(verdict))
