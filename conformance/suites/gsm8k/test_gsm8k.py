"""GSM8K suite: lm-eval's own gsm8k task against the cell's server, the kit's statistics on
lm-eval's per-item results.  GPU targets: accuracy with a Wilson interval and a paired
McNemar test against the cell's paired baseline (``matrix.baseline_for``: the model's
no_buffer cell with the same track interval, page size 1 when the cell's page size is one
no_buffer refuses).  CPU twins (reference and sglang-cpu, float32 or bfloat16): accuracy is
meaningless, so the check runs in agreement mode -- one question at a time, the cached
answers must equal the same server's cold answers and the baseline's.

Pairing runs whenever both cells answered in the run, whichever ran first: a cell stores
its answers before it looks for its baseline's, and a baseline cell pairs every cell that
stored unpaired answers before it (its verdict names them).  A missing baseline is named in
the verdict.  lm-eval's per-sample log lands in ``<report dir>/shared/gsm8k_samples/<cell>.jsonl``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conformance.checks.gsm8k import gsm8k_verdict
from conformance.recordings import GSM8KAnswer, GSM8KRecording
from conformance.matrix.cells import baseline_id
from conformance.records import Verdict, merge
from conformance.matrix.strategy import BASELINE
from conformance.session.suite_support import on_cpu, settle, sizes_for
from conformance.workloads.cell_store import sibling_key
from conformance.workloads.gsm8k import pick_items
from conformance.workloads.gsm8k_lm_eval import LmEvalGSM8K

pytestmark = pytest.mark.gsm8k


def _to_json(rec: GSM8KRecording, *, baseline: str | None) -> dict:
    return {"engine": rec.engine, "shots": rec.shots, "label": rec.label, "baseline": baseline,
            "answers": [[a.index, a.completion, a.strict, a.flexible] for a in rec.answers]}


def _from_json(raw: dict, label: str) -> GSM8KRecording:
    answers = tuple(GSM8KAnswer(i, c, strict=s, flexible=f) for i, c, s, f in raw["answers"])
    return GSM8KRecording(answers, raw["shots"], raw.get("label") or label, raw["engine"])


def _judge(rec: GSM8KRecording, *, exact: bool, baseline: GSM8KRecording | None, base_id: str | None, min_accuracy: float) -> Verdict:
    if exact:
        return gsm8k_verdict(rec, mode="agreement", baseline=baseline, baseline_id=base_id)
    return gsm8k_verdict(rec, mode="accuracy", baseline=baseline, baseline_id=base_id, min_accuracy=min_accuracy)


def _pair_earlier_cells(cell_store, cell, served: GSM8KRecording, *, exact: bool, min_accuracy: float) -> list[Verdict]:
    """As a baseline cell: the paired test for every cell that stored its answers before
    this baseline had any (their own verdict said the baseline was missing)."""
    out = []
    folder = cell_store.root / "gsm8k"
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        raw = cell_store.load("gsm8k", path.stem)
        if not raw or raw.get("baseline") != cell.id or raw.get("paired"):
            continue
        v = _judge(_from_json(raw, path.stem), exact=exact, baseline=served, base_id=cell.id, min_accuracy=min_accuracy)
        out.append(replace(v, reason=f"{raw.get('label') or path.stem} paired with this baseline: {v.reason or v.status}"))
    return out


def test_gsm8k(endpoint, gsm8k_data, cell_store, matrix, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    exact = on_cpu(endpoint)  # the tiny twins: accuracy means nothing, answers must agree (float32 and bfloat16)
    min_acc = cell.model.thresholds.gsm8k_min_accuracy
    driver = LmEvalGSM8K.for_server(gsm8k_data, endpoint.base_url, endpoint.info, task_dir=cell_store.root / "lm_eval_tasks",
                                    shots=size.gsm8k_shots, max_gen_toks=size.gsm8k_new_tokens, concurrency=1 if exact else 32)
    log = cell_store.root / "gsm8k_samples" / f"{sibling_key(cell, cell.strategy.name, cell.fault.name)}.jsonl"
    log.unlink(missing_ok=True)
    items = pick_items(gsm8k_data, size.gsm8k_n)
    endpoint.client.flush_cache()
    served = driver.record(items, label=cell.id, samples_log=log)  # one shared few-shot prefix: hits from item 2 on
    base_id = baseline_id(cell, matrix.strategies.get(BASELINE))
    base_cell = matrix.baseline_for(cell)
    base_key = sibling_key(base_cell, base_cell.strategy.name) if base_cell is not None else None
    cell_store.save("gsm8k", cell, _to_json(served, baseline=base_id))  # before looking for the baseline: see the docstring
    baseline_raw = cell_store.load("gsm8k", base_key) if base_key else None
    baseline = _from_json(baseline_raw, base_id or BASELINE) if baseline_raw else None
    if baseline is not None:
        cell_store.save("gsm8k", cell, {**_to_json(served, baseline=base_id), "paired": True})
    verdicts = []
    paired = None
    if exact:
        cold_answers: list[GSM8KAnswer] = []
        for i in items:  # one question at a time on a flushed cache: nothing to hit
            endpoint.client.flush_cache()
            cold_answers += driver.record([i], label="cold", samples_log=log).answers
        cold = GSM8KRecording(tuple(cold_answers), served.shots, "cold", served.engine)
        verdicts.append(gsm8k_verdict(served, mode="agreement", baseline=cold))
    if base_id is not None or not exact:  # a baseline cell on CPU has only its cold agreement
        paired = _judge(served, exact=exact, baseline=baseline, base_id=base_id, min_accuracy=min_acc)
        verdicts.append(paired)
    if base_id is None:
        verdicts += _pair_earlier_cells(cell_store, cell, served, exact=exact, min_accuracy=min_acc)
    verdict = merge("gsm8k", verdicts)
    pairing = {"paired_baseline": base_id, "paired_n": paired.metrics.get("paired_n", 0) if paired is not None else 0}
    if exact:
        pairing.update(cold_agreement=verdicts[0].metrics.get("agreement"), agreement=paired.metrics.get("agreement") if paired else None)
    verdict = replace(verdict, metrics={**verdict.metrics, **pairing})
    missing = next((v.reason for v in verdicts if v.reason.startswith("paired test not run")), "")
    if missing and missing not in verdict.reason:  # merge keeps a pass's reason, not a skip's
        verdict = replace(verdict, reason="; ".join(r for r in (verdict.reason, missing) if r))
    settle(record_verdict(replace(verdict, details={**verdict.details, "samples_log": str(log)})))
