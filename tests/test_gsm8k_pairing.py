"""GSM8K pairing across cells of one run: a cell stores its answers naming its baseline; a
baseline cell that runs later pairs every cell that stored unpaired answers before it."""

from __future__ import annotations

from conformance.recordings import GSM8KAnswer, GSM8KRecording
from conformance.suites.gsm8k.test_gsm8k import _pair_earlier_cells, _to_json
from conformance.matrix.cells import baseline_id, load_matrix
from conformance.workloads.cell_store import CellStore

ENGINE = "lm-eval 0.4.13"


def rec(completions: list[str], label: str) -> GSM8KRecording:
    return GSM8KRecording(tuple(GSM8KAnswer(i, c, strict=False, flexible=False) for i, c in enumerate(completions)), 2, label, ENGINE)


def cells():
    m = load_matrix()
    pick = {c.id: c for c in m.select(models=["qwen3-next"], tier="nightly")}
    return m, pick["qwen3-next-80b-no_buffer-p1-t256"], pick["qwen3-next-80b-extra_buffer-p64-t256"], pick["qwen3-next-80b-extra_buffer-p1-t128"]


def test_a_baseline_that_runs_later_pairs_the_cells_that_ran_before_it(tmp_path):
    m, base, p64, t128 = cells()
    store = CellStore(tmp_path)
    nb = m.strategies["no_buffer"]
    store.save("gsm8k", p64, _to_json(rec(["a", "b", "c"], p64.id), baseline=baseline_id(p64, nb)))
    store.save("gsm8k", t128, _to_json(rec(["a", "b", "c"], t128.id), baseline=baseline_id(t128, nb)))  # another baseline
    verdicts = _pair_earlier_cells(store, base, rec(["a", "x", "c"], base.id), exact=True, min_accuracy=0.0)
    assert len(verdicts) == 1  # only the cell whose baseline this is
    (v,) = verdicts
    assert v.status == "fail" and v.reason.startswith(p64.id) and "1/3 completions differ" in v.reason
    assert v.metrics["paired_n"] == 3 and v.metrics["paired_baseline"] == base.id


def test_cells_already_paired_are_not_paired_again(tmp_path):
    m, base, p64, _ = cells()
    store = CellStore(tmp_path)
    store.save("gsm8k", p64, {**_to_json(rec(["a"], p64.id), baseline=base.id), "paired": True})
    assert _pair_earlier_cells(store, base, rec(["a"], base.id), exact=True, min_accuracy=0.0) == []
