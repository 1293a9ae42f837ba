"""Branching trees for the prefix-branching check.

A tree is a list of requests in send order. One subtree per branch point, placed one
before, at and one after every chunk and track-interval boundary (SGLang's own test has
one scenario at 257): its first child caches the shared prefix, the second branches
there (and makes SGLang cache the branch point), later children hit it; in every other
subtree the later siblings are sent together (concurrently). The first subtree also
gets grandchildren (depth 2), and a decode subtree extends a request whose decode
crossed a track boundary. Optional eviction pressure sends long filler prompts before
the last group.

:func:`multi_turn_tree` builds chains instead, a conversation's shape: each turn extends the
previous turn's prompt + output, one group per turn, so each turn's hit is what the tree
kept of the turn before (reuse across turns, which the programs only reach by chance).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from typing import Mapping

from conformance.errors import KitError
from conformance.workloads.prompts import boundary_lengths

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class TreeRequest:
    """One request: ``tokens`` is the prompt, or, with ``extends``, what is appended to
    that earlier request's prompt + output."""

    path: str
    tokens: tuple[int, ...]
    group: int
    extends: str | None = None
    flush_before: bool = False
    pressure_before: bool = False
    max_new_tokens: int = 4

    def prompt(self, sent: Mapping[str, tuple[Tokens, Tokens]]) -> Tokens:
        """The prompt this request sends: its tokens, or, with ``extends``, that request's
        prompt + output followed by them (:func:`continued`)."""
        return self.tokens if self.extends is None else continued(sent, self.extends, self.tokens, by=self.path)


def continued(sent: Mapping[str, tuple[Tokens, Tokens]], path: str, tail: Tokens, *, by: str = "a request") -> Tokens:
    """The next turn after request ``path``: its prompt + output (``sent``: path -> (prompt,
    output)) followed by ``tail``."""
    if path not in sent:
        raise KitError(f"{by} extends {path}, which was not sent before it")
    prompt, output = sent[path]
    return prompt + output + tail


@dataclass(frozen=True)
class BranchTree:
    name: str
    requests: tuple[TreeRequest, ...]
    branch_points: tuple[int, ...]
    pressure_prompts: tuple[tuple[int, ...], ...] = ()


def branch_points(chunk: int, track_interval: int, *, offsets: tuple[int, ...] = (-1, 0, 1)) -> list[int]:
    """One before, at and one after the first chunk and the first track boundary."""
    pts = boundary_lengths((chunk, track_interval), min_len=1, max_len=max(chunk, track_interval) + max(offsets), offsets=offsets)
    return [p for p in pts if any(abs(p - b) <= max(abs(o) for o in offsets) for b in (chunk, track_interval))]


def branching_tree(
    *,
    chunk: int,
    track_interval: int,
    vocab_size: int,
    fanout: int = 3,
    depth: int = 2,
    offsets: tuple[int, ...] = (-1, 0, 1),
    concurrent: bool = True,
    decode_branch: bool = True,
    pressure: int = 0,
    pressure_len: int = 0,
    max_new_tokens: int = 4,
    seed: int = 0,
    low: int = 3,
) -> BranchTree:
    """Build the default tree (25 requests for chunk 64, track 256; 14 for chunk = track)."""
    if fanout < 2 or depth < 1:
        raise KitError(f"branching_tree: need fanout >= 2 and depth >= 1, got fanout {fanout}, depth {depth}")
    if vocab_size - low < 4 * fanout:
        raise KitError(f"branching_tree: vocab_size {vocab_size} too small for fan-out {fanout}")
    rng = random.Random(f"tree:{seed}")

    def toks(n: int, first: int | None = None) -> tuple[int, ...]:
        body = [rng.randrange(low, vocab_size) for _ in range(n)]
        if first is not None and n:
            body[0] = first
        return tuple(body)

    points = branch_points(chunk, track_interval, offsets=offsets)
    heads = rng.sample(range(low, vocab_size), len(points) + 2)
    suffix_len = chunk + 3
    reqs: list[TreeRequest] = []
    group = 0
    for si, p in enumerate(points):
        prefix = toks(p, heads[si])
        together = concurrent and si % 2 == 1
        width = fanout + 1 if together else fanout  # concurrent siblings come after the branch is cached
        firsts = rng.sample(range(low, vocab_size), width)
        children = [prefix + toks(suffix_len, firsts[c]) for c in range(width)]
        for c, child in enumerate(children):
            reqs.append(TreeRequest(f"b{p}/{c}", child, group, max_new_tokens=max_new_tokens))
            if not (together and 2 <= c < width - 1):
                group += 1
        if depth >= 2 and si == 0:
            q = p + chunk
            g_firsts = rng.sample(range(low, vocab_size), 2)
            for g in range(2):
                reqs.append(TreeRequest(f"b{p}/1/{g}", children[1][:q] + toks(suffix_len, g_firsts[g]), group, max_new_tokens=max_new_tokens))
                group += 1
    if decode_branch:
        start = track_interval - 2
        n_new = max(max_new_tokens, 4)
        reqs.append(TreeRequest("decode/0", toks(start, heads[-1]), group, max_new_tokens=n_new))
        group += 1
        reqs.append(TreeRequest("decode/0/0", toks(3), group, extends="decode/0", max_new_tokens=max_new_tokens))
        group += 1
    fillers: tuple[tuple[int, ...], ...] = ()
    if pressure > 0:
        plen = pressure_len or 4 * max(chunk, track_interval)
        fillers = tuple(toks(plen, heads[-2] if i == 0 else None) for i in range(pressure))
        reqs[-1] = replace(reqs[-1], pressure_before=True)
    reqs[0] = replace(reqs[0], flush_before=True)
    name = f"tree-c{chunk}-t{track_interval}-f{fanout}-d{depth}{'-conc' if concurrent else ''}{f'-p{pressure}' if pressure else ''}-s{seed}"
    return BranchTree(name, tuple(reqs), tuple(points), fillers)


def multi_turn_tree(*, chunk: int, track_interval: int, vocab_size: int, turns: int = 4, max_new_tokens: int = 4,
                    seed: int = 0, low: int = 3) -> BranchTree:
    """Two chains of ``turns`` turns, each turn the previous turn's prompt + output + new
    tokens, sent one at a time: one chain starts past the first chunk and adds a chunk and a
    token per turn (each turn's prefill crosses a checkpoint), the other starts two tokens
    before the track boundary so its first decode crosses it, then adds three tokens per turn."""
    if turns < 2:
        raise KitError(f"multi_turn_tree: need at least 2 turns, got {turns}")
    rng = random.Random(f"turns:{seed}")

    def toks(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(low, vocab_size) for _ in range(n))

    reqs: list[TreeRequest] = []
    for name, first, step in (("chunks", chunk + 3, chunk + 1), ("track", track_interval - 2, 3)):
        reqs.append(TreeRequest(f"{name}/0", toks(first), len(reqs), max_new_tokens=max(max_new_tokens, 4)))
        for t in range(1, turns):
            reqs.append(TreeRequest(f"{name}/{t}", toks(step), len(reqs), extends=f"{name}/{t - 1}", max_new_tokens=max_new_tokens))
    reqs[0] = replace(reqs[0], flush_before=True)
    return BranchTree(f"turns-c{chunk}-t{track_interval}-n{turns}-s{seed}", tuple(reqs), ())
