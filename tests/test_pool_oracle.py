"""The prefix oracle's rules, as pure functions (no sglang); its agreement with SGLang's
real UnifiedRadixCache is checked by the pool suite's state machine and scenarios."""

from __future__ import annotations

import pytest

from conformance.checks.prefix_oracle import (
    OracleError,
    PrefixOracle,
    chunk_ends,
    decode_track_positions,
    prefill_checkpoint_len,
)


def test_prefill_checkpoint_rules():
    kw = dict(checkpoint_grid=64, chunk=64)
    assert prefill_checkpoint_len("no_buffer", 0, 300, **kw) == 300
    assert prefill_checkpoint_len("extra_buffer", 0, 300, **kw) == 256
    assert prefill_checkpoint_len("extra_buffer", 0, 63, **kw) is None
    assert prefill_checkpoint_len("extra_buffer", 100, 300, **kw) == 292  # prefix-relative (chunked)
    assert prefill_checkpoint_len("extra_buffer_lazy", 0, 300, branching_seqlen=128, **kw) == 128
    assert prefill_checkpoint_len("extra_buffer", 100, 300, branching_seqlen=192, **kw) == 292  # 92 % 64 != 0
    assert prefill_checkpoint_len("extra_buffer", 0, 300, branching_seqlen=320, **kw) == 256  # beyond the extend
    assert prefill_checkpoint_len("extra_buffer", 50, 50, **kw) is None


def test_decode_track_positions():
    assert decode_track_positions(300, 600, 256) == [512]
    assert decode_track_positions(256, 512, 256) == [512]
    assert decode_track_positions(255, 256, 256) == [256]
    assert decode_track_positions(10, 100, 128) == []


def test_chunk_ends_are_page_aligned():
    assert chunk_ends(0, 300, None) == [300]
    assert chunk_ends(0, 300, 128) == [128, 256, 300]
    assert chunk_ends(64, 300, 100, page_size=64) == [128, 192, 256, 300]
    assert chunk_ends(300, 300, 64) == []


def test_extra_buffer_branch_point_is_cached_after_the_second_request():
    o = PrefixOracle("extra_buffer", chunk=64, page_size=1, track_interval=256)
    base = list(range(1, 201))
    first = base + [7] * 100
    assert o.record_request(first, [0, 0]) == 0  # stores 256
    second = base + [8] * 100
    adm = o.admit(second)
    assert (adm.hit, adm.full_kv_hit, adm.branching_seqlen) == (0, 200, 192)
    assert o.record_prefill(second) == [192]  # tracks the branch point instead of 256
    assert o.expected_hit(base + [9] * 10) == 192


def test_no_buffer_stores_prompt_and_finished_sequence():
    o = PrefixOracle("no_buffer", chunk=64, page_size=1, track_interval=256)
    prompt = [3] * 100
    o.record_prefill(prompt)
    assert o.record_finished(prompt, [5, 6, 7]) == 102  # the last output token is never fed
    assert o.expected_hit(prompt + [5, 6, 7, 1]) == 102
    assert o.expected_hit(prompt + [5, 9]) == 100
    assert o.expected_hit(prompt) == 0  # key limit: len - 1


def test_decode_track_and_lazy_alloc_fail_under_overlap():
    o = PrefixOracle("extra_buffer_lazy", chunk=64, page_size=1, track_interval=128, lazy_alloc_fail=True)
    assert o.finish_insert_len(100, 300) == 256
    assert o.finish_insert_len(100, 255, lookahead=1) is None  # in-flight in-place boundary at 256
    assert o.finish_insert_len(100, 255, lookahead=0) == 128


def test_page_alignment_and_flush():
    o = PrefixOracle("extra_buffer", chunk=64, page_size=64, track_interval=256)
    seq = list(range(400))
    o.record_prefill(seq)
    assert [len(k) for k in o.stored_keys()] == [384]
    assert o.expected_hit(seq[:383] + [1]) == 0
    assert o.candidate_hits(seq) == {0, 384}
    o.flush()
    assert o.expected_hit(seq) == 0 and o.stored_keys() == []


@pytest.mark.parametrize(
    "args, msg",
    [
        (("no_buffer", 64, 64, 256), "page size 1"),
        (("bogus", 64, 1, 256), "unknown strategy"),
        (("extra_buffer", 64, 1, 256, True), "lazy_alloc_fail"),
    ],
)
def test_refused_configurations(args, msg):
    with pytest.raises(OracleError, match=msg):
        PrefixOracle(*args)
