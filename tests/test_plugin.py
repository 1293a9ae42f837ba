"""The pytest plugin as users drive it: markers, -m selection, one launch per cell, bad options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.matrix.cells import load_matrix

STANDIN = Path(__file__).parent / "standins" / "server.py"
REFERENCE_CELLS = load_matrix().select(target="reference", tier="standard")


def test_markers_are_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--markers")
    for m in ("lazy_alloc_fail", "premerge", "nightly", "gpu", "cpu", "pool", "kl", "gsm8k", "prefix_branching", "leaks", "disagg", "no_buffer", "extra_buffer", "extra_buffer_lazy"):
        result.stdout.fnmatch_lines([f"@pytest.mark.{m}:*"])


def test_dash_m_lazy_alloc_fail_selects_exactly_the_fault_cells(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cells="""
        def test_cell(cell):
            assert cell.fault.name == "lazy_alloc_fail"
            assert cell.strategy.name == "extra_buffer_lazy"
        """
    )
    expected = [c for c in REFERENCE_CELLS if c.fault.name == "lazy_alloc_fail"]  # the standard tier (default)
    result = pytester.runpytest_subprocess("-m", "lazy_alloc_fail", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(expected), deselected=len(REFERENCE_CELLS) - len(expected))
    for c in expected:
        result.stdout.no_fnmatch_line("*FAILED*")
    assert len(expected) == 4


def test_strategy_and_tier_markers_apply(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cells="def test_cell(cell):\n    assert cell.strategy.name == 'extra_buffer'\n")
    n = len([c for c in REFERENCE_CELLS if c.strategy.name == "extra_buffer" and c.tier == "premerge"])
    assert n == 2  # one gated-delta-net twin, one Mamba2 twin
    result = pytester.runpytest_subprocess("-m", "extra_buffer and premerge", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=n, deselected=len(REFERENCE_CELLS) - n)


def test_one_launch_per_cell_for_a_multi_check_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRID_CONFORMANCE_REFERENCE_SERVER", str(STANDIN))
    pytester.makepyfile(
        test_a="""
        import pytest
        from conformance.records import Verdict
        @pytest.mark.kl
        def test_kl(endpoint, record_verdict):
            assert endpoint.client.server_info()["standin"] is True
            record_verdict(Verdict("kl", "pass", {"tokens": 1}))
        @pytest.mark.leaks
        def test_leaks(endpoint, record_verdict):
            record_verdict(Verdict("leaks", "pass", {"mamba_used_at_idle": endpoint.client.metrics()["sglang:mamba_used_tokens"]}))
        """,
        test_b="""
        from conformance.records import Verdict
        def test_prefix(endpoint, record_verdict):
            record_verdict(Verdict("prefix_branching", "pass", {"requests": 3}))
        """,
    )
    report_dir = pytester.path / "rep"
    result = pytester.runpytest_subprocess(
        "--models", "falcon-h1", "--strategies", "extra_buffer,extra_buffer_lazy",
        f"--report-dir={report_dir}", "-p", "no:cacheprovider",
    )
    cells = load_matrix().select(target="reference", models=["falcon-h1"], strategies=["extra_buffer", "extra_buffer_lazy"], tier="standard")
    result.assert_outcomes(passed=3 * len(cells))
    report = json.loads((report_dir / "report.json").read_text())
    assert len(cells) == 3
    assert report["launches"] == len(cells) == len(report["cells"])
    assert report["distinct_cells_launched"] == len(cells)
    assert {c["id"] for c in report["cells"]} == {c.id for c in cells}
    assert all(set(c["checks"]) == {"kl", "leaks", "prefix_branching"} for c in report["cells"])


def test_bad_strategy_option_is_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(cell):\n    pass\n")
    result = pytester.runpytest_subprocess("--strategies", "bogus")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--strategies: unknown value 'bogus'; allowed: no_buffer, extra_buffer, extra_buffer_lazy*"])
    assert "Traceback" not in result.stderr.str()


def test_target_pool_deselects_server_suites(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_x="""
        import pytest
        def test_server(endpoint):
            raise AssertionError("must not run under --target pool")
        @pytest.mark.pool
        def test_pool(cell):
            assert cell is not None
        """
    )
    pool_cells = load_matrix().select(target="pool", tier="premerge")
    result = pytester.runpytest_subprocess("--target", "pool", "--tier", "premerge", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(pool_cells), deselected=len(pool_cells))
