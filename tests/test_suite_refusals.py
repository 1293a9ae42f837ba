"""Each hit-dependent suite scenario against each option cell's refusal rules.

A suite that measures a cache hit either has a hit to measure on the cell or says, before it
measures, why it cannot (``no_prefill_stores``: kl's ``prefill_hit`` skip, perf's ``hit_na``,
the PD suite's skip). Which one is decided here independently of the suites' own rule: the
suite's workload (the same prompt lengths and request shapes the suite sends) is played
through the kit's prefix oracle (``PrefixOracle``: SGLang's prefill plan per chunk under the
cell's ``--chunked-prefill-size``, the decode track stores, the page floor), and the hit the
oracle says SGLang owes must be non-zero exactly where the suite's rule lets it measure.
This is how the perf false alarm on the ``chunked_prefill=sub-chunk`` cell (a timed "hit"
that SGLang by design could not serve) would have been seen without a server.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest

from conformance.checks.prefix_oracle import PrefixOracle
from conformance.matrix import axes
from conformance.matrix.cells import Cell, load_matrix
from conformance.session.suite_support import CPU_SIZES, no_prefill_stores
from conformance.workloads.perf import CPU_PLAN
from conformance.workloads.prompts import decode_cross_lengths, multi_boundary_decode, prefill_hit_lengths

SHIPPED = load_matrix()
TIERS = ("premerge", "standard", "nightly")
EXT = 8  # the extension a hit request adds past its warm-up (record_kl's ext_len, perf's hit_ext)


def _cells() -> list[Cell]:
    seen: dict[str, Cell] = {}
    for tier in TIERS:
        for cell in SHIPPED.select(target="sglang-cpu", tier=tier):
            if cell.fault.name == "none":
                seen.setdefault(cell.id, cell)
    return sorted(seen.values(), key=lambda c: c.id)


CELLS = _cells()


def budget(cell: Cell) -> int | None:
    """The ``--chunked-prefill-size`` the cell's server runs with (None: SGLang's default,
    above every CPU workload's prompt)."""
    value = dict(cell.options).get("chunked_prefill")
    return axes.chunked_prefill_size(value, cell.grid) if value else None


def endpoint(cell: Cell) -> SimpleNamespace:
    """What the suites' rules read of a served cell: the cell and the server's own info."""
    return SimpleNamespace(cell=cell, info={"chunked_prefill_size": budget(cell) or -1}, target="sglang-cpu", extra={})


def oracle(cell: Cell) -> PrefixOracle:
    return PrefixOracle(cell.strategy, cell.grid.chunk, cell.page_size, cell.track_interval)


def tokens(n: int, seed: int) -> list[int]:
    """Distinct prompts (the oracle compares token prefixes only)."""
    return [seed * 100_000 + i for i in range(n)]


def owed_kl_prefill_hit(cell: Cell) -> int:
    """kl ``prefill_hit``: warm each prompt with ``max_new_tokens=0``, serve prompt + ``EXT``."""
    o, hits = oracle(cell), 0
    for i, n in enumerate(prefill_hit_lengths(cell.grid.chunk, cell.grid.track_grid, n=CPU_SIZES.kl_prompts, max_len=CPU_SIZES.kl_max_len)):
        prompt = tokens(n, i)
        o.record_prefill(prompt, chunked_prefill_size=budget(cell))
        hits += o.expected_hit(prompt + tokens(EXT, 900 + i))
    return hits


