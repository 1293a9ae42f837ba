"""The short digest both sides of the per-node eviction evidence name a token prefix by.

The observe plugin inside SGLang records each mamba state its radix tree took (and later
freed) as (prefix length, :func:`token_digest` of the prefix's token ids); the kit's
``conformance/programs/evidence.py`` computes the same digest of the prefixes it knows.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable


def token_digest(tokens: Iterable[int]) -> str:
    """16 hex digits of BLAKE2b over the token ids as signed 64-bit integers."""
    return hashlib.blake2b(array("q", [int(t) for t in tokens]).tobytes(), digest_size=8).hexdigest()
