"""The twins' runtime interface (conformance.reference.model): path independence, pure
states, corruption helpers, errors.  Twins come from the default cache (generated on
first use, ~1 s each)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.reference.model import Twin, TwinState, known_twins, load_twin
from conformance.reference.twin_metrics import path_error, random_prompt

torch.set_num_threads(1)

TWINS = ["tiny-qwen3-next", "tiny-nemotron-h", "tiny-granite-h", "tiny-falcon-h1"]
PATH_TOL = 2e-5  # float32 log-probs: split, chunked and token-by-token runs agree within this
# (a 32k vocabulary under the sharpened head puts tail log-probs at -64..-128, one float32 ulp = 7.6e-6)


@pytest.fixture(scope="module", params=TWINS)
def twin(request) -> Twin:
    return load_twin(request.param)


def _tensors(state: TwinState) -> list[torch.Tensor]:
    out = []
    for layer in state.cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
        for table in ("conv_states", "recurrent_states"):
            out += [t for t in getattr(layer, table, {}).values() if t is not None]
    return out


def test_known_twins_are_the_matrix_twins_with_its_chunk_sizes():
    models = load_matrix().models.values()
    assert known_twins() == sorted(m.twin for m in models)
    for model in models:
        assert load_twin(model.twin).mamba_chunk_size == model.mamba_chunk_size


def test_unknown_twin_is_one_line_listing_known_twins():
    with pytest.raises(KitError) as err:
        load_twin("tiny-nope")
    message = str(err.value)
    assert "\n" not in message and "tiny-nope" in message
    assert all(name in message for name in TWINS)


def test_metadata(twin):
    assert twin.vocab_size == 32000 and twin.tokenizer.vocab_size == twin.vocab_size
    assert (twin.eos_token_id, twin.pad_token_id) == (3, 0)
    assert twin.max_context == 131072 == twin.model.config.max_position_embeddings
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (twin.path / name).is_file()
    state = twin.empty_state()
    assert state.seq_len == 0 and state.recurrent_layers()
    assert state.nbytes_recurrent() > 0


def test_path_independence_at_chunk_edges(twin):
    """extend(a+b) == extend(extend(a), b) == token-by-token, at 1, chunk-1, chunk, chunk+1, ..."""
    c = twin.mamba_chunk_size
    splits = [1, 2, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1]
    for seed in (11, 12):
        ids = random_prompt(twin, 2 * c + 24, seed)
        assert path_error(twin, ids, splits, decode_tokens=4) <= PATH_TOL


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_path_independence_random_pieces(data):
    name = data.draw(st.sampled_from(TWINS), label="twin")
    twin = load_twin(name)
    ids = random_prompt(twin, data.draw(st.integers(2, 300), label="length"), data.draw(st.integers(0, 99)))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), min_size=1, max_size=5), label="cuts"))
    cold, _ = twin.extend(twin.empty_state(), ids)
    state, rows = twin.empty_state(), []
    for lo, hi in zip([0, *cuts], [*cuts, len(ids)]):
        piece, state = twin.extend(state, ids[lo:hi])
        rows.append(piece)
    assert state.seq_len == len(ids)
    assert float((torch.cat(rows) - cold).abs().max()) <= PATH_TOL


def test_path_check_fails_when_the_state_is_lost(twin):
    """Seeded fault: resuming from a state whose recurrent part was zeroed is caught."""
    ids = random_prompt(twin, 120, 3)
    cold, _ = twin.extend(twin.empty_state(), ids)
    _, state = twin.extend(twin.empty_state(), ids[:60])
    broken, _ = twin.extend(state.zero_recurrent(), ids[60:])
    assert float((broken - cold[60:]).abs().max()) > 1e3 * PATH_TOL


def test_extend_never_mutates_its_input_state(twin):
    _, state = twin.extend(twin.empty_state(), random_prompt(twin, 40, 5))
    before = [t.clone() for t in _tensors(state)]
    twin.extend(state, random_prompt(twin, 70, 6))
    twin.extend(state, [7])
    after = _tensors(state)
    assert state.seq_len == 40 and len(after) == len(before)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_clone_is_deep(twin):
    _, state = twin.extend(twin.empty_state(), random_prompt(twin, 30, 8))
    reference, _ = twin.extend(state, [9, 10])
    copy = state.clone()
    for t in _tensors(copy):
        t.zero_()
    again, _ = twin.extend(state, [9, 10])
    assert torch.equal(reference, again)
    assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(_tensors(state), _tensors(state.clone())))


def test_corruption_helpers_change_outputs_and_identity_does_not(twin):
    ids = random_prompt(twin, 80, 9)
    _, state = twin.extend(twin.empty_state(), ids[:50])
    clean, _ = twin.extend(state, ids[50:])
    layer = state.recurrent_layers()[0]
    same, _ = twin.extend(state.scale_recurrent(layer, 1.0), ids[50:])
    assert torch.equal(same, clean)
    _, early = twin.extend(twin.empty_state(), ids[:49])
    for corrupted in (state.scale_recurrent(layer, 1e-2), state.zero_recurrent(), state.with_recurrent_from(early)):
        out, _ = twin.extend(corrupted, ids[50:])
        assert corrupted.seq_len == state.seq_len
        assert float((out - clean).abs().max()) > 1e-3


def test_scale_recurrent_rejects_a_layer_without_state(twin):
    state = twin.empty_state()
    n_layers = len(twin.model.model.layers)
    plain = [i for i in range(n_layers) if i not in state.recurrent_layers()]
    for layer in (*plain, n_layers):
        with pytest.raises(KitError, match="holds no recurrent state"):
            state.scale_recurrent(layer, 0.5)


def test_nbytes_recurrent_is_the_conv_plus_ssm_size(twin):
    _, state = twin.extend(twin.empty_state(), [5, 6, 7])
    total = 0
    for layer in state.recurrent_layers():
        cache_layer = state.cache.layers[layer]
        for t in (cache_layer.conv_states[0], cache_layer.recurrent_states[0]):
            assert t.dtype == torch.float32
            total += t.numel() * t.element_size()
    assert state.nbytes_recurrent() == total == twin.empty_state().nbytes_recurrent()


def test_head_matches_the_models_own_forward(twin):
    """The float64 head reproduces transformers' forward (norm, multipliers, LM head)."""
    ids = random_prompt(twin, 50, 10)
    ours, _ = twin.extend(twin.empty_state(), ids)
    with torch.no_grad():
        logits = twin.model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, 50, dtype=torch.long)).logits
    theirs = torch.log_softmax(logits[0].float(), dim=-1)
    assert ours.dtype == torch.float32 and ours.shape == (50, twin.vocab_size)
    assert float((ours - theirs).abs().max()) < 1e-4


def test_bad_inputs_are_one_line_errors(twin):
    with pytest.raises(KitError, match="outside the vocabulary"):
        twin.extend(twin.empty_state(), [1, twin.vocab_size])
    with pytest.raises(KitError, match="exceed max_context"):
        twin.extend(twin.empty_state(), [5] * (twin.max_context + 1))


def test_empty_extend_returns_no_rows_and_an_equal_state(twin):
    _, state = twin.extend(twin.empty_state(), [5, 6])
    rows, same = twin.extend(state, [])
    assert rows.shape == (0, twin.vocab_size) and same.seq_len == 2
    assert torch.equal(twin.extend(same, [7])[0], twin.extend(state, [7])[0])
