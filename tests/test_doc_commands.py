"""Every command in a fenced code block of README.md, docs/*.md and ci/README.md runs as
typed (``bash -c`` on the line, through the installed ``hybrid-conformance`` and
``pytest`` console scripts) and does what the docs say.

Long runs (``run``, ``mutants``, ``pytest -m``) go as typed with
``HYBRID_CONFORMANCE_PREFLIGHT_ONLY=1``: selection, preflight and collection happen for
real, then they stop before starting servers (the suites themselves run in CI's own
command). A GPU command on a machine without GPUs must be refused by preflight in at most
three stderr lines, naming ``--target sglang-cpu``. ``serve`` is started, asked for
``/health`` and stopped with SIGINT. Only the commands in ``EXEMPT`` are not run, each
with the reason; a new command in the docs is run automatically.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ci" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Absolute: CI passes a path relative to the repository, and these commands run elsewhere.
GSM8K = str(Path(os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR") or ROOT.parent / "shared" / "data" / "gsm8k").resolve())
REPORTS = Path(__file__).parent / "data" / "reports"
README_BLOCKS = [b.split("```")[0].strip() for b in (ROOT / "README.md").read_text().split("```bash\n")[1:3]]
EXEMPT = {
    "bash ci/setup-cpu.sh": "installs packages (CI's fresh machine runs it first)",
    README_BLOCKS[1]: "CI's own command: .ci/run runs exactly this line (tests/test_cli.py checks it)",
}
# Run as typed, with their documented exit status, by tests/test_release_range.py.
RELEASE_RANGE_TESTS = (ROOT / "tests" / "test_release_range.py").read_text()
# `history --bisect` lines: run as typed by tests/test_bisect.py (scheduled: release venvs, a replay per release).
BISECT_TESTS = (ROOT / "tests" / "test_bisect.py").read_text()
# `history --peer-kits` lines: run as typed by tests/test_peer_kits.py (scheduled: two servers per bug in release venvs).
PEER_TESTS = (ROOT / "tests" / "test_peer_kits.py").read_text()
SETUP = "bash ci/setup-cpu.sh && "


def doc_commands() -> list[tuple[str, str]]:
    """(where, command line) for every command line in a fenced block of the docs."""
    out = []
    for doc in DOCS:
        in_block = False
        pending = ""
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_block, pending = not in_block, ""
                continue
            if not in_block:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            if re.match(r"(hybrid-conformance|pytest|python3? -m|bash) ", text):
                out.append((f"{doc.relative_to(ROOT)}:{n}", text))
    return out


COMMANDS = doc_commands()
#: Commands run as typed only in the scheduled workflow (``pytest -m scheduled``), with why.
SCHEDULED_COMMANDS = {
    "hybrid-conformance known-bugs --target sglang-cpu": "replays every known bug in range on real SGLang, a server per entry",
}


def _words(command: str) -> list[str]:
    """The command's words without leading ``NAME=value`` assignments."""
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    return words


