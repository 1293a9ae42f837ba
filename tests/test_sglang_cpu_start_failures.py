"""A real SGLang server that cannot start on the sglang-cpu target is one line naming the
cause and the log's path, before any check runs, and leaves no process behind.

Each case starts real SGLang (30-90 s of imports on 2 cores) and breaks it one way: a
missing dependency, an op the kit's stand-ins lack, a stand-in written for another SGLang
release (its hook target does not exist).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.plugin import Options
from conformance.targets.serving import serve_cell

pytest.importorskip("sglang")
HERE = Path(__file__).resolve().parent
CELL = load_matrix().select(target="sglang-cpu", models=["qwen3-next"], strategies=["extra_buffer"], tier="premerge")[0]
OPTIONS = Options(target="sglang-cpu", models=None, strategies=None, faults=None, page_sizes=None, tier=None, matrix_path=None,
                  report_dir=None, log_dir=None, sglang_launcher="", gpus_per_worker=1, twins=False, gsm8k_dir=None)

CASES = {
    "missing dependency": ({"PYTHONPATH": str(HERE / "standins" / "broken_dep")}, "uvloop is broken on purpose"),
    "op the stand-ins lack": ({"HYBRID_CONFORMANCE_CPU_OPS_MODULES": "conformance.sglang_plugins.cpu.triton_spots,conformance.sglang_plugins.cpu.mamba2_ops"}, "'sgl_kernel' object has no attribute 'fused_"),
    "stand-in for another release": ({"HYBRID_CONFORMANCE_CPU_OPS_MODULES": "conformance.sglang_plugins.cpu.gdn_ops,conformance.sglang_plugins.cpu.triton_spots,conformance.sglang_plugins.cpu.mamba2_ops,standins.bad_ops",
                                      "PYTHONPATH": str(HERE)}, "no_such_module"),
}


def _children() -> set[int]:
    """This process's descendants, but the launcher's reaper and the pre-imported launcher
    (one per process and import environment, kept alive for the next cell; the servers it
    forked are its children, so they are counted)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "conformance.targets.reaper" not in cmd and "conformance.targets.zygote" not in cmd:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "missing dependency" else pytest.mark.scheduled(reason="a real-SGLang start per case; CI keeps one"))
                                  for c in CASES])
def test_start_failure_is_one_line_with_cause_and_log(case, tmp_path, monkeypatch):
    env, cause = CASES[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v + (os.pathsep + os.environ["PYTHONPATH"] if k == "PYTHONPATH" and os.environ.get("PYTHONPATH") else ""))
    before = _children()
    with pytest.raises(KitError) as info:
        with serve_cell(CELL, OPTIONS, log_dir=tmp_path):
            pass
    msg = str(info.value)
    assert "\n" not in msg and cause in msg, msg
    assert str(tmp_path / f"{CELL.id}.log") in msg
    assert _children() <= before  # every process of the failed server is gone


@pytest.mark.scheduled(reason="a full real-SGLang start; CI keeps one start failure (missing dependency)")
def test_a_checkpoint_weight_sglang_skips_refuses_the_start(tmp_path, monkeypatch):
    """A twin folder whose checkpoint spells a weight otherwise than SGLang's loader expects
    (Nemotron-H's embedding as transformers 5.8.1 saves it) started a healthy server that
    answered garbage (SGLang only logs "Parameter ... not found in params_dict"): the start
    is refused in one line naming the weight."""
    from safetensors.torch import load_file, save_file

    from conformance.reference import twins

    monkeypatch.setenv(twins.CACHE_ENV, str(tmp_path / "twins"))
    folder = twins.ensure_twin("tiny-nemotron-h")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(twins, "PUBLISHED_KEYS", {})  # serve the folder as the 5.8.1 venv left it
    cell = load_matrix().select(target="sglang-cpu", models=["nemotron-h"], strategies=["no_buffer"], tier="premerge")[0]
    before = _children()
    with pytest.raises(KitError) as info:
        with serve_cell(cell, OPTIONS, log_dir=tmp_path):
            pass
    msg = str(info.value)
    assert "\n" not in msg and "did not load 1 weight(s)" in msg and "model.embedding.weight" in msg, msg
    assert _children() <= before
