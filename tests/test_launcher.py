"""Launcher lifecycle with real child processes: healthy start, early exit, timeout,
SIGTERM-ignoring servers, and zero orphans after SIGINT/SIGTERM/crash of the parent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conformance.errors import ServerStartError
from conformance.targets.launcher import ServerProcess, free_port

STANDIN = Path(__file__).parent / "standins" / "server.py"


def standin(tmp_path: Path, mode: str, *extra: str, timeout: float = 20.0) -> ServerProcess:
    port = free_port()
    return ServerProcess(
        name=f"standin-{mode}",
        argv=[sys.executable, str(STANDIN), "--port", str(port), "--mode", mode, *extra],
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path / f"{mode}.log",
        start_timeout_s=timeout,
        stop_timeout_s=2.0,
    )


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def child_pids_from_log(log: Path) -> list[int]:
    pids = []
    for line in log.read_text().splitlines():
        for word in line.split():
            if word.startswith("pid="):
                pids.append(int(word[4:]))
    return pids


def test_healthy_start_and_stop(tmp_path: Path) -> None:
    sp = standin(tmp_path, "healthy", "--spawn-child")
    with sp:
        assert sp.alive()
        assert sp.exit_reason() is None
        time.sleep(0.3)
        pids = child_pids_from_log(sp.log_path)
    assert len(pids) == 2, pids  # the server and its grandchild
    assert all(gone(p) for p in pids)
    assert not sp.alive()


def test_exit_at_start_reports_code_and_log_tail(tmp_path: Path) -> None:
    sp = standin(tmp_path, "exit")
    with pytest.raises(ServerStartError) as err:
        sp.start()
    msg = str(err.value)
    assert "exited during start-up with code 3" in msg
    assert "fatal: stand-in refuses to start" in msg
    assert "\n" not in msg  # one line


def test_never_healthy_times_out(tmp_path: Path) -> None:
    sp = standin(tmp_path, "never", timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"not healthy at .* within 2s"):
        sp.start()
    assert time.monotonic() - t0 < 15
    pid = child_pids_from_log(sp.log_path)[0]
    assert gone(pid), "a server that never became healthy must be killed"


def test_sigterm_ignoring_server_is_killed(tmp_path: Path) -> None:
    sp = standin(tmp_path, "ignore-term")
    sp.start()
    pid = sp.proc.pid
    code = sp.stop()
    assert code == -signal.SIGKILL
    assert gone(pid)


_RUNNER = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from conformance.targets.launcher import ServerProcess, free_port, install_signal_handlers

    def test_hold_servers(tmp_path):
        install_signal_handlers()
        pids = []
        for mode in ("healthy", "ignore-term"):
            port = free_port()
            sp = ServerProcess(name=mode, argv=[sys.executable, {standin!r}, "--port", str(port), "--mode", mode, "--spawn-child"],
                               health_url=f"http://127.0.0.1:{{port}}/health", log_path=tmp_path / f"{{mode}}.log", stop_timeout_s=2.0)
            sp.start()
            time.sleep(0.3)
            for line in sp.log_path.read_text().splitlines():
                pids += [int(w[4:]) for w in line.split() if w.startswith("pid=")]
        Path({pidfile!r}).write_text(json.dumps(pids))
        time.sleep(120)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "crash"])
def test_zero_orphans_when_pytest_is_interrupted(tmp_path: Path, sig: signal.Signals) -> None:
    """Start servers from a real pytest process, signal it, and count survivors."""
    pidfile = tmp_path / "pids.json"
    test_file = tmp_path / "test_hold.py"
    test_file.write_text(_RUNNER.format(tests=str(Path(__file__).parent), standin=str(STANDIN), pidfile=str(pidfile)))
    if sig == signal.SIGKILL:
        # A crashed (SIGKILLed) worker runs no cleanup: only PR_SET_PDEATHSIG saves us,
        # and it reaches the direct child; so this variant starts no ignore-term server.
        test_file.write_text(test_file.read_text().replace('("healthy", "ignore-term")', '("healthy",)').replace(', "--spawn-child"', ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)
        assert pidfile.exists(), "servers did not start"
        pids = json.loads(pidfile.read_text())
        assert all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        survivors = [p for p in pids if not gone(p, within=15)]
        assert survivors == [], f"orphans after {sig.name}: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
