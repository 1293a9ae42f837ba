"""A pairwise covering array under constraints: every feasible pair of parameter values in
at least one row (greedy, AETG-style), generated instead of hand-listed.

``params`` is a sequence of (name, values); ``valid(partial)`` judges a partial assignment:
True (valid so far: every extension that only adds values it accepts on their own stays
valid), False (refused) or None (cannot tell yet).  A pair is *feasible* when some full
assignment containing it is valid; :func:`feasible_pairs` lists them, :func:`covering_array`
covers them, deterministically (the same input gives the same rows).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Mapping, Sequence

Params = Sequence[tuple[str, Sequence[Hashable]]]
Valid = Callable[[Mapping[str, Any]], "bool | None"]
Pair = tuple[tuple[str, Hashable], tuple[str, Hashable]]


def _pairs_of(row: Mapping[str, Any], names: Sequence[str]) -> set[Pair]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2) if a in row and b in row}


def complete(params: Params, valid: Valid, fixed: Mapping[str, Any]) -> dict[str, Any] | None:
    """A valid full assignment extending ``fixed`` (values tried in the given order), or None."""
    order = [(n, vs) for n, vs in params if n not in fixed]

    def dfs(row: dict[str, Any], i: int) -> dict[str, Any] | None:
        verdict = valid(row)
        if verdict is False:
            return None
        if i == len(order):
            return row if verdict else None
        name, values = order[i]
        for v in values:
            found = dfs({**row, name: v}, i + 1)
            if found is not None:
                return found
        return None

    return dfs(dict(fixed), 0)


def feasible_pairs(params: Params, valid: Valid) -> set[Pair]:
    """Every pair of values (of two different parameters) some valid full assignment holds."""
    names = [n for n, _ in params]
    out: set[Pair] = set()
    domain = dict(params)
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(domain[a], domain[b]):
            if complete(params, valid, {a: va, b: vb}) is not None:
                out.add(((a, va), (b, vb)))
    return out


def covering_array(params: Params, valid: Valid) -> list[dict[str, Any]]:
    """Rows (full valid assignments) that together hold every feasible pair."""
    names = [n for n, _ in params]
    rank = {n: i for i, n in enumerate(names)}
    uncovered = feasible_pairs(params, valid)
    key = lambda p: (rank[p[0][0]], rank[p[1][0]], str(p[0][1]), str(p[1][1]))  # noqa: E731
    rows: list[dict[str, Any]] = []
    while uncovered:
        (a, va), (b, vb) = min(uncovered, key=key)
        row: dict[str, Any] = {a: va, b: vb}
        for name, values in params:
            if name in row:
                continue
            best, best_gain = None, -1
            for v in values:
                trial = {**row, name: v}
                gain = len(_pairs_of(trial, names) & uncovered)
                if gain > best_gain and complete(params, valid, trial) is not None:
                    best, best_gain = v, gain
            row[name] = best
        rows.append(row)
        uncovered -= _pairs_of(row, names)
    return rows
