"""GSM8K suite: lm-eval's own gsm8k task against the cell's server, the kit's statistics on
lm-eval's per-item results.  GPU targets: accuracy with a Wilson interval and a paired
McNemar test against the model's no_buffer cell.  CPU twins (reference target): accuracy is
meaningless, so the check runs in agreement mode — the cached answers must equal the same
server's cold answers and, when it has run, the no_buffer cell's answers.  lm-eval's
per-sample log lands in ``<report dir>/shared/gsm8k_samples/<cell>.jsonl``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.checks.gsm8k import GSM8KAnswer, GSM8KRecording, gsm8k_verdict
from conformance.records import merge
from conformance.suites import exact_mode, settle, sizes_for
from conformance.workloads.cell_store import sibling_key
from conformance.workloads.gsm8k import pick_items
from conformance.workloads.gsm8k_lm_eval import LmEvalGSM8K

pytestmark = pytest.mark.gsm8k


def _to_json(rec: GSM8KRecording) -> dict:
    return {"engine": rec.engine, "shots": rec.shots,
            "answers": [[a.index, a.completion, a.strict, a.flexible] for a in rec.answers]}


def _from_json(raw: dict, label: str) -> GSM8KRecording:
    answers = tuple(GSM8KAnswer(i, c, strict=s, flexible=f) for i, c, s, f in raw["answers"])
    return GSM8KRecording(answers, raw["shots"], label, raw["engine"])


def test_gsm8k(endpoint, gsm8k_data, cell_store, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    exact = exact_mode(endpoint)
    driver = LmEvalGSM8K.for_server(gsm8k_data, endpoint.base_url, endpoint.info, task_dir=cell_store.root / "lm_eval_tasks",
                                    shots=size.gsm8k_shots, max_gen_toks=size.gsm8k_new_tokens, concurrency=1 if exact else 32)
    log = cell_store.root / "gsm8k_samples" / f"{sibling_key(cell, cell.strategy.name, cell.fault.name)}.jsonl"
    log.unlink(missing_ok=True)
    items = pick_items(gsm8k_data, size.gsm8k_n)
    endpoint.client.flush_cache()
    served = driver.record(items, label=cell.id, samples_log=log)  # one shared few-shot prefix: hits from item 2 on
    cell_store.save("gsm8k", cell, _to_json(served))
    baseline_raw = cell_store.load("gsm8k", sibling_key(cell, "no_buffer"))
    baseline = _from_json(baseline_raw, "no_buffer") if baseline_raw and cell.strategy.name != "no_buffer" else None
    if exact:
        cold_answers: list[GSM8KAnswer] = []
        for i in items:  # one question at a time on a flushed cache: nothing to hit
            endpoint.client.flush_cache()
            cold_answers += driver.record([i], label="cold", samples_log=log).answers
        cold = GSM8KRecording(tuple(cold_answers), served.shots, "cold", served.engine)
        verdicts = [gsm8k_verdict(served, mode="agreement", baseline=cold)]
        if baseline is not None:
            verdicts.append(gsm8k_verdict(served, mode="agreement", baseline=baseline))
        verdict = merge("gsm8k", verdicts)
    else:
        verdict = gsm8k_verdict(served, mode="accuracy", baseline=baseline, min_accuracy=cell.model.thresholds.gsm8k_min_accuracy)
    settle(record_verdict(replace(verdict, details={**verdict.details, "samples_log": str(log)})))
