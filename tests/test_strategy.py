"""The strategy records and the one grid: each strategy's contract as the checks, the
matrix and the reference engine read it, and SGLang's grid resolution."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance.errors import KitError
from conformance.matrix.grid import Grid
from conformance.matrix.cells import load_matrix
from conformance.matrix.strategy import BASELINE, BUFFERED, LAZY, STRATEGIES, strategy_named

NO, EXTRA, LAZY_S = (STRATEGIES[n] for n in ("no_buffer", "extra_buffer", "extra_buffer_lazy"))


def test_contracts() -> None:
    assert (NO.has_buffer, EXTRA.has_buffer, LAZY_S.has_buffer) == (False, True, True)
    assert BUFFERED == ("extra_buffer", "extra_buffer_lazy") and LAZY == ("extra_buffer_lazy",)
    assert NO.is_baseline and BASELINE == NO.name and not EXTRA.is_baseline
    # resident track slots per running request (SGLang's get_mamba_tracking_slots)
    assert [s.resident_track_slots(overlap=True) for s in (NO, EXTRA, LAZY_S)] == [0, 2, 1]
    assert EXTRA.resident_track_slots(overlap=False) == 1
    assert [s.peak_track_slots for s in (NO, EXTRA, LAZY_S)] == [0, 2, 2]
    assert [s.mamba_slots_per_request for s in (NO, EXTRA, LAZY_S)] == [1, 3, 3]
    assert LAZY_S.eager is EXTRA and EXTRA.eager is EXTRA
    assert NO.server_args() == ["--disable-overlap-schedule"] and EXTRA.server_args() == []


def test_refusals() -> None:
    assert "SGLang refuses no_buffer with page size 16" in (NO.refuses_page_size(16) or "")
    assert NO.refuses_page_size(1) is None and EXTRA.refuses_page_size(64) is None
    assert "96 % 64 != 0" in (EXTRA.refuses_track_interval(96, 64) or "")
    assert NO.refuses_track_interval(96, 64) is None  # no_buffer does not track
    assert "overlap" in (NO.refuses_settings(overlap=True, pd=True) or "")
    assert "under PD" in (LAZY_S.refuses_settings(overlap=True, pd=True) or "")
    with pytest.raises(KitError, match="unknown strategy 'bogus'"):
        strategy_named("bogus")
    assert strategy_named(EXTRA) is EXTRA


def test_matrix_records_carry_the_registry_contract() -> None:
    m = load_matrix()
    for name, s in m.strategies.items():
        assert (s.lazy, s.has_buffer, s.eager_sibling) == (STRATEGIES[name].lazy, STRATEGIES[name].has_buffer, STRATEGIES[name].eager_sibling)


def test_grid() -> None:
    g = Grid.resolve(64, 1, 256)
    assert (g.chunk, g.checkpoint_grid, g.track_grid) == (64, 64, 256)
    g = Grid.resolve(64, 128, 96)  # page above the model chunk: the chunk follows the page
    assert (g.chunk, g.checkpoint_grid, g.track_grid) == (128, 128, 384)
    assert Grid.refuses(64, 48) and Grid.refuses(64, 16) is None


#: A strategy name compared (==, !=, in, not in, startswith) in code.
STRATEGY_COMPARISON = re.compile(r"""(==|!=|\bin\b|\bnot in\b)\s*[(\[{]?\s*["'](no_buffer|extra_buffer|extra_buffer_lazy)["']"""
                                 r"""|["'](no_buffer|extra_buffer|extra_buffer_lazy)["']\s*(==|!=)|startswith\(["'](no_buffer|extra)""")


def test_the_strategy_comparison_pattern_sees_each_form() -> None:
    for line in ('if cell.strategy.name == "no_buffer":', 'if s in ("extra_buffer", "extra_buffer_lazy"):',
                 'if "extra_buffer_lazy" != name:', 'if name.startswith("extra"):'):
        assert STRATEGY_COMPARISON.search(line), line
    for line in ('STRATEGIES["no_buffer"]', 'Strategy("no_buffer", ...)', 'strategies = ("no_buffer",)'):
        assert not STRATEGY_COMPARISON.search(line), line


def test_no_strategy_name_comparison_outside_the_strategy_record() -> None:
    root = Path(__file__).resolve().parents[1]
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}"
             for p in sorted((root / "conformance").rglob("*.py")) if p != root / "conformance" / "strategy.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if STRATEGY_COMPARISON.search(line) and not line.lstrip().startswith("#")]
    assert not found, "\n".join(found)
