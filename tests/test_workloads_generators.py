"""Workload generators: prompt lengths, trees, session scripts (GSM8K data: tests/test_gsm8k_lm_eval.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.errors import KitError
from conformance.workloads.prompts import (
    boundary_lengths,
    decode_cross_lengths,
    multi_boundary_decode,
    prefill_hit_lengths,
    text_prompts,
    token_prompts,
)
from conformance.workloads.sessions import first_turn_abort_script, leak_session_scripts
from conformance.workloads.trees import branch_points, branching_tree



def test_prefill_lengths_straddle_chunk_and_track_boundaries():
    lengths = prefill_hit_lengths(64, 256, n=8, min_len=100, max_len=600)
    assert len(lengths) == 8 and {255, 256, 257} & set(lengths)
    assert all(min(abs(n - b) for b in range(64, 700, 64)) <= 1 for n in lengths)
    assert boundary_lengths([64], min_len=60, max_len=130) == [63, 64, 65, 127, 128, 129]


def test_decode_lengths_cross_a_track_boundary_while_decoding():
    for n in decode_cross_lengths(256, 16, n=4, min_len=100, max_len=600):
        assert (n // 256) < ((n + 15) // 256)


@given(st.sampled_from((16, 32, 64, 128, 256, 512)), st.integers(1, 300), st.integers(300, 2048))
def test_the_multi_boundary_decode_crosses_two_track_boundaries_from_a_prompt_in_range(grid, min_len, max_len):
    """The ping-pong slots alternate only when one decode crosses two boundaries."""
    found = multi_boundary_decode(grid, min_len=min_len, max_len=max_len)
    if found is None:  # no prompt in range ends just before a boundary
        assert not any(min_len <= k * grid - 3 <= max_len for k in range(1, max_len // grid + 2))
        return
    length, new = found
    assert min_len <= length <= max_len
    assert (length + new) // grid - length // grid == 2  # two boundaries, not one, not three
    assert length % grid != 0 and (length + new) % grid != 0  # neither end sits on a boundary


@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(0, 5))
def test_token_prompts_are_seeded_exact_length_and_in_vocab(lengths, seed):
    a = token_prompts(lengths, vocab_size=1024, seed=seed)
    assert a == token_prompts(lengths, vocab_size=1024, seed=seed)
    assert [len(p) for p in a] == lengths
    assert all(3 <= t < 1024 for p in a for t in p)
    assert len({p[0] for p in a}) == len(a)  # no two prompts share a prefix


def test_text_prompts_cut_to_exact_length_with_any_tokenizer():
    encode = lambda s: [ord(c) for c in s]  # noqa: E731 - a character tokenizer stands in
    out = text_prompts([50, 300], encode=encode, seed=3)
    assert [len(p) for p in out] == [50, 300] and out == text_prompts([50, 300], encode=encode, seed=3)
    with pytest.raises(KitError):
        text_prompts([10], encode=lambda s: [], max_rounds=2)


def test_tree_branch_points_and_request_budget():
    assert branch_points(64, 256) == [63, 64, 65, 255, 256, 257]
    tree = branching_tree(chunk=64, track_interval=256, vocab_size=1024)
    assert 12 <= len(tree.requests) <= 26 and tree.requests[0].flush_before
    groups = [r.group for r in tree.requests]
    assert groups == sorted(groups) and len(set(groups)) < len(groups)  # some siblings are concurrent
    b64 = [r.tokens for r in tree.requests if r.path.startswith("b64/")]
    assert all(t[:64] == b64[0][:64] and t[64] != b64[0][64] for t in b64[1:])  # branch exactly at 64
    assert any(r.extends == "decode/0" for r in tree.requests)
    assert branching_tree(chunk=64, track_interval=256, vocab_size=1024) == tree


def test_tree_with_pressure_marks_the_last_group():
    tree = branching_tree(chunk=64, track_interval=256, vocab_size=1024, pressure=2)
    assert len(tree.pressure_prompts) == 2 and tree.requests[-1].pressure_before
    with pytest.raises(KitError):
        branching_tree(chunk=64, track_interval=256, vocab_size=1024, fanout=1)


def test_session_scripts_abort_branch_and_replace_only_where_allowed():
    streaming, plain = leak_session_scripts(vocab_size=1024, track_interval=256)
    assert streaming.streaming and not plain.streaming
    assert sum(t.abort_after_s is not None for t in streaming.turns) == 1
    assert not any(t.replace or t.parent is not None for t in streaming.turns)
    assert any(t.replace for t in plain.turns) and any(t.parent == 0 for t in plain.turns)
    assert sum(len(t.tokens) for t in streaming.turns[:2]) > 256
    assert leak_session_scripts(vocab_size=1024) == leak_session_scripts(vocab_size=1024)


def test_first_turn_abort_script_aborts_the_session_first_turn_then_continues():
    first = first_turn_abort_script(vocab_size=1024, track_interval=256)
    assert first.streaming and len(first.turns) == 2
    assert first.turns[0].abort_after_s is not None and first.turns[1].abort_after_s is None
    assert first.turns[0].max_new_tokens > first.turns[1].max_new_tokens  # long enough to be aborted mid-decode
    assert first == first_turn_abort_script(vocab_size=1024, track_interval=256)


def test_multi_turn_tree_chains_each_turn_on_the_last() -> None:
    from conformance.workloads.trees import multi_turn_tree

    tree = multi_turn_tree(chunk=64, track_interval=256, vocab_size=500, turns=4)
    paths = [r.path for r in tree.requests]
    assert paths == [f"{c}/{t}" for c in ("chunks", "track") for t in range(4)]
    assert [r.extends for r in tree.requests] == [None, "chunks/0", "chunks/1", "chunks/2", None, "track/0", "track/1", "track/2"]
    assert [r.group for r in tree.requests] == list(range(8)) and tree.requests[0].flush_before
    assert len(tree.requests[0].tokens) == 67 and len(tree.requests[4].tokens) == 254  # past the chunk; its decode crosses the track
