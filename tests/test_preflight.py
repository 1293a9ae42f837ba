"""Preflight: one line per need, before any server starts; a run that cannot happen here
exits non-zero with at most three stderr lines saying why and which target can; GPU
placement maps into an existing CUDA_VISIBLE_DEVICES and refuses ids that do not exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.session import preflight
from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.session.preflight import Request, check_gsm8k, gpu_line, run_preflight, sglang_line
from conformance.targets import sglang as sglang_target

GSM8K = Path(os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR") or Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
MATRIX = load_matrix()
QWEN = MATRIX.select(target="sglang", models=["qwen3-next"], tier="premerge")


def cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, mask: str | None) -> None:
    monkeypatch.setattr(sglang_target, "cuda_device_count", lambda: count)
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)


# ------------------------------------------------------------------ GPU placement


def test_placement_maps_into_an_existing_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2, "3,5")
    assert sglang_target.gpus_for_worker(0, 1) == ["3"]
    assert sglang_target.gpus_for_worker(1, 1) == ["5"]
    assert sglang_target.gpus_for_worker(0, 2) == ["3", "5"]
    with pytest.raises(KitError, match=r"worker gw2 needs GPUs #2\.\.#2 but only 2 visible \(CUDA_VISIBLE_DEVICES=3,5\)"):
        sglang_target.gpus_for_worker(2, 1)


def test_a_second_worker_on_a_one_gpu_runner_is_refused_not_given_gpu_1(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1, "0")
    assert sglang_target.gpus_for_worker(0, 1) == ["0"]
    with pytest.raises(KitError, match="gw1"):
        sglang_target.gpus_for_worker(1, 1)
    _gpus(monkeypatch, 1, "0,1,2")  # a mask naming devices CUDA does not have is trimmed to what exists
    assert sglang_target.visible_gpus()[0] == ["0"]


def test_placement_without_mask_uses_present_devices_and_without_any_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2, None)
    assert sglang_target.gpus_for_worker(1, 1) == ["1"]
    with pytest.raises(KitError):
        sglang_target.gpus_for_worker(1, 2)
    _gpus(monkeypatch, 0, None)
    with pytest.raises(KitError, match="--target sglang-cpu"):
        sglang_target.gpus_for_worker(0, 1)
    with sglang_target.describing_gpus():  # `plan` describes, it does not launch
        assert sglang_target.gpus_for_worker(1, 4) == ["4", "5", "6", "7"]


# ------------------------------------------------------------------ lines


def test_gpu_line_names_the_cause_and_the_target_that_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0, None)
    line = gpu_line(Request(target="sglang", cells=tuple(QWEN), suites=("kl",)))
    assert not line.ok and "this machine has none" in line.text and "--target sglang-cpu" in line.hint
    _gpus(monkeypatch, 1, None)
    line = gpu_line(Request(target="sglang", cells=tuple(QWEN), suites=("kl",)))
    assert not line.ok and "needs 4 GPUs per worker but --gpus-per-worker is 1" in line.text
    twins = gpu_line(Request(target="sglang", cells=tuple(QWEN), suites=("kl",), twins=True, workers=2))
    assert not twins.ok and "2 workers x 1 GPUs = 2, but 1 visible" in twins.text
    assert gpu_line(Request(target="sglang", cells=tuple(QWEN), suites=("kl",), twins=True)).ok
    pd = gpu_line(Request(target="sglang", cells=tuple(QWEN), suites=("disagg",), twins=True, gpus_per_worker=1))
    assert not pd.ok and "needs 3 GPUs per worker" in pd.text  # non-PD server + prefill + decode
    assert gpu_line(Request(target="reference", cells=tuple(QWEN), suites=("kl",))).ok


def test_gsm8k_line_checks_files_and_hashes(tmp_path: Path) -> None:
    if not (GSM8K / "test.jsonl").is_file():
        pytest.skip(f"GSM8K is not at {GSM8K}: set HYBRID_CONFORMANCE_GSM8K_DIR")
    good = check_gsm8k(str(GSM8K))
    assert good.ok and "sha256 ok" in good.text and "1319 test items" in good.text
    missing = check_gsm8k(str(tmp_path / "nope"))
    assert not missing.ok and "test.jsonl not found" in missing.text
    for name in ("test.jsonl", "train_first8.jsonl"):
        shutil.copy(GSM8K / name, tmp_path / name)
    with (tmp_path / "test.jsonl").open("a") as f:
        f.write("\n")
    tampered = check_gsm8k(str(tmp_path))
    assert not tampered.ok and "sha256" in tampered.text


def test_gsm8k_is_checked_only_when_a_selected_suite_scores_it() -> None:
    lazy = [c for c in QWEN if not c.strategy.pd]
    assert preflight.needs_gsm8k(("gsm8k",), lazy)
    assert not preflight.needs_gsm8k(("kl", "leaks"), QWEN)
    assert not preflight.needs_gsm8k(("disagg",), lazy)  # PD is not applicable to lazy cells
    assert preflight.needs_gsm8k(("disagg",), QWEN)


def test_sglang_line_reports_missing_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "sglang_version", lambda: "0.5.9")
    monkeypatch.setattr(preflight, "probe_sglang", lambda: {"version": "0.5.9", "strategy_flag": "--mamba-scheduler-strategy", "strategies": ["no_buffer", "extra_buffer"], "flags": ["--device"]})
    line = sglang_line(Request(target="sglang-cpu", cells=tuple(QWEN), suites=("kl",)))
    assert not line.ok and "lacks what the selection needs: extra_buffer_lazy" in line.text
    monkeypatch.setattr(preflight, "probe_sglang", lambda: {"error": "ImportError: no sgl_kernel"})
    line = sglang_line(Request(target="sglang-cpu", cells=tuple(QWEN), suites=("kl",)))
    assert not line.ok and "does not import: ImportError: no sgl_kernel" in line.text
    monkeypatch.setattr(preflight, "sglang_version", lambda: None)
    assert not sglang_line(Request(target="sglang", cells=tuple(QWEN), suites=("kl",))).ok
    assert sglang_line(Request(target="reference", cells=tuple(QWEN), suites=("kl",))).ok


def test_sglang_cpu_preflight_imports_sglang_and_finds_the_kits_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sglang", reason="sglang is not installed: run ci/setup-cpu.sh")
    cells = tuple(MATRIX.select(target="sglang-cpu", models=["qwen3-next"], tier="premerge"))
    pre = run_preflight(Request(target="sglang-cpu", cells=cells, suites=("kl",)))
    by = {line.name: line for line in pre.lines}
    assert by["sglang"].ok and "imports" in by["sglang"].text and "extra_buffer_lazy" in by["sglang"].text, by["sglang"]
    assert by["plugins"].ok, by["plugins"]
    from importlib import metadata

    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    assert not preflight.plugins_line(Request(target="sglang-cpu", cells=cells, suites=())).ok


def test_launch_line_names_the_launch_mode_and_refuses_an_unknown_one(monkeypatch: pytest.MonkeyPatch) -> None:
    cells = tuple(MATRIX.select(target="sglang-cpu", models=["qwen3-next"], tier="premerge"))
    req = Request(target="sglang-cpu", cells=cells, suites=("kl",))
    monkeypatch.delenv("HYBRID_CONFORMANCE_LAUNCH", raising=False)
    line = preflight.launch_line(req)
    assert line.ok and "HYBRID_CONFORMANCE_LAUNCH=preimported-fork" in line.text and "children forked too" in line.text, line
    monkeypatch.setenv("HYBRID_CONFORMANCE_LAUNCH", "plain")
    assert preflight.launch_line(req).ok and "plain python -m sglang.launch_server" in preflight.launch_line(req).text
    monkeypatch.setenv("HYBRID_CONFORMANCE_LAUNCH", "turbo")
    bad = preflight.launch_line(req)
    assert not bad.ok and "HYBRID_CONFORMANCE_LAUNCH='turbo': not one of" in bad.text
    assert preflight.launch_line(Request(target="reference", cells=(), suites=("kl",))) is None


# ------------------------------------------------------------------ the command


def test_no_gpu_run_is_refused_in_at_most_three_lines_before_any_launch(tmp_path: Path) -> None:
    out = cli("run", "--target", "sglang", "--tier", "premerge", "--report-dir", str(tmp_path / "rep"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 3, out.stdout + out.stderr
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert 1 <= len(err) <= 3 and "Traceback" not in out.stderr
    assert "this machine has none" in err[0] and "--target sglang-cpu" in out.stderr
    assert "preflight gpus      FAIL" in out.stdout
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["complete"] is False and report["launches"] == 0
    assert set(report["cells_not_run"]) == {c.id for c in MATRIX.select(target="sglang", tier="premerge")}
    assert not (tmp_path / "rep" / "logs").exists()  # nothing was started


def test_an_empty_selection_exits_non_zero_in_at_most_three_lines(tmp_path: Path) -> None:
    out = cli("run", "--page-sizes", "3", "--report-dir", str(tmp_path / "rep"))
    assert out.returncode == 5
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert 1 <= len(err) <= 3 and "matches no cell" in err[0]
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["complete"] is False


def test_missing_gsm8k_is_refused_before_servers_start(tmp_path: Path) -> None:
    out = cli("run", "--tier", "premerge", "--report-dir", str(tmp_path / "rep"), env={"HYBRID_CONFORMANCE_GSM8K_DIR": str(tmp_path / "nope")})
    assert out.returncode == 3
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(err) <= 3 and "GSM8K" in err[0] and "not found" in err[0]
    assert not (tmp_path / "rep" / "logs").exists()


def test_pytest_path_fails_tests_at_setup_in_one_line_without_launching(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(test_x="def test_x(endpoint):\n    raise AssertionError('must not run')\n")
    result = pytester.runpytest_subprocess("--target", "sglang", "--models", "qwen3-next", "--tier", "premerge", "-p", "no:cacheprovider", "-rE")
    cells = MATRIX.select(target="sglang", models=["qwen3-next"], tier="premerge")
    result.assert_outcomes(errors=len(cells))
    result.stdout.fnmatch_lines(["*preflight: target sglang serves on CUDA GPUs*--target sglang-cpu*"])
    assert "must not run" not in result.stdout.str() and "Traceback" not in result.stdout.str()


def test_pd_line_names_the_transport_or_sglangs_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.session.preflight import pd_transport_line

    cpu = tuple(MATRIX.select(target="sglang-cpu", models=["qwen3-next"], tier="premerge"))
    monkeypatch.setattr(preflight, "probe_sglang", lambda: {"pd_transfer_refusal": None})
    line = pd_transport_line(Request(target="sglang-cpu", cells=cpu, suites=("disagg",)))
    assert line.ok and line.name == "pd" and line.text.startswith("transport mooncake over tcp (MC_FORCE_TCP=1;") and "router" in line.text
    monkeypatch.setattr(preflight, "probe_sglang", lambda: {"pd_transfer_refusal": "Please install mooncake by following the instructions"})
    line = pd_transport_line(Request(target="sglang-cpu", cells=cpu, suites=("disagg",)))
    assert line.ok and "PD cells n/a: SGLang's mooncake transfer engine refuses this machine: Please install mooncake" in line.text
    assert pd_transport_line(Request(target="sglang-cpu", cells=cpu, suites=("kl",))) is None
    assert pd_transport_line(Request(target="reference", cells=tuple(QWEN), suites=("disagg",))) is None
    lazy = tuple(c for c in cpu if not c.strategy.pd)
    assert pd_transport_line(Request(target="sglang-cpu", cells=lazy, suites=("disagg",))) is None
