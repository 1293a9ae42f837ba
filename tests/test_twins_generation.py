"""Twin generation: deterministic, cached by spec hash, config.json as both transformers
and SGLang read it, tokenizer trained in code with a chat template."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conformance.errors import KitError
from conformance.reference import twins
from conformance.reference.model import load_twin
from conformance.reference.tokenizer import TwinTokenizer, synthetic_corpus, train_tokenizer

torch.set_num_threads(1)

GSM8K_LIKE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
              "in May. How many clips did she sell?\nShe sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72")


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(twins.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_generation_is_deterministic_and_lands_in_the_env_cache(fresh_cache, tmp_path, monkeypatch):
    name = "tiny-nemotron-h"
    first = twins.ensure_twin(name)
    assert first.parent == fresh_cache and first.name == f"{name}-{twins.load_spec(name).spec_hash}"
    monkeypatch.setenv(twins.CACHE_ENV, str(tmp_path / "other"))
    second = twins.ensure_twin(name)
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes()


def test_concurrent_first_uses_share_one_complete_folder(fresh_cache, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: twins.ensure_twin("tiny-granite-h"), range(3)))
    assert len(set(paths)) == 1 and (paths[0] / "twin.json").is_file()
    assert sorted(p.name for p in fresh_cache.iterdir()) == [paths[0].name]  # no staging left
    monkeypatch.setenv(twins.CACHE_ENV, str(tmp_path / "sequential"))
    alone = twins.ensure_twin("tiny-granite-h")
    assert (alone / "model.safetensors").read_bytes() == (paths[0] / "model.safetensors").read_bytes()


def test_make_twins_generates_all_once(fresh_cache):
    paths = twins.make_twins()
    assert [p.name.rsplit("-", 1)[0] for p in paths] == twins.known_twins()
    stamp = [(p / "model.safetensors").stat().st_mtime_ns for p in paths]
    assert twins.make_twins() == paths
    assert [(p / "model.safetensors").stat().st_mtime_ns for p in paths] == stamp
    assert all((p / "model.safetensors").stat().st_size < 24_000_000 for p in paths)  # 32k x 64 embedding and head


def test_a_nemotron_twin_is_written_in_the_published_layout_whatever_transformers_saved(fresh_cache):
    """transformers 5.8.1 (the venvs of SGLang 0.5.13-0.5.17) saves Nemotron-H's embedding as
    ``backbone.embedding.weight``; SGLang's loader skipped it and served an uninitialised
    embedding.  A folder with that key is renamed to the published one at generation and a
    cached folder written that way is made again."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    folder = twins.ensure_twin("tiny-nemotron-h")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "backbone.embeddings.weight" in keys and "backbone.embedding.weight" not in keys
    assert twins.off_layout_keys(folder, "nemotron-h") == []
    published = (folder / "model.safetensors").read_bytes()
    # as the 5.8.1 venv wrote it: the singular key
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert twins.off_layout_keys(folder, "nemotron-h") == ["backbone.embedding.weight"]
    again = twins.ensure_twin("tiny-nemotron-h")
    assert again == folder and twins.off_layout_keys(again, "nemotron-h") == []
    assert load_file(str(again / "model.safetensors")).keys() == load_file(str(folder / "model.safetensors")).keys()
    assert (again / "model.safetensors").read_bytes() == published
    # the rename itself, on a folder as the 5.8.1 save leaves it
    odd = fresh_cache / "odd"
    odd.mkdir()
    save_file({"backbone.embedding.weight": torch.ones(2, 2), "lm_head.weight": torch.zeros(2, 2)}, str(odd / "model.safetensors"))
    twins._publish_layout(odd, "nemotron-h")
    assert sorted(load_file(str(odd / "model.safetensors"))) == ["backbone.embeddings.weight", "lm_head.weight"]
    assert twins.off_layout_keys(odd, "qwen3-next") == []  # no rename known for the other families


