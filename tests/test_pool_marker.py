"""The state marker encodes (prefix hash, length) exactly and tells prefixes apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conformance.targets.pool import state_marker
from conformance.targets.pool.state_marker import CLEARED, marker_for


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
