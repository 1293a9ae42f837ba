"""Every twin folder passes SGLang 0.5.23's own CLI/config resolution on CPU, for every
strategy, and SGLang resolves the matrix's chunk size and the twin's layer/state layout.
(Importing SGLang takes ~5-12 s.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.reference import twins
from conformance.reference.model import load_twin
from conformance.reference.twin_sglang import mismatches, sglang_view

torch.set_num_threads(1)

STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
MODELS = {m.twin: m for m in load_matrix().models.values()}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sglang_resolves_the_twin_like_transformers_runs_it(name, strategy):
    twin = load_twin(name)
    view = sglang_view(twin.path, strategy)
    assert view.chunk_size == MODELS[name].mamba_chunk_size
    assert mismatches(twin, view) == []


def _copy_without_weights(src, dest):
    dest.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / file, dest / file)
    return dest


def test_transformers_own_nemotron_config_is_refused(tmp_path):
    """Seeded fault: config.json exactly as transformers writes it (no SGLang names)."""
    spec = twins.load_spec("tiny-nemotron-h")
    folder = _copy_without_weights(load_twin(spec.name).path, tmp_path / "plain")
    twins.build_config(spec).save_pretrained(folder)
    with pytest.raises(KitError, match="SGLang refuses plain"):
        sglang_view(folder, "extra_buffer")


def test_a_wrong_attention_interval_is_a_mismatch(tmp_path):
    """Seeded fault: SGLang places Qwen3-Next's attention by full_attention_interval."""
    twin = load_twin("tiny-qwen3-next")
    folder = _copy_without_weights(twin.path, tmp_path / "interval")
    config = json.loads((folder / "config.json").read_text())
    config["full_attention_interval"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    problems = mismatches(twin, sglang_view(folder, "extra_buffer"))
    assert any(p.startswith("attention layers") for p in problems)
    assert any(p.startswith("recurrent layers") for p in problems)
