"""Prompts of controlled lengths that straddle chunk and track boundaries.

Token mode draws seeded random token ids (no dataset, no tokenizer); text mode builds
seeded English-like text, encodes it with the real model's tokenizer and cuts the ids to
the exact length, so real models see natural input with the same controlled lengths.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable, Sequence

from conformance.errors import KitError

_WORDS = (
    "the a one two three river stone garden window market letter number train city river "
    "morning evening quiet bright small large old new green blue red yellow walks reads "
    "builds counts carries finds opens closes writes paints farmer teacher child doctor "
    "baker sailor apples books boxes coins lamps maps songs stories because after before "
    "while then and but so every each some many few most"
).split()


def boundary_lengths(grids: Iterable[int], *, min_len: int, max_len: int, offsets: Sequence[int] = (-1, 0, 1)) -> list[int]:
    """Every ``k * grid + offset`` in ``[min_len, max_len]`` for each grid, sorted."""
    out: set[int] = set()
    for g in grids:
        if g <= 0:
            raise KitError(f"boundary_lengths: grid must be > 0, got {g}")
        for k in range(1, max_len // g + 2):
            out.update(k * g + o for o in offsets if min_len <= k * g + o <= max_len)
    return sorted(out)


def spread(values: Sequence[int], n: int) -> list[int]:
    """``n`` values picked evenly across a sorted list (all of them if there are fewer)."""
    if n <= 0:
        return []
    if len(values) <= n:
        return list(values)
    step = (len(values) - 1) / (n - 1) if n > 1 else 0
    return [values[round(i * step)] for i in range(n)]


def prefill_hit_lengths(
    chunk: int, track_interval: int, *, n: int = 8, min_len: int = 100, max_len: int = 600, offsets: Sequence[int] = (-1, 0, 1)
) -> list[int]:
    """Prompt lengths one before, at and one after chunk and track boundaries.

    Serve them extended (``record_kl``'s ``ext_len``): an identical prompt of exactly
    ``k * chunk`` tokens cannot hit its own warm-up, whose one stored state sits at its
    full length, past the key limit (``len - 1``).
    """
    cands = boundary_lengths((chunk, track_interval), min_len=max(min_len, chunk + 1), max_len=max_len, offsets=offsets)
    if not cands:
        raise KitError(f"no chunk/track boundary in [{min_len}, {max_len}] for chunk {chunk}, track {track_interval}")
    return spread(cands, n)


def decode_cross_lengths(track_interval: int, new_tokens: int, *, n: int = 4, min_len: int = 100, max_len: int = 600) -> list[int]:
    """Prompt lengths whose decode of ``new_tokens`` crosses a track boundary
    (the boundary falls at the first, middle and last decoded token)."""
    if new_tokens < 2:
        raise KitError(f"decode_cross_lengths: need at least 2 new tokens to cross a boundary, got {new_tokens}")
    offs = sorted({1, new_tokens // 2, new_tokens - 1})
    cands = sorted({b - o for b in range(track_interval, max_len + new_tokens + 1, track_interval) for o in offs if min_len <= b - o <= max_len})
    if not cands:
        raise KitError(f"no track boundary reachable from prompts in [{min_len}, {max_len}] (track {track_interval})")
    return spread(cands, n)


#: How far before a track boundary the multi-boundary decode's prompt ends, and past the
#: next-but-one boundary its decode ends.
_MULTI_MARGIN = 3


def multi_boundary_decode(track_interval: int, *, min_len: int = 100, max_len: int = 600) -> tuple[int, int] | None:
    """(prompt length, new tokens) of a decode that crosses TWO track boundaries, or None when
    no prompt in ``[min_len, max_len]`` ends just before one.

    A decode that crosses one boundary uses one of the two ping-pong tracking slots an
    ``extra_buffer`` request holds; only a decode across two alternates them, so which slot
    holds the newest state at finish is exercised only here."""
    k = max(1, -(-(min_len + _MULTI_MARGIN) // track_interval))
    length = k * track_interval - _MULTI_MARGIN
    if length > max_len or length < 1:
        return None
    return length, track_interval + 2 * _MULTI_MARGIN


def token_prompts(lengths: Sequence[int], *, vocab_size: int, seed: int = 0, low: int = 3) -> list[tuple[int, ...]]:
    """One seeded random token sequence per length, ids in ``[low, vocab_size)``.

    Sequences share no prefix (the first token differs), so they never hit each other.
    """
    if vocab_size - low < 2:
        raise KitError(f"token_prompts: vocab_size {vocab_size} leaves no room above id {low}")
    rng = random.Random(f"prompts:{seed}")
    out: list[tuple[int, ...]] = []
    firsts = rng.sample(range(low, vocab_size), min(len(lengths), vocab_size - low))
    for i, n in enumerate(lengths):
        if n < 1:
            raise KitError(f"token_prompts: lengths must be >= 1, got {n}")
        head = firsts[i % len(firsts)]
        out.append((head, *(rng.randrange(low, vocab_size) for _ in range(n - 1))))
    return out


def text_prompts(lengths: Sequence[int], *, encode: Callable[[str], Sequence[int]], seed: int = 0, max_rounds: int = 64) -> list[tuple[int, ...]]:
    """Seeded English-like text encoded by ``encode`` and cut to exactly each length."""
    rng = random.Random(f"text:{seed}")
    out = []
    for i, n in enumerate(lengths):
        text = f"Story {i}."
        ids: Sequence[int] = encode(text)
        for _ in range(max_rounds):
            if len(ids) >= n:
                break
            words = [rng.choice(_WORDS) for _ in range(max(8, n))]
            text += " " + " ".join(words).capitalize() + "."
            ids = encode(text)
        if len(ids) < n:
            raise KitError(f"text_prompts: could not reach {n} tokens with this tokenizer")
        out.append(tuple(int(t) for t in ids[:n]))
    return out


def extension(n: int, *, vocab_size: int, seed: int | str, low: int = 3) -> tuple[int, ...]:
    """A short seeded token run appended to a turn (the user's next message)."""
    rng = random.Random(f"ext:{seed}")
    return tuple(rng.randrange(low, vocab_size) for _ in range(n))
