"""Server options as matrix axes (conformance/matrix/axes.py, conformance/matrix/pairwise.py): each value
maps to SGLang's flags in one place, the matrix validates them, the tiers carry them (premerge
unchanged, standard one cell per value, nightly a generated pairwise covering array), and a
release or a start that refuses one makes the cell ``na`` with SGLang's own line."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.matrix import axes
from conformance.matrix.cells import MatrixError, load_matrix
from conformance.matrix.pairwise import covering_array, feasible_pairs
from conformance.sglang_api.probes import Features
from conformance.targets.option_refusal import gate_refusal, launch_refusal, probed_refusal, start_refusal
from conformance.targets.sglang_cpu import SGLangCpuTarget

SHIPPED = load_matrix()
ROOT = Path(__file__).resolve().parents[1]
PAIRWISE_BLOCK = "axes-pairwise"


def _cell(**options: str):
    base = next(c for c in SHIPPED.cells if c.id == "qwen3-next-80b-extra_buffer-p1-t256")
    import dataclasses

    return dataclasses.replace(base, options=tuple((a, options[a]) for a in axes.NAMES if a in options))


# ------------------------------------------------------------------ one place for the flags

def test_every_axis_value_maps_to_its_flags_once_in_the_sglang_cpu_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("conformance.targets.sglang.detect_strategy_flag", lambda launcher="": "--mamba-radix-cache-strategy")
    target = SGLangCpuTarget()
    for axis in axes.AXES.values():
        for value in axis.values.values():
            cell = _cell(**{axis.name: value.name})
            if value.refuses(cell):
                continue
            argv = target.server_args(cell, port=1)
            for arg in value.args(cell):
                if arg.startswith("--"):
                    assert argv.count(arg) == 1, (value.key, arg, argv)
            flags = [a for a in argv if a.startswith("--")]
            assert len(flags) == len(set(flags)), (value.key, flags)
    small = target.server_args(_cell(kv_pool="small", mamba_pool="small"), port=1)
    assert small[small.index("--max-total-tokens") + 1] == str(axes.SMALL_MAX_TOTAL_TOKENS)
    assert small[small.index("--max-mamba-cache-size") + 1] == str(axes.SMALL_MAX_MAMBA_CACHE_SIZE)
    plain = target.server_args(_cell(), port=1)
    assert plain[plain.index("--max-total-tokens") + 1] == str(axes.CPU_MAX_TOTAL_TOKENS)
    assert "--enable-streaming-session" in plain and "--enable-streaming-session" not in target.server_args(_cell(sessions="plain"), port=1)
    assert "--disable-overlap-schedule" in target.server_args(_cell(overlap="off"), port=1) and "--disable-overlap-schedule" not in plain


def test_chunked_prefill_sizes_follow_the_cell_grid() -> None:
    cell = _cell(chunked_prefill="grid")  # qwen3-next: chunk 64, page 1
    assert axes.chunked_prefill_size("grid", cell.grid) == 128
    assert axes.chunked_prefill_size("off-grid", cell.grid) == 96
    assert axes.chunked_prefill_size("sub-chunk", cell.grid) == 32
    assert axes.chunked_prefill_size("default", cell.grid) is None


def test_streaming_sessions_follow_the_sessions_axis() -> None:
    assert axes.enabled(_cell(), axes.STREAMING_SESSIONS)
    assert not axes.enabled(_cell(sessions="plain"), axes.STREAMING_SESSIONS)


def test_eviction_order_runs_on_the_ordered_policies_and_the_small_kv_pool() -> None:
    assert all(axes.enabled(_cell(eviction=p), axes.EVICTION_ORDER) for p in axes.ORDERED_POLICIES)
    assert axes.enabled(_cell(kv_pool="small"), axes.EVICTION_ORDER)  # LRU (the axis off) under KV pressure
    assert "tlru" in axes.ORDERED_POLICIES and not axes.enabled(_cell(), axes.EVICTION_ORDER)


# ------------------------------------------------------------------ the matrix validates them

def _matrix(tmp_path: Path, extra: str, *, axes_tables: str | None = None) -> Path:
    text = (ROOT / "fixtures" / "matrix.toml").read_text()
    text = text.split("# ---------------------------------------------------------------- server-option axes\n# standard")[0]
    if axes_tables is not None:
        head, _, rest = text.partition("[axes.overlap]")
        text = head + axes_tables + "\n# ---------------------------------------------------------------- models" + rest.split("# ---------------------------------------------------------------- models", 1)[1]
    p = tmp_path / "matrix.toml"
    p.write_text(text + extra)
    return p


BLOCK = """
[[cells]]
name = "bad"
tier = "standard"
targets = ["sglang-cpu"]
models = ["qwen3-next-80b"]
strategies = ["{strategy}"]
page_sizes = [{page}]
options = {{ {options} }}
"""


@pytest.mark.parametrize("strategy,page,options,rule", [
    ("no_buffer", 1, 'overlap = ["on"]', "SGLang refuses no_buffer with overlap scheduling"),
    ("extra_buffer_lazy", 1, 'overlap = ["off"]', "SGLang refuses extra_buffer_lazy without the overlap scheduler at start: 'Lazy extra buffer requires overlap schedule"),
    ("extra_buffer", 64, 'chunked_prefill = ["off-grid"]', "chunked prefill 'off-grid' needs a size that is a multiple of the page (96 with page 64)"),
    ("extra_buffer", 1, 'bogus = ["on"]', "axis 'bogus' is not declared in [axes]"),
    ("extra_buffer", 1, 'eviction = ["fifo"]', "value 'fifo' is not in [axes.eviction] values"),
    ("extra_buffer", 1, 'eviction = []', "options.eviction must be a non-empty list"),
])
def test_matrix_refuses_bad_options_in_one_line(tmp_path: Path, strategy: str, page: int, options: str, rule: str) -> None:
    path = _matrix(tmp_path, BLOCK.format(strategy=strategy, page=page, options=options))
    with pytest.raises(MatrixError) as e:
        load_matrix(path)
    assert rule in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_matrix_refuses_an_axis_or_value_the_kit_does_not_map(tmp_path: Path) -> None:
    with pytest.raises(MatrixError, match=r"\[axes.turbo\]: unknown axis 'turbo'"):
        load_matrix(_matrix(tmp_path, "", axes_tables='[axes.turbo]\nvalues = ["on"]\n'))
    with pytest.raises(MatrixError, match=r"\[axes.eviction\]: unknown value 'fifo' \(the kit maps: lru, lfu, slru, priority, tlru\)"):
        load_matrix(_matrix(tmp_path, "", axes_tables='[axes.eviction]\nvalues = ["fifo"]\n'))
    with pytest.raises(MatrixError, match="unknown generate 'random'"):
        load_matrix(_matrix(tmp_path, BLOCK.format(strategy="extra_buffer", page=1, options='eviction = ["lfu"]') + 'generate = "random"\n'))


def test_default_values_do_not_make_a_new_cell(tmp_path: Path) -> None:
    m = load_matrix(_matrix(tmp_path, BLOCK.format(strategy="extra_buffer", page=16, options='eviction = ["lru", "lfu"], mixed_chunk = ["off"]')))
    ids = [c.id for c in m.cells if c.block == "bad"]
    assert ids == ["qwen3-next-80b-extra_buffer-p16-t256", "qwen3-next-80b-extra_buffer-p16-t256-eviction-lfu"]
    assert all("-eviction-lru" not in c.id and "-mixed_chunk-off" not in c.id and "-overlap-on" not in c.id for c in SHIPPED.cells)


# ------------------------------------------------------------------ tiers

def test_premerge_keeps_its_size_and_standard_has_one_cell_per_axis_value() -> None:
    premerge = SHIPPED.select(tier="premerge", target="sglang-cpu")
    assert len(premerge) == 8 and not any(c.options for c in premerge)
    standard = SHIPPED.select(tier="standard", target="sglang-cpu")
    seen = {(a, v) for c in standard for a, v in c.describe()["options"].items()}
    for axis in axes.AXES.values():
        for value in SHIPPED.axes[axis.name]:
            assert (axis.name, value) in seen, f"standard has no cell with {axis.name}={value}"
    assert {16, 64, 128, 256} <= {c.page_size for c in standard}
    axis_cells = [c for c in standard if c.options]
    assert all(len(c.options) == 1 for c in axis_cells)  # one value per cell: a failure names its option
    # one cell per axis value and strategy (strip-thinking also runs no_buffer, whose finish donates the live state)
    assert len({(c.options, c.strategy) for c in axis_cells}) == len(axis_cells)
    assert len({c.options for c in axis_cells}) == len(axis_cells) - 1
    assert not SHIPPED.select(tier="standard", target="reference", server_options=["mixed_chunk=on"])


def _pair_set(cells, names):
    rows = []
    for c in cells:
        d = c.describe()
        rows.append({"model": d["model"], "strategy": d["strategy"], "page_size": d["page_size"], "track_interval": d["track_interval"],
                     "fault": d["fault"], "cache_variant": d["cache_variant"], **d["options"]})
    return {((a, r[a]), (b, r[b])) for r in rows for a, b in itertools.combinations(names, 2)}


def _brute_force_feasible(matrix) -> set:
    """Every pair of the pairwise block's values that some valid cell holds, by enumerating
    the whole product (the generator's own search is not trusted here)."""
    params = matrix.generated[PAIRWISE_BLOCK]
    names = [n for n, _ in params]
    from conformance.matrix.cells import _partial_validity, _Ctx  # the loader's own rules

    core = [(n, vs) for n, vs in params if n in ("model", "strategy", "page_size", "track_interval", "fault", "cache_variant")]
    rest = [(n, vs) for n, vs in params if n not in dict(core)]
    build = _builder(matrix)
    valid = _partial_validity(_Ctx(matrix.path), build, params)
    out = set()
    for combo in itertools.product(*(vs for _, vs in core)):
        row = dict(zip([n for n, _ in core], combo))
        if not valid(row):
            continue
        ok_rest = {n: [v for v in vs if valid({**row, n: v})] for n, vs in rest}
        full = {**{n: [row[n]] for n in row}, **ok_rest}
        for a, b in itertools.combinations(names, 2):
            if a in row and b in row:
                out.add(((a, row[a]), (b, row[b])))
                continue
            for va in full[a]:
                for vb in full[b]:
                    if valid({**row, a: va, b: vb}):
                        out.add(((a, va), (b, vb)))
    return out


def _builder(matrix):
    import dataclasses

    from conformance.matrix.cells import Cell, _normalized

    def build(row):
        cell = Cell(matrix.models[row["model"]], matrix.strategies[row["strategy"]], row["page_size"], row["track_interval"],
                    matrix.faults[row["fault"]], matrix.cache_variants[row["cache_variant"]], "nightly", PAIRWISE_BLOCK, ("sglang-cpu",))
        return dataclasses.replace(cell, options=_normalized(cell, {a: row[a] for a in axes.NAMES if a in row}))
    return build


def test_nightly_holds_every_feasible_pair_of_axis_values() -> None:
    params = SHIPPED.generated[PAIRWISE_BLOCK]
    names = [n for n, _ in params]
    assert {"overlap", "mixed_chunk", "chunked_prefill", "mamba_pool", "kv_pool", "eviction", "sessions", "reasoning", "page_size"} <= set(names)
    feasible = _brute_force_feasible(SHIPPED)
    nightly = SHIPPED.select(tier="nightly", target="sglang-cpu")
    missing = feasible - _pair_set(nightly, names)
    assert not missing, f"{len(missing)} feasible pairs in no nightly cell, e.g. {sorted(missing, key=str)[:3]}"
    assert len(feasible) > 400  # the check is not vacuous: hundreds of pairs
    # ... and it fails when one generated cell is dropped
    generated = [c for c in nightly if c.block == PAIRWISE_BLOCK]
    others = [c for c in nightly if c.block != PAIRWISE_BLOCK]
    dropped = [c for c in generated if feasible - _pair_set(others + [g for g in generated if g is not c], names)]
    assert dropped, "no generated cell is needed: the covering array is not what covers the pairs"
    # the pairs SGLang refuses together are left out, never covered
    assert (("strategy", "no_buffer"), ("page_size", 64)) not in feasible
    assert (("strategy", "no_buffer"), ("overlap", "on")) not in feasible
    assert (("strategy", "extra_buffer_lazy"), ("overlap", "off")) not in feasible
    assert not [c.id for c in nightly if c.strategy.lazy and dict(c.options).get("overlap") == "off"]


def test_no_generated_cell_is_one_every_release_refuses() -> None:
    """The generated Granite page-128 interval-128 cell was n/a on all 13 releases (SGLang
    asserts mamba_track_interval >= the Mamba2 chunk with a buffer), so the pairs only it held
    ran nowhere.  Generated cells now pass that rule; SGLang's own probe (the installed
    release) agrees, and the hand-written interval-128 cells still show the refusal as n/a."""
    from conformance.sglang_api.probes import probe

    features = probe()
    nightly = SHIPPED.select(tier="nightly", target="sglang-cpu")
    generated = [c for c in nightly if c.block == PAIRWISE_BLOCK]
    refused = [c.id for c in generated if c.strategy.has_buffer and features.track_interval_not_applicable(c.track_interval, c.model.mamba_chunk_size)]
    assert generated and not refused, refused
    shown = [c for c in nightly if c.block != PAIRWISE_BLOCK and c.strategy.has_buffer
             and features.track_interval_not_applicable(c.track_interval, c.model.mamba_chunk_size)]
    assert shown and all(c.model.id == "granite-4.0-h-tiny" for c in shown)  # the rule bites where it should: n/a, with SGLang's line


def test_covering_array_is_deterministic_and_honours_constraints() -> None:
    params = [("a", [1, 2, 3]), ("b", ["x", "y"]), ("c", [True, False])]

    def valid(row):
        return not (row.get("a") == 3 and row.get("b") == "y")

    rows = covering_array(params, valid)
    assert rows == covering_array(params, valid)
    assert all(valid(r) for r in rows)
    need = feasible_pairs(params, valid)
    got = {((a, r[a]), (b, r[b])) for r in rows for a, b in itertools.combinations("abc", 2)}
    assert need <= got and (("a", 3), ("b", "y")) not in need
    assert len(rows) < 3 * 2 * 2  # smaller than the product


def test_plan_nightly_lists_every_axis_value() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(["hybrid-conformance", "plan", "--target", "sglang-cpu", "--tier", "nightly", "--format", "json"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)["cells"]
    seen = {(a, v) for r in rows for a, v in r["options"].items()}
    for axis, values in SHIPPED.axes.items():
        for v in values:
            assert (axis, v) in seen, f"{axis}={v}"
    assert {1, 16, 64, 128, 256} <= {r["page_size"] for r in rows}
    mixed = next(r for r in rows if r["options"]["mixed_chunk"] == "on")
    assert "--enable-mixed-chunk" in mixed["command"]


def test_server_options_selection_and_its_errors() -> None:
    assert [c.id for c in SHIPPED.select(tier="standard", target="sglang-cpu", models=["qwen3-next"], strategies=["extra_buffer"],
                                         server_options=["mixed_chunk=on"])] == ["qwen3-next-80b-extra_buffer-p1-t256-mixed_chunk-on"]
    # one axis named twice selects either value; two axes both
    either = SHIPPED.select(tier="standard", target="sglang-cpu", models=["qwen3-next"], strategies=["extra_buffer"],
                            server_options=["eviction=lfu", "eviction=slru"])
    assert sorted(c.id for c in either) == ["qwen3-next-80b-extra_buffer-p1-t256-eviction-lfu", "qwen3-next-80b-extra_buffer-p1-t256-eviction-slru"]
    assert not SHIPPED.select(tier="standard", target="sglang-cpu", models=["qwen3-next"], strategies=["extra_buffer"],
                              server_options=["eviction=lfu", "mixed_chunk=on"])
    with pytest.raises(Exception, match=r"--server-options: mixed_chunk has no value 'maybe'; allowed: off, on"):
        SHIPPED.select(server_options=["mixed_chunk=maybe"])
    with pytest.raises(Exception, match=r"--server-options: expected axis=value"):
        SHIPPED.select(server_options=["turbo"])


# ------------------------------------------------------------------ na with SGLang's line

TLRU_REFUSAL = '''[2026-11-26 00:33:10] INFO server_args.py:1: starting
Traceback (most recent call last):
  File "/x/site-packages/sglang/launch_server.py", line 30, in <module>
    server_args = prepare_server_args(sys.argv[1:])
  File "/x/site-packages/sglang/srt/arg_groups/resolution_hooks.py", line 139, in run_hook
    step(server_args)
  File "/x/site-packages/sglang/srt/arg_groups/kv_cache_hook.py", line 386, in handle_cache_compatibility
    raise ValueError(
ValueError: --radix-eviction-policy tlru needs 'threshold' greater than 'next_prompt_estimate' in --radix-eviction-policy-config, got 0 <= 0; otherwise no tokens are ever TEL-safe and T-LRU is exactly LRU.
'''
TLRU_LINE = TLRU_REFUSAL.strip().splitlines()[-1]
CRASH_AFTER_START = '''Traceback (most recent call last):
  File "/x/site-packages/sglang/srt/managers/scheduler.py", line 9, in run_scheduler_process
    scheduler.event_loop_overlap()
RuntimeError: boom
'''


def test_a_start_refusal_in_sglangs_argument_resolution_is_na_with_its_line() -> None:
    cell = _cell(eviction="tlru")
    line = launch_refusal(cell, TLRU_REFUSAL)
    assert line is not None and line.startswith("ValueError: --radix-eviction-policy tlru needs 'threshold'")
    assert launch_refusal(cell, CRASH_AFTER_START) is None  # a crash is a failure, not a refusal
    assert launch_refusal(_cell(), TLRU_REFUSAL) is None  # a core cell SGLang refuses stays a failure
    # ... unless SGLang refuses the cell's strategy for the model's architecture (0.5.12, Nemotron-H)
    for refusal in ("AssertionError: mamba extra_buffer is not supported for NemotronHForCausalLM model",
                    "AssertionError: extra_buffer is not supported for NemotronHForCausalLM; use no_buffer."):
        assert launch_refusal(_cell(), TLRU_REFUSAL.replace(TLRU_LINE, refusal)) == refusal
    assert launch_refusal(cell, "no traceback here") is None


def test_a_release_whose_parser_lacks_an_option_makes_the_cell_na() -> None:
    old = Features(version="0.5.13", flags=("--max-total-tokens",), choices=(("--radix-eviction-policy", ("lru", "lfu")),))
    assert probed_refusal(_cell(mixed_chunk="on"), old) == "sglang 0.5.13: error: unrecognized arguments: --enable-mixed-chunk"
    new = Features(version="0.5.23", flags=("--radix-eviction-policy",), choices=(("--radix-eviction-policy", ("lru", "lfu")),))
    assert "invalid choice: 'slru'" in probed_refusal(_cell(eviction="slru"), new)
    assert probed_refusal(_cell(eviction="lfu"), new) is None
    assert probed_refusal(_cell(), old) is None  # a cell without options is never na here


def _base_cell(strategy: str):
    return next(c for c in SHIPPED.cells if c.strategy.name == strategy and not c.options and c.model.id.startswith("qwen3-next"))


def test_a_release_with_no_answerable_device_gate_makes_extra_buffer_cells_na_before_launch(monkeypatch) -> None:
    """No platform answer and no assert the CPU plugin's hook knows: the extra-buffer cells
    are na before any server starts, the missing capability named; no_buffer still runs;
    a release whose gate was found is never na here."""
    from types import SimpleNamespace

    import conformance.plugin as plugin
    import conformance.sglang_api.probes as probes
    from conformance.targets.registry import target_for

    ungated = Features(version="0.5.99", strategies=("no_buffer", "extra_buffer"), extra_buffer_gate=None)
    line = gate_refusal(_base_cell("extra_buffer"), ungated)
    assert line.startswith("sglang 0.5.99: extra_buffer is gated on the device") and "support_mamba_cache_extra_buffer" in line
    assert gate_refusal(_base_cell("no_buffer"), ungated) is None
    for where in ("platform", "server_args"):
        assert gate_refusal(_base_cell("extra_buffer"), Features(version="0.5.20", extra_buffer_gate=where)) is None
    monkeypatch.setattr(probes, "probe", lambda: ungated)
    state = SimpleNamespace(not_applicable={})
    with pytest.raises(pytest.skip.Exception):
        plugin._skip_if_options_not_applicable(state, _base_cell("extra_buffer"), target_for("sglang-cpu"))
    assert list(state.not_applicable.values()) == [line]
    state.not_applicable.clear()
    plugin._skip_if_options_not_applicable(state, _base_cell("no_buffer"), target_for("sglang-cpu"))
    plugin._skip_if_options_not_applicable(state, _base_cell("extra_buffer"), target_for("reference"))  # not SGLang: no gate
    assert state.not_applicable == {}


def _cell_of(model: str, strategy: str, interval: int):
    return next(c for c in SHIPPED.cells if c.model.id == model and c.strategy.name == strategy
                and c.track_interval == interval and not c.options and c.fault.name == "none" and c.cache_variant.name == "radix")


def test_an_extra_buffer_track_interval_below_the_models_chunk_is_na_with_sglangs_assert(monkeypatch) -> None:
    """Seeded: granite's chunk is 256, the short-track-interval cells ask 128; a release whose
    Mamba2 backend asserts the floor makes them na before launch with SGLang's own line. Not
    vacuous: the interval at the chunk, no_buffer, or a release without the assert launches."""
    from types import SimpleNamespace

    import conformance.plugin as plugin
    import conformance.sglang_api.probes as probes
    from conformance.targets.registry import target_for

    floor = Features(version="0.5.22", mamba2_track_floor=True, extra_buffer_gate="server_args")
    short = _cell_of("granite-4.0-h-tiny", "extra_buffer", 128)
    assert short.model.mamba_chunk_size == 256
    line = start_refusal(short, floor, twins=True)
    assert line == "sglang 0.5.22: AssertionError: mamba_track_interval (128) must be >= mamba_chunk_size (256) (Mamba2AttnBackend with the extra buffer)"
    assert start_refusal(_cell_of("granite-4.0-h-tiny", "extra_buffer", 256), floor, twins=True) is None
    assert start_refusal(_cell_of("granite-4.0-h-tiny", "no_buffer", 128), floor, twins=True) is None
    assert start_refusal(_cell_of("nemotron-nano-9b-v2", "extra_buffer", 128), floor, twins=True) is None  # chunk 128
    assert start_refusal(short, Features(version="0.5.12"), twins=True) is None  # 0.5.12 has no such assert
    monkeypatch.setattr(probes, "probe", lambda: floor)
    state = SimpleNamespace(not_applicable={})
    with pytest.raises(pytest.skip.Exception):
        plugin._skip_if_options_not_applicable(state, short, target_for("sglang-cpu"))
    assert list(state.not_applicable.values()) == [line]


def test_a_think_end_token_the_twin_splits_is_na_where_the_release_needs_one_token() -> None:
    """Seeded: 0.5.12-0.5.16's reasoner grammar backend refuses a think end of more than one
    token, and the twins' tokenizer splits '</think>'; the strip-thinking cell is na there with
    SGLang's line. Not vacuous: a later release, a cell without reasoning, a real model's server."""
    from conformance.reference.tokenizer import TwinTokenizer
    from conformance.reference.twins import ensure_twin

    cell = _cell(reasoning="strip-thinking")
    n = len(TwinTokenizer(ensure_twin(cell.model.twin)).encode(axes.THINK_END_TOKEN))
    assert n > 1
    old = Features(version="0.5.16", think_end_single_token=True)
    assert start_refusal(cell, old, twins=True) == (
        f"sglang 0.5.16: ValueError: think_end_token '</think>' must encode to exactly one token for constrained reasoning. "
        f"(the served tokenizer encodes it to {n})")
    assert start_refusal(cell, Features(version="0.5.18"), twins=True) is None
    assert start_refusal(_cell(), old, twins=True) is None
    assert start_refusal(cell, old, twins=False) is None  # the real qwen3 tokenizer has '</think>' as one token
    assert old.think_end_not_applicable("</think>", 1) is None


def test_report_marks_a_cell_whose_tests_were_skipped_as_not_applicable() -> None:
    from conformance.report.outcomes import Outcomes
    from conformance.report.run_report import NOT_APPLICABLE_SKIP, collect_cells

    o = Outcomes()
    o.synthesized["c1"] = {"kl": [{"status": "skip", "reason": f"Skipped: {NOT_APPLICABLE_SKIP}SGLang refuses: ValueError: x"}]}
    o.synthesized["c2"] = {"kl": [{"status": "skip", "reason": "Skipped: something else"}]}
    cells = {c["id"]: c for c in collect_cells(o)}
    assert cells["c1"]["not_applicable"] == "SGLang refuses: ValueError: x" and cells["c1"]["checks"] == {}
    assert "not_applicable" not in cells["c2"] and cells["c2"]["checks"]["kl"]["status"] == "skip"


def test_option_faults_name_their_axis_value() -> None:
    from conformance.sglang_plugins.faults.catalogue import faults, in_group

    assert in_group("option")
    for name in in_group("option"):
        f = faults()[name]
        assert f.options and axes.parse_selection(f.options)
        assert SHIPPED.select(tier="standard", target="sglang-cpu", models=list(f.families), strategies=[f.strategies[0]], server_options=list(f.options))



def test_a_fault_needing_only_default_options_runs_on_the_plain_premerge_cell() -> None:
    """overlap=on is extra_buffer's default: its mutants plan takes the premerge cell, not
    every standard axis cell that leaves overlap on; a non-default option keeps its axis cell."""
    from conformance.mutants.catalogue import sglang_cpu_plans
    from conformance.matrix.strategy import strategy_named

    eb = strategy_named("extra_buffer")
    assert axes.all_default(("overlap=on",), eb) and not axes.all_default(("overlap=off",), eb)
    assert not axes.all_default(("overlap=on", "mamba_pool=small"), eb)
    plans = sglang_cpu_plans(("overlap_track_slot_reused", "pressure_evict_slot_still_cached"))
    assert plans["overlap_track_slot_reused"].tier == "premerge"
    assert plans["pressure_evict_slot_still_cached"].tier == "standard"
    cells = SHIPPED.select(tier="premerge", target="sglang-cpu", models=["qwen3-next"], strategies=["extra_buffer"], server_options=["overlap=on"])
    assert [c.options for c in cells] == [()]



def test_kl_prefill_hit_is_skipped_where_no_prefill_stores_a_state() -> None:
    """The sub-chunk cell (--chunked-prefill-size 32 < grid 64): SGLang stores no prefill state,
    the prefill_hit scenario would have nothing to hit (a clean run failed its non-vacuity
    rule, 0/4 hits); it is skipped with the cause.  Not where a chunk reaches the grid, nor
    without a buffer (no_buffer caches each cut's own state)."""
    from types import SimpleNamespace

    from conformance.session.suite_support import no_prefill_stores

    def ep(options, budget, strategy="extra_buffer"):
        cell = next(c for c in SHIPPED.select(target="sglang-cpu", models=["qwen3-next"], strategies=[strategy], page_sizes=[1])
                    if tuple(c.options) == options and c.fault.name == "none")
        return SimpleNamespace(cell=cell, info={"chunked_prefill_size": budget})

    why = no_prefill_stores(ep((("chunked_prefill", "sub-chunk"),), 32))
    assert why and "--chunked-prefill-size 32 is below the checkpoint grid 64" in why
    assert no_prefill_stores(ep((("chunked_prefill", "off-grid"),), 96)) is None
    assert no_prefill_stores(ep((), 4096)) is None and no_prefill_stores(ep((), -1)) is None
    assert no_prefill_stores(ep((), 32, "no_buffer")) is None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_tree_core_axis_sets_sglangs_variable_only_where_a_cell_sets_it() -> None:
    """``tree_core``: an environment variable, not a flag; a cell at the default keeps the
    release's own core; the non-default core is in the standard tier; a release without the
    registry (or the core) is ``na`` with the probe's line."""
    from conformance.matrix.cells import load_matrix
    from conformance.sglang_api.probes import Features

    cells = load_matrix().cells
    python = [c for c in cells if dict(c.options).get("tree_core") == "python"]
    assert any(c.tier == "standard" for c in python)
    assert all(c.env[axes.TREE_CORE_ENV] == "python" and axes.TREE_CORE_ENV not in axes.server_args(c) for c in python)
    plain = next(c for c in cells if "tree_core" not in dict(c.options))
    assert axes.TREE_CORE_ENV not in plain.env and axes.value_of(plain, "tree_core").name == "rust"
    needs = axes.needed(python[0])
    assert (axes.TREE_CORE_ENV, "python") in needs
    old = Features(version="0.5.18", tree_cores=())
    assert "is not registered" in old.option_not_applicable(needs)
    assert Features(version="0.5.23", tree_cores=("python", "rust")).option_not_applicable(needs) is None
