"""The state marker encodes (prefix hash, length) exactly and tells prefixes apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conformance.sglang_api import state_marker
from conformance.sglang_api.state_marker import CLEARED, marker_for


def _pool(slots: int = 4, dtype=torch.float32):
    return SimpleNamespace(mamba_cache=SimpleNamespace(temporal=torch.zeros(2, slots + 1, 2, 3, 4, dtype=dtype)))


def test_markers_are_deterministic_and_distinct():
    assert marker_for([1, 2, 3]) == marker_for((1, 2, 3))
    assert marker_for([1, 2, 3]) != marker_for([1, 2, 4])
    assert marker_for([1, 2]) != marker_for([1, 2, 3])
    assert marker_for([1, 2, 3]).length == 3
    assert marker_for([]) == CLEARED and CLEARED.is_cleared
    assert not marker_for([0]).is_cleared  # the hash half is forced non-zero


def test_write_read_roundtrip_and_cleared_slot():
    pool = _pool()
    m = marker_for(list(range(700)))
    state_marker.write(pool, 3, m)
    assert state_marker.read(pool, 3) == m
    assert state_marker.read(pool, 2) == CLEARED
    pool.mamba_cache.temporal[:, 3].zero_()
    assert state_marker.read(pool, 3) == CLEARED


def test_marker_needs_float32_state():
    with pytest.raises(TypeError, match="float32"):
        state_marker.write(_pool(dtype=torch.bfloat16), 1, marker_for([1]))


def test_kernel_snapshot_follows_the_entry_track_seqlen():
    from conformance.sglang_api.state_marker import FOREIGN, kernel_snapshot, snapshot_marker

    # aligned offset: the last recurrent state (the extend's end), whatever the aligned key
    assert kernel_snapshot(192, prefix_len=0, extend_end=192, state_chunk=64) == 192
    # SGLang's +1 (_force_track_h): an aligned position inside the extend, read from h
    assert kernel_snapshot(129, prefix_len=0, extend_end=200, state_chunk=64) == 128
    assert kernel_snapshot(200, prefix_len=64, extend_end=200, state_chunk=64) == 192  # unaligned end: h[2]
    # the +1 dropped: the kernel reads the extend's end, not the aligned position
    assert kernel_snapshot(128, prefix_len=0, extend_end=200, state_chunk=64) == 200
    # one past an aligned end: a chunk state past the sequence's own
    assert kernel_snapshot(193, prefix_len=0, extend_end=192, state_chunk=64) is None
    toks = list(range(300))
    assert snapshot_marker(toks, 193, prefix_len=0, extend_end=192, state_chunk=64) == FOREIGN
    assert snapshot_marker(toks, 129, prefix_len=0, extend_end=200, state_chunk=64) == marker_for(toks[:128])
