"""State marker: a recognisable "mamba state" for a token prefix.

Whenever the pool harness stands in for the model and computes the state of a request
at some position, it writes ``marker(tokens[:n])`` into the mamba slot (SSM temporal
state of the first mamba layer, float32).  A marker is three exact float32 integers:
two 20-bit halves of a BLAKE2 hash of the prefix and its length.  An all-zero slot is
the cleared state (length 0, the empty prefix).

The checks built on it: a cache hit must COW exactly the marker of the matched prefix
into the new request's slot; a state held by the radix tree at key ``k`` must carry
``marker(k)``; a request's tracked state must carry the marker of its recorded length.
This is the pool-level twin of the KL check: it catches wrong-state reuse that pool
counts never show.

Where a prefill snapshot is taken is decided by the kernel from the track entry's
``track_seqlen`` (what SGLang passes to the model), not from
``req.kv.mamba_last_track_seqlen`` (what SGLang records as tracked):
:func:`kernel_snapshot` says which position's state the kernel copies, so an off-by-one
between the two (SGLang's ``+1`` in ``_force_track_h``) leaves a marker that disagrees
with the recorded length.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

_MASK = (1 << 20) - 1


@dataclass(frozen=True)
class Marker:
    hash_hi: int
    hash_lo: int
    length: int

    @property
    def is_cleared(self) -> bool:
        return self.hash_hi == 0 and self.hash_lo == 0 and self.length == 0

    def __str__(self) -> str:
        return "cleared" if self.is_cleared else f"state(len={self.length}, hash={self.hash_hi:05x}{self.hash_lo:05x})"


CLEARED = Marker(0, 0, 0)
#: What a slot holds after the kernel copied a chunk state from outside this sequence's
#: own chunk states (the next sequence's, or memory past the batch).
FOREIGN = Marker(_MASK, _MASK, 0)


def marker_for(tokens: Sequence[int]) -> Marker:
    """The marker of the state after ``tokens`` (the empty prefix is the cleared state)."""
    return _marker(tuple(tokens))


@functools.lru_cache(maxsize=8192)
def _marker(tokens: tuple[int, ...]) -> Marker:
    if len(tokens) == 0:
        return CLEARED
    digest = hashlib.blake2b(",".join(map(str, tokens)).encode(), digest_size=8).digest()
    value = int.from_bytes(digest, "little")
    return Marker((value >> 20) & _MASK | 1, value & _MASK, len(tokens))


def _cell(mamba_pool):
    """The float32 view the marker lives in: temporal state of layer 0, flattened per slot."""
    temporal = mamba_pool.mamba_cache.temporal
    if temporal.dtype != torch.float32:
        raise TypeError(f"state marker needs a float32 SSM state, got {temporal.dtype}")
    return temporal[0].reshape(temporal.shape[1], -1)


def write(mamba_pool, slot: int, marker: Marker) -> None:
    row = _cell(mamba_pool)[int(slot)]
    row[:3] = torch.tensor([marker.hash_hi, marker.hash_lo, marker.length], dtype=torch.float32)


def read(mamba_pool, slot: int) -> Marker:
    a, b, n = (int(v) for v in _cell(mamba_pool)[int(slot), :3].tolist())
    return Marker(a, b, n)


def kernel_snapshot(track_seqlen: int, *, prefix_len: int, extend_end: int, state_chunk: int) -> int | None:
    """The position whose state SGLang's prefill copies into the track slot, given the entry's
    ``track_seqlen`` (SGLang 0.5.23, ``HybridLinearAttnBackend._init_track_ssm_indices``, one
    sequence per batch): an offset ``track_seqlen - prefix_len`` on the state chunk grid takes
    the last recurrent state (the extend's end); any other offset takes the chunk state
    ``h[offset // state_chunk]``, the state at ``prefix_len + (offset // state_chunk) *
    state_chunk``.  None when that index lies past the sequence's own chunk states."""
    offset = int(track_seqlen) - int(prefix_len)
    if offset % state_chunk == 0:
        return int(extend_end)
    index = offset // state_chunk
    chunk_states = (int(extend_end) - int(prefix_len) - 1) // state_chunk + 1
    if index < 0 or index >= chunk_states:
        return None
    return int(prefix_len) + index * state_chunk


def snapshot_marker(tokens: Sequence[int], track_seqlen: int, *, prefix_len: int, extend_end: int, state_chunk: int) -> Marker:
    """The marker the kernel leaves in the track slot (see :func:`kernel_snapshot`)."""
    at = kernel_snapshot(track_seqlen, prefix_len=prefix_len, extend_end=extend_end, state_chunk=state_chunk)
    return FOREIGN if at is None else marker_for(tokens[:at])
