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
