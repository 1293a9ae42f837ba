"""The matrix file: the shipped one covers what the mission needs; bad ones fail in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.matrix.cells import DEFAULT_MATRIX, MatrixError, load_matrix

SHIPPED = load_matrix()


def test_shipped_matrix_covers_every_family_and_strategy() -> None:
    pairs = {(c.model.family, c.strategy.name) for c in SHIPPED.cells}
    for fam in ("qwen3-next", "nemotron-h", "granite-h", "falcon-h1"):
        for s in ("no_buffer", "extra_buffer", "extra_buffer_lazy"):
            assert (fam, s) in pairs


def test_shipped_matrix_has_required_variants() -> None:
    cells = SHIPPED.cells
    assert any(c.page_size == 1 for c in cells) and any(c.page_size > 1 and c.strategy.name != "no_buffer" for c in cells)
    assert any(c.track_interval != 256 for c in cells)
    hicache = [c for c in cells if c.cache_variant.name == "hicache"]
    assert {c.model.family for c in hicache} == {"qwen3-next", "nemotron-h", "granite-h", "falcon-h1"}
    assert all(c.tier == "nightly" and c.strategy.name != "no_buffer" for c in hicache)
    lazy_fail = [c for c in cells if c.fault.name == "lazy_alloc_fail"]
    assert lazy_fail and all(c.strategy.name == "extra_buffer_lazy" for c in lazy_fail)
    assert all(dict(c.fault.env) == {"SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL": "1"} for c in lazy_fail)
    qwen = SHIPPED.models["qwen3-next-80b"]
    assert qwen.tp_size == 4 and qwen.hf_path == "Qwen/Qwen3-Next-80B-A3B-Instruct"


def test_markers_and_ids() -> None:
    cell = next(c for c in SHIPPED.cells if c.fault.name == "lazy_alloc_fail")
    assert "lazy_alloc_fail" in cell.markers and "extra_buffer_lazy" in cell.markers
    assert cell.id.endswith("-lazy_alloc_fail")
    clean = next(c for c in SHIPPED.cells if c.fault.name == "none" and c.tier == "premerge")
    assert "lazy_alloc_fail" not in clean.markers and {"premerge", "nightly"} <= set(clean.markers)
    assert len({c.id for c in SHIPPED.cells}) == len(SHIPPED.cells)


def test_effective_chunk_and_grid() -> None:
    cell = next(c for c in SHIPPED.cells if c.model.family == "granite-h" and c.track_interval == 128)
    assert cell.grid.chunk == 256
    assert cell.grid.track_grid == 256  # lcm(256, 1, 128)


def test_select_filters_and_rejects_unknown_values() -> None:
    assert {c.strategy.name for c in SHIPPED.select(strategies=["extra_buffer"])} == {"extra_buffer"}
    assert all(c.tier == "premerge" for c in SHIPPED.select(tier="premerge"))
    standard = SHIPPED.select(tier="standard", target="reference")
    assert len(standard) == 16  # each twin x each strategy + the lazy fault per twin
    assert {c.tier for c in standard} == {"premerge", "standard"}
    assert len(SHIPPED.select(tier="nightly")) == len(SHIPPED.cells)
    assert all("reference" in c.targets for c in SHIPPED.select(target="reference"))
    assert not any(c.cache_variant.name == "hicache" for c in SHIPPED.select(target="reference"))
    with pytest.raises(Exception, match=r"--strategies: unknown value 'bogus'; allowed: no_buffer, extra_buffer, extra_buffer_lazy"):
        SHIPPED.select(strategies=["bogus"])
    with pytest.raises(Exception, match=r"--models: unknown value 'llama'"):
        SHIPPED.select(models=["llama"])


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "m.toml"
    p.write_text(text)
    return p


def _mutated(old: str, new: str, count: int = 1) -> str:
    text = DEFAULT_MATRIX.read_text()
    assert old in text, old
    return text.replace(old, new, count)


BAD = [
    ("unknown key", ('name = "core"', 'name = "core"\ncolour = "red"'), r"\[\[cells\]\] 'core': unknown key 'colour'"),
    ("missing strategy", ('strategies = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]\npage_sizes = [1]',
                          'strategies = ["no_buffer", "mamba_magic"]\npage_sizes = [1]'), r"strategy 'mamba_magic' does not exist in SGLang"),
    ("no_buffer large page", ('strategies = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]\npage_sizes = [1]',
                              'strategies = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]\npage_sizes = [16]'), r"cell qwen3-next-80b-no_buffer-p16-t256: SGLang refuses no_buffer with page size 16"),
    ("no_buffer overlap", ('overlap = false', 'overlap = true'), r"no_buffer with overlap scheduling"),
    ("lazy under pd", ('ping_pong_slots = 1\npd = false', 'ping_pong_slots = 1\npd = true'), r"extra_buffer_lazy under PD"),
    ("track interval", ('strategies = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]\npage_sizes = [1]\ntrack_intervals = [128]',
                        'strategies = ["extra_buffer"]\npage_sizes = [64]\ntrack_intervals = [96]'), r"mamba_track_interval % page_size == 0 \(96 % 64 != 0\)"),
    ("fault strategy", ('strategies = ["extra_buffer_lazy"]\npage_sizes = [1]\ntrack_intervals = [256]\nfaults = ["lazy_alloc_fail"]',
                        'strategies = ["extra_buffer"]\npage_sizes = [1]\ntrack_intervals = [256]\nfaults = ["lazy_alloc_fail"]'), r"fault 'lazy_alloc_fail' only applies to strategies extra_buffer_lazy"),
    ("unknown family", ('family = "falcon-h1"', 'family = "falcon-h2"'), r"unknown family 'falcon-h2'"),
    ("duplicate cell", ('name = "lazy-alloc-fail-premerge"', 'name = "lazy-alloc-fail"\ntier = "premerge"\nmodels = ["*"]\nstrategies = ["extra_buffer"]\npage_sizes = [1]\n[[cells]]\nname = "dup"'), r"defined twice"),
]


@pytest.mark.parametrize("old_new,pattern", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_matrix_is_one_line_naming_file_cell_and_rule(tmp_path: Path, old_new: tuple[str, str], pattern: str) -> None:
    path = _write(tmp_path, _mutated(*old_new))
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(str(path))
    assert __import__("re").search(pattern, msg), msg


def test_malformed_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match="not valid TOML"):
        load_matrix(_write(tmp_path, "schema = [1"))
    with pytest.raises(MatrixError, match="matrix file not found"):
        load_matrix(tmp_path / "nope.toml")


def test_merge_keeps_measured_numbers_and_lets_failures_decide() -> None:
    from conformance.records import Verdict, merge

    load = Verdict("leaks", "pass", {"lazy_resident_ratio": 0.5, "mamba_used_at_idle": 0})
    sessions = Verdict("leaks", "pass", {"lazy_resident_ratio": None, "mamba_used_at_idle": 0})
    merged = merge("leaks", [load, sessions])
    assert merged.status == "pass" and merged.metrics["lazy_resident_ratio"] == 0.5
    leak = Verdict("leaks", "fail", {"mamba_used_at_idle": 3, "lazy_resident_ratio": None}, reason="idle gauges not 0")
    merged = merge("leaks", [load, leak, sessions])
    assert merged.status == "fail" and merged.metrics["mamba_used_at_idle"] == 3 and merged.reason == "idle gauges not 0"
    assert merge("leaks", []).status == "skip"


def test_every_cell_has_its_paired_baseline_and_large_pages_pair_with_page_1():
    from conformance.matrix.cells import baseline_id

    m = load_matrix()
    nb = m.strategies["no_buffer"]
    for cell in m.cells:
        base = m.baseline_for(cell)
        if baseline_id(cell, nb) is None:
            assert cell.strategy.name == "no_buffer" and base is None
            continue
        assert base is not None and base.id == baseline_id(cell, nb), cell.id
        assert base.strategy.name == "no_buffer" and base.track_interval == cell.track_interval
        assert base.page_size == (1 if cell.page_size > 1 else cell.page_size) and base.cache_variant.name == "radix"


def test_a_matrix_without_a_needed_baseline_is_refused(tmp_path):
    text = DEFAULT_MATRIX.read_text().replace('strategies = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]\npage_sizes = [1]\ntrack_intervals = [128]',
                                                        'strategies = ["extra_buffer", "extra_buffer_lazy"]\npage_sizes = [1]\ntrack_intervals = [128]')
    bad = tmp_path / "m.toml"
    bad.write_text(text)
    with pytest.raises(MatrixError, match=r"extra_buffer-p1-t128: its paired GSM8K baseline qwen3-next-80b-no_buffer-p1-t128 is not defined"):
        load_matrix(bad)
