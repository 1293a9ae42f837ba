"""The hybrid-conformance CLI: plan output contract, bad arguments, README/CI consistency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.cli import build_parser
from conformance.commands.run import RunRequest
from conformance.matrix.cells import DEFAULT_TARGET, load_matrix

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], capture_output=True, text=True, timeout=120)


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("hybrid-conformance ")


def test_plan_sglang_json_contract() -> None:
    out = run_cli("plan", "--target", "sglang", "--format", "json", "--tier", "nightly")
    assert out.returncode == 0, out.stderr
    cells = json.loads(out.stdout)["cells"]
    assert len(cells) == len(load_matrix().select(target="sglang"))
    for c in cells:
        assert {"id", "model", "family", "strategy", "page_size", "track_interval", "fault", "markers", "command", "env"} <= set(c)
        cmd = c["command"]
        assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
        assert cmd[cmd.index("--mamba-radix-cache-strategy") + 1] == c["strategy"]
        assert "--enable-metrics" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert ("--disable-overlap-schedule" in cmd) == (c["options"]["overlap"] == "off")  # the overlap axis
        assert c["strategy"] != "no_buffer" or c["options"]["overlap"] == "off"
        if c["fault"] == "lazy_alloc_fail":
            assert c["env"]["SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL"] == "1"
            assert "lazy_alloc_fail" in c["markers"]
        tp = int(cmd[cmd.index("--tp-size") + 1])
        assert len(c["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == tp
    pairs = {(c["family"], c["strategy"]) for c in cells}
    assert len(pairs) == 12
    ports = [c["command"][c["command"].index("--port") + 1] for c in cells]
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize(
    "args,needle",
    [
        (("plan", "--strategies", "bogus"), "--strategies: unknown value 'bogus'; allowed: no_buffer, extra_buffer, extra_buffer_lazy"),
        (("plan", "--models", "llama-7b"), "--models: unknown value 'llama-7b'"),
        (("plan", "--target", "gpu"), "argument --target: invalid choice: 'gpu'"),
        (("plan", "--matrix", "/nonexistent.toml"), "/nonexistent.toml: matrix file not found"),
        (("run", "--suite", "speed"), "--suite: unknown value 'speed'"),
    ],
)
def test_bad_arguments_are_one_line(args: tuple[str, ...], needle: str) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_run_builds_pytest_arguments(tmp_path: Path) -> None:
    args = build_parser().parse_args(["run", "--tier", "premerge", "-m", "lazy_alloc_fail", "-n", "2", "--report-dir", str(tmp_path)])
    argv = RunRequest.of(args).pytest_argv()
    assert any(a.endswith("/conformance/suites/kl") for a in argv)
    assert f"--target={DEFAULT_TARGET}" in argv and "--tier=premerge" in argv
    assert argv[argv.index("-m") + 1] == "(lazy_alloc_fail) and (not pool)"
    assert argv[argv.index("-n") + 1] == "2" and "loadgroup" in argv
    assert f"--junitxml={tmp_path / 'junit.xml'}" in argv


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```")[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert blocks[0].startswith("bash ci/setup-cpu.sh && ") and blocks[0].endswith("hybrid-conformance run")
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1] in ci.splitlines()


def test_plan_validate_runs_sglangs_parser_on_server_and_pd_commands() -> None:
    pytest.importorskip("sglang", reason="sglang is not installed: run ci/setup-cpu.sh")
    out = run_cli("plan", "--target", "sglang", "--validate", "--format", "json", "--models", "falcon-h1", "--strategies", "no_buffer,extra_buffer_lazy", "--faults", "none")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["strategy"]: r for r in json.loads(out.stdout)["cells"]}
    assert rows["no_buffer"]["validation"] == "ok"
    assert set(rows["no_buffer"]["pd"]) == {"prefill", "decode", "router"}
    assert rows["no_buffer"]["pd"]["prefill"] == "ok" and rows["no_buffer"]["pd"]["decode"] == "ok"
    assert "extra_buffer_lazy is refused under PD" in rows["extra_buffer_lazy"]["pd"]


def test_serve_takes_its_options_and_help_as_documented() -> None:
    out = run_cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: hybrid-conformance serve") and "--model" in out.stdout and "--strategy" in out.stdout
    bad = run_cli("serve", "--model", "tiny-qwen3-next", "--strategy", "bogus", "--port", "0")
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "unknown strategy 'bogus'" in lines[0], bad.stderr


def test_preflight_subcommand_prints_one_line_per_need() -> None:
    out = run_cli("preflight", "--tier", "premerge", "--suite", "kl")
    assert out.returncode == 0, out.stderr
    names = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("preflight ")]
    assert names == ["selection", "gpus", "sglang", "plugins", "launch", "gsm8k", "twins", "ports"]
    assert "gsm8k     ok   not needed" in out.stdout