def test_spec_hash_covers_the_spec_but_not_the_record():
    spec = twins.load_spec("tiny-granite-h")
    import dataclasses

    assert dataclasses.replace(spec, seed=spec.seed + 1).spec_hash != spec.spec_hash
    assert dataclasses.replace(spec, init={**spec.init, "lm_head_scale": 1.0}).spec_hash != spec.spec_hash
    assert dataclasses.replace(spec, recorded={}).spec_hash == spec.spec_hash


def test_bad_specs_are_one_line_errors(tmp_path, monkeypatch):
    source = twins.load_spec("tiny-qwen3-next").source.read_text()
    monkeypatch.setattr(twins, "TWIN_DIR", tmp_path)
    cases = {
        "tiny-x": source,  # name does not match the folder
        "tiny-qwen3-next": source.replace("[init]", "[initt]"),
    }
    for folder, text in cases.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / twins.SPEC_FILE).write_text(text)
        with pytest.raises(KitError) as err:
            twins.load_spec(folder)
        assert "\n" not in str(err.value) and twins.SPEC_FILE in str(err.value)
        shutil.rmtree(tmp_path / folder)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h", "tiny-granite-h", "tiny-falcon-h1"])
def test_config_json_carries_the_chunk_size_and_round_trips(name):
    import transformers

    twin = load_twin(name)
    config = json.loads((twin.path / "config.json").read_text())
    assert config["architectures"] == [twin.spec.architecture]
    if twin.family == "qwen3-next":  # FLA chunk 64 is fixed in SGLang; no config key
        assert "mamba_chunk_size" not in config and config["full_attention_interval"] == 4
    else:
        assert config["mamba_chunk_size"] == twin.mamba_chunk_size
    reloaded = transformers.AutoConfig.from_pretrained(twin.path)
    assert reloaded.layer_types == twins.build_config(twin.spec).layer_types


def test_tokenizer_is_deterministic_and_byte_complete():
    assert synthetic_corpus() == synthetic_corpus()
    tok = train_tokenizer(512)
    assert tok.get_vocab_size() == 512
    twin = load_twin("tiny-qwen3-next")
    ids = twin.tokenizer.encode(GSM8K_LIKE)
    assert twin.tokenizer.decode(ids) == GSM8K_LIKE
    assert len(ids) < len(GSM8K_LIKE)  # merges learned
    big = train_tokenizer(32000)  # the twins' size: fills the vocabulary SGLang's radix-cache kit addresses
    assert big.get_vocab_size() == 32000 and twin.tokenizer.vocab_size == 32000
    assert twin.tokenizer.encode("hi") == big.encode("hi").ids and len(twin.tokenizer.encode("hi")) == 1
    assert len(twin.tokenizer.encode("hi" * 257)) == 257  # SGLang's branching kit counts its prefix in "hi"s
    assert twin.tokenizer.decode(twin.tokenizer.encode("naïve – 東京 ✓")) == "naïve – 東京 ✓"


def test_tokenizer_matches_transformers_autotokenizer():
    from transformers import AutoTokenizer

    twin = load_twin("tiny-granite-h")
    hf = AutoTokenizer.from_pretrained(twin.path)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": GSM8K_LIKE}]
    ours = twin.tokenizer.apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n")
    assert twin.tokenizer.encode(ours) == hf.encode(ours, add_special_tokens=False)
    assert hf.eos_token_id == twin.eos_token_id and hf.pad_token_id == twin.pad_token_id
    assert twin.tokenizer.encode("<|im_end|>") == [twin.eos_token_id]


def test_twin_tokenizer_reads_the_saved_files(tmp_path):
    from conformance.reference.tokenizer import save_tokenizer

    save_tokenizer(tmp_path, vocab_size=300, max_context=128)
    tok = TwinTokenizer(tmp_path)
    assert tok.vocab_size == 300 and tok.eos_token_id == 3
    with pytest.raises(ValueError, match="model vocab"):
        save_tokenizer(tmp_path, vocab_size=200, max_context=128)  # 256 byte symbols do not fit
