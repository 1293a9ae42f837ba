"""Every SGLang command of the shipped matrix passes SGLang's own parser and resolve_once() on CPU,
and a refused combination is reported with SGLang's own message."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("sglang", reason="sglang is not installed: run ci/setup-cpu.sh (the pool tier's install)")

from conformance.matrix.cells import load_matrix  # noqa: E402
from conformance.targets.sglang import SGLangTarget, detect_strategy_flag, strip_launcher, validate_server_args  # noqa: E402

warnings.filterwarnings("ignore")
CELLS = load_matrix().select(target="sglang", tier="nightly")


def test_installed_sglang_takes_the_new_strategy_flag() -> None:
    assert detect_strategy_flag() == "--mamba-radix-cache-strategy"


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_every_shipped_command_passes_sglang_validation(cell) -> None:
    target = SGLangTarget()
    spec = target.launch_spec(cell, port=31000, gpus=list(range(cell.model.tp_size)))
    v = validate_server_args(strip_launcher(spec.argv), cell)
    assert v.ok, f"{cell.id}: {v.message}"
    assert v.resolved_strategy == cell.strategy.name
    assert v.resolved_chunk == cell.grid.chunk


def _args_for(cell, **changes):
    args = SGLangTarget().server_args(cell, model_path="x", port=1)
    for flag, value in changes.items():
        args[args.index(flag) + 1] = value
    return args


def test_refused_combinations_carry_sglangs_message() -> None:
    no_buf = next(c for c in CELLS if c.strategy.name == "no_buffer")
    v = validate_server_args(_args_for(no_buf, **{"--page-size": "16"}), no_buf)
    assert not v.ok and "no_buffer only supports page_size=1" in v.message
    extra = next(c for c in CELLS if c.strategy.name == "extra_buffer" and c.page_size == 64)
    v = validate_server_args(_args_for(extra, **{"--mamba-track-interval": "96"}), extra)
    assert not v.ok and v.message.startswith("AssertionError")
    lazy = next(c for c in CELLS if c.strategy.name == "extra_buffer_lazy")
    v = validate_server_args(SGLangTarget().server_args(lazy, model_path="x", port=1) + ["--disaggregation-mode", "prefill"], lazy)
    assert not v.ok and "extra_buffer_lazy unsupported under PD disaggregation" in v.message