def _env(tmp_path: Path, preflight_only: bool) -> dict[str, str]:
    scripts = [p for p in {shutil.which("hybrid-conformance"), shutil.which("pytest")} if p]
    path = os.pathsep.join([*dict.fromkeys(str(Path(p).parent) for p in scripts), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "HYBRID_CONFORMANCE_GSM8K_DIR": GSM8K, "COLUMNS": "120"}
    env.pop("HYBRID_CONFORMANCE_PREFLIGHT_ONLY", None)
    if preflight_only:
        env["HYBRID_CONFORMANCE_PREFLIGHT_ONLY"] = "1"
    return env


def _no_gpu() -> bool:
    from conformance.targets.sglang import visible_gpus

    return not visible_gpus()[0]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_the_docs_have_commands_and_the_console_script_is_installed() -> None:
    assert shutil.which("hybrid-conformance"), "the hybrid-conformance console script is not on PATH: pip install -e ."
    words = {w for _, c in COMMANDS for w in _words(c)[:2]}
    assert {"run", "plan", "serve", "compare", "make-twins", "mutants", "preflight"} <= words
    assert set(EXEMPT) <= {c for _, c in COMMANDS}, "an exemption names a command the docs no longer have"
    assert set(SCHEDULED_COMMANDS) <= {c for _, c in COMMANDS}, "a scheduled command is one the docs no longer have"


@pytest.mark.parametrize("where,command", [
    pytest.param(w, c, id=w, marks=[pytest.mark.scheduled(reason=SCHEDULED_COMMANDS[c])] if c in SCHEDULED_COMMANDS else [])
    for w, c in COMMANDS])
def test_doc_command_runs_as_typed(where: str, command: str, tmp_path: Path) -> None:
    if command in EXEMPT:
        pytest.skip(f"not run here: {EXEMPT[command]}")
    line = command.removeprefix(SETUP)  # the install step of README's first command
    words = _words(line)
    if words[:2] == ["hybrid-conformance", "history"] and "--bisect" in words:
        assert f'DOC_COMMAND = "{line}"' in BISECT_TESTS, f"{where}: tests/test_bisect.py does not run {command} as typed"
        pytest.skip("run as typed by tests/test_bisect.py (scheduled: it replays the bug in each release's venv)")
    if words[:2] == ["hybrid-conformance", "history"] and "--peer-kits" in words:
        assert f'DOC_COMMAND = "{line}"' in PEER_TESTS, f"{where}: tests/test_peer_kits.py does not run {command} as typed"
        pytest.skip("run as typed by tests/test_peer_kits.py (scheduled: SGLang's kits on each bug's bad and good release)")
    if "tests/data/shards/" in line:  # the hand-built shards the history page names (merge, fill)
        shutil.copytree(ROOT / "tests" / "data" / "shards", tmp_path / "tests" / "data" / "shards")
    if words[:2] == ["hybrid-conformance", "history"] and "--merge" in words:  # hand-built shards: a FAIL each, so exit 1
        out = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=_env(tmp_path, False), capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "history --merge:" in out.stdout and "Traceback" not in out.stderr, f"{where}: {out.stdout}{out.stderr}"
        assert (tmp_path / words[words.index("--out") + 1] / "history.html").is_file()
        return
    if words[:2] == ["hybrid-conformance", "history"]:
        releases = words[words.index("--releases") + 1]
        assert f'"--releases", "{releases}"' in RELEASE_RANGE_TESTS, f"{where}: no release-range test runs {command}"
        pytest.skip("run as typed by tests/test_release_range.py (it needs PyPI venvs and exits 1 on a release that fails)")
    if words[:2] == ["hybrid-conformance", "serve"]:
        return _serve(line, tmp_path)
    if words[:2] == ["hybrid-conformance", "compare"]:
        for arg in words[2:4]:
            (tmp_path / arg).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPORTS / "clean" / "report.json", tmp_path / arg)
    # fuzz is a run of the programs suite (tests/test_programs_cli.py runs the docs' fuzz lines in full)
    long_run = words[0] == "pytest" or words[1:2] in (["run"], ["mutants"], ["fuzz"], ["perf-ab"])
    cwd = ROOT if words[0] == "pytest" or words[1:2] == ["replay"] else tmp_path  # replay names a file of the repository
    out = subprocess.run(["bash", "-c", line], cwd=cwd, env=_env(tmp_path, long_run), capture_output=True, text=True, timeout=900)
    text = f"{where}: {command}\nexit {out.returncode}\nstdout: {out.stdout[-3000:]}\nstderr: {out.stderr[-3000:]}"
    gpu_run = words[:2] == ["hybrid-conformance", "run"] and "--target" in words and words[words.index("--target") + 1] == "sglang"
    if gpu_run and _no_gpu():
        assert out.returncode == 3, text
        err = [ln for ln in out.stderr.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  warn")]
        assert 1 <= len(err) <= 3 and "--target sglang-cpu" in out.stderr and "Traceback" not in out.stderr, text
        return
    if words[1:2] == ["replay"] and "--no-recorded-env" not in words:  # a finding under its recorded fault: reproduced, exit 1
        assert out.returncode == 1 and re.search(r"\d+/\d+ runs failed", out.stdout) and "Traceback" not in out.stderr, text
        return
    assert out.returncode == 0, text
    assert "Traceback" not in out.stderr, text
    if long_run:
        assert "preflight only" in out.stdout + out.stderr, text
    if words[1:2] == ["plan"]:
        assert re.search(r"\"cells\"|\d+ cells", out.stdout), text
    if words[1:2] == ["compare"]:
        assert "no regression" in out.stdout, text


def _serve(line: str, tmp_path: Path) -> None:
    if "--port" not in line and not _port_free(30000):
        line += " --port 0"  # the documented default port is taken on this machine by someone else
    proc = subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=_env(tmp_path, False), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        url, seen = None, []
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            row = proc.stdout.readline()
            if not row and proc.poll() is not None:
                break
            seen.append(row)
            m = re.search(r"ready: (http://\S+)", row)
            url = m.group(1) if m else None
        assert url, f"`{line}` never printed its ready line: {''.join(seen)[-2000:]}"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