def owed_kl_decode_hit(cell: Cell) -> int:
    """kl ``decode_hit``: turn one decodes ``kl_turn1_tokens``; turn two is prompt + output + ``EXT``."""
    o, hits, grid = oracle(cell), 0, cell.grid.track_grid
    lengths = decode_cross_lengths(grid, CPU_SIZES.kl_turn1_tokens, n=max(2, CPU_SIZES.kl_prompts // 2), max_len=CPU_SIZES.kl_max_len)
    turn1 = [CPU_SIZES.kl_turn1_tokens] * len(lengths)
    if multi := multi_boundary_decode(grid, max_len=CPU_SIZES.kl_max_len):
        lengths.append(multi[0])
        turn1.append(multi[1])
    for i, (n, out) in enumerate(zip(lengths, turn1)):
        prompt, output = tokens(n, i), tokens(out, 500 + i)
        o.record_request(prompt, output, chunked_prefill_size=budget(cell))
        hits += o.expected_hit(prompt + output + tokens(EXT, 900 + i))
    return hits


def owed_perf_hit(cell: Cell) -> int:
    """perf: a cold request of ``prompt_len`` decoding ``new_tokens``, then prompt + output + ``hit_ext``."""
    o = oracle(cell)
    prompt, output = tokens(CPU_PLAN.prompt_len, 1), tokens(CPU_PLAN.new_tokens, 2)
    o.record_request(prompt, output, chunked_prefill_size=budget(cell))
    return o.expected_hit(prompt + output + tokens(CPU_PLAN.hit_ext, 3))


@dataclass(frozen=True)
class HitScenario:
    """A suite scenario whose measure needs a cache hit: the oracle's owed hit for its workload
    on a cell, and the suite's own rule for saying it cannot measure (None: it never refuses)."""

    name: str
    owed: Callable[[Cell], int]
    refusal: Callable[[SimpleNamespace], str | None] | None

    def refused(self, cell: Cell) -> str | None:
        return self.refusal(endpoint(cell)) if self.refusal else None


SCENARIOS = (
    HitScenario("kl/prefill_hit", owed_kl_prefill_hit, no_prefill_stores),
    HitScenario("kl/decode_hit", owed_kl_decode_hit, None),
    HitScenario("perf/hit", owed_perf_hit, no_prefill_stores),
    # the PD suite's prefill server runs the cell's options; its hit request is kl's prefill_hit shape
    HitScenario("disagg/prefill_hit", owed_kl_prefill_hit, no_prefill_stores),
)


def disagreement(scenario: HitScenario, cell: Cell) -> str | None:
    """Why the scenario's rule and the oracle disagree on the cell, or None."""
    owed, why = scenario.owed(cell), scenario.refused(cell)
    if owed == 0 and why is None:
        return f"{scenario.name} on {cell.id}: the oracle owes no hit for the suite's workload, yet the suite would measure one"
    if owed > 0 and why is not None:
        return f"{scenario.name} on {cell.id}: the suite refuses ({why}) though the oracle owes {owed} hit tokens"
    return None


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_every_option_cell_either_owes_the_hit_or_the_suite_says_why(scenario: HitScenario) -> None:
    problems = [p for cell in CELLS if (p := disagreement(scenario, cell))]
    assert not problems, "\n".join(problems)


def test_the_cells_reach_both_answers() -> None:
    """Not vacuous: the tiers hold option cells where a hit is owed and one where no prefill
    stores (the sub-chunk budget), and every axis value of the standard tier is among them."""
    assert len(CELLS) > 30
    refused = [c.id for c in CELLS if no_prefill_stores(endpoint(c))]
    assert refused and all("chunked_prefill-sub-chunk" in c for c in refused)
    assert any(owed_kl_prefill_hit(c) > 0 for c in CELLS if c.options)
    values = {v for c in SHIPPED.select(target="sglang-cpu", tier="standard") for v in c.options}
    assert values <= {v for c in CELLS for v in c.options}


def test_a_suite_without_its_refusal_rule_is_named_on_the_sub_chunk_cell() -> None:
    """The seeded fault: perf's hit measured without its rule (the false alarm this test exists
    for) is named on the sub-chunk cell and nowhere a prefill stores."""
    blind = HitScenario("perf/hit", owed_perf_hit, None)
    named = [cell.id for cell in CELLS if disagreement(blind, cell)]
    assert named and all("sub-chunk" in c for c in named)
    over = HitScenario("perf/hit", owed_perf_hit, lambda ep: "always refused")
    assert sum(disagreement(over, cell) is not None for cell in CELLS) >= len(CELLS) - len(named)
