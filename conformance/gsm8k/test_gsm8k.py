"""GSM8K suite.  GPU targets: accuracy with a Wilson interval and a paired McNemar test
against the model's no_buffer cell.  CPU twins (reference target): accuracy is
meaningless, so the check runs in agreement mode — the cached answers must equal the
same server's cold answers and, when it has run, the no_buffer cell's answers.
"""

from __future__ import annotations

import pytest

from conformance.checks.gsm8k import GSM8KAnswer, GSM8KRecording, gsm8k_verdict
from conformance.records import merge
from conformance.suites import exact_mode, settle, sizes_for
from conformance.workloads.cell_store import sibling_key
from conformance.workloads.gsm8k import select_items
from conformance.workloads.runners import record_gsm8k

pytestmark = pytest.mark.gsm8k


def _to_json(rec: GSM8KRecording) -> list[list]:
    return [[a.index, a.gold, a.completion] for a in rec.answers]


def _from_json(raw: list[list], label: str) -> GSM8KRecording:
    return GSM8KRecording(tuple(GSM8KAnswer(i, g, c) for i, g, c in raw), 0, label)


def test_gsm8k(endpoint, gsm8k_data, cell_store, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    items = select_items(gsm8k_data, size.gsm8k_n)
    kw = dict(shots=size.gsm8k_shots, max_new_tokens=size.gsm8k_new_tokens)
    endpoint.client.flush_cache()
    served = record_gsm8k(endpoint.client, items, gsm8k_data.train, label=cell.id, **kw)  # shared few-shot prefix: hits
    cell_store.save("gsm8k", cell, _to_json(served))
    baseline_raw = cell_store.load("gsm8k", sibling_key(cell, "no_buffer"))
    baseline = _from_json(baseline_raw, "no_buffer") if baseline_raw and cell.strategy.name != "no_buffer" else None
    if exact_mode(endpoint):
        cold_answers = []
        for it in items:  # one question at a time on a flushed cache: nothing to hit
            endpoint.client.flush_cache()
            cold_answers += record_gsm8k(endpoint.client, [it], gsm8k_data.train, batch_size=1, **kw).answers
        cold = GSM8KRecording(tuple(cold_answers), size.gsm8k_shots, "cold")
        verdicts = [gsm8k_verdict(served, mode="agreement", baseline=cold)]
        if baseline is not None:
            verdicts.append(gsm8k_verdict(served, mode="agreement", baseline=baseline))
        verdict = merge("gsm8k", verdicts)
    else:
        verdict = gsm8k_verdict(served, mode="accuracy", baseline=baseline, min_accuracy=cell.model.thresholds.gsm8k_min_accuracy)
    settle(record_verdict(verdict))
