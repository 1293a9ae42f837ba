"""Launcher lifecycle with real child processes: healthy start, early exit, timeout,
SIGTERM-ignoring servers (zero orphans on every ending: tests/test_process_hygiene.py)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from conformance.errors import PortTakenError, ServerStartError
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


BIND_FAILS_THEN_HANGS = (
    "print('ERROR:    [Errno 98] error while attempting to bind on address (\\'127.0.0.1\\', 1): address already in use', flush=True)\n"
    "import time; time.sleep(120)"
)


def test_a_server_that_exits_because_its_grpc_port_was_taken_is_a_taken_port(tmp_path: Path) -> None:
    """SGLang 0.5.16 binds a gRPC server beside its HTTP port and exits (code 3) when another
    process holds it: the serving layer must retry on a new port, not report a dead cell."""
    line = "RuntimeError: Failed to bind gRPC server to 127.0.0.1:45897: Address already in use (os error 98)"
    sp = ServerProcess(name="grpc", argv=[sys.executable, "-c", f"print({line!r}, flush=True); raise SystemExit(3)"],
                       health_url=f"http://127.0.0.1:{free_port()}/health", log_path=tmp_path / "grpc.log",
                       start_timeout_s=60.0, stop_timeout_s=2.0)
    with pytest.raises(PortTakenError, match="Failed to bind gRPC server"):
        sp.start()
    assert sp.returncode == 3


def test_a_taken_port_fails_at_once_not_at_the_deadline(tmp_path: Path) -> None:
    """SGLang's HTTP server that cannot bind its port logs uvicorn's line and hangs in
    shutdown: the launcher names it at once (the serving layer then retries on a new port)."""
    port = free_port()
    sp = ServerProcess(name="taken", argv=[sys.executable, "-c", BIND_FAILS_THEN_HANGS], health_url=f"http://127.0.0.1:{port}/health",
                       log_path=tmp_path / "taken.log", start_timeout_s=90.0, stop_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(PortTakenError, match=r"^taken: its port was taken by another process before it bound it: ERROR: +\[Errno 98\]"):
        sp.start()
    assert time.monotonic() - t0 < 30 and not sp.alive()
    # the line from that start, still in the log, does not fail the next start on the same log
    again = standin(tmp_path, "healthy")
    again.log_path.write_text((tmp_path / "taken.log").read_text())
    with again:
        assert again.alive()


def test_sigterm_ignoring_server_is_killed(tmp_path: Path) -> None:
    sp = standin(tmp_path, "ignore-term")
    sp.start()
    pid = sp.proc.pid
    code = sp.stop()
    assert code == -signal.SIGKILL
    assert gone(pid)


def test_a_background_stop_returns_at_once_and_stop_all_waits_for_it(tmp_path: Path) -> None:
    """``stop_soon`` (a cell's teardown) leaves the SIGTERM-ignoring server's grace to a
    thread; ``stop_all`` (the run's end) still leaves no process behind."""
    from conformance.targets import launcher

    sp = standin(tmp_path, "ignore-term")
    sp.term_grace_s = 1.5
    sp.start()
    pid = sp.proc.pid
    t0 = time.monotonic()
    sp.stop_soon()
    assert time.monotonic() - t0 < 0.5, "the caller waited for the stop"
    assert not gone(pid, within=0.3), "killed before its grace"
    launcher.stop_all()
    assert gone(pid, within=1.0) and sp.returncode == -signal.SIGKILL


def test_serve_cell_retries_a_taken_port_then_gives_up_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.targets import serving

    tries: list[int] = []

    def start(cell, options, log_dir, fail_times):
        tries.append(1)
        if len(tries) <= fail_times:
            raise PortTakenError(f"cell: its port was taken by another process before it bound it: try {len(tries)}")
        return ("spec", "proc", "name", tmp_path, tmp_path)

    monkeypatch.setattr(serving, "_yield_endpoint", lambda *a: iter(["endpoint"]))
    monkeypatch.setattr(serving, "_start_cell", lambda c, o, d: start(c, o, d, 2))
    with serving.serve_cell("cell", object(), log_dir=tmp_path) as ep:
        assert ep == "endpoint" and len(tries) == 3
    tries.clear()
    monkeypatch.setattr(serving, "_start_cell", lambda c, o, d: start(c, o, d, 99))
    with pytest.raises(PortTakenError, match="try 3$"):
        with serving.serve_cell("cell", object(), log_dir=tmp_path):
            pass
    assert len(tries) == serving.PORT_ATTEMPTS


def test_start_failure_cause_is_the_scheduler_exception_not_an_earlier_import_warning(tmp_path: Path) -> None:
    """An old release logs a survivable import error (openai_harmony) first; the scheduler's
    exception that stopped start-up comes later, then SGLang's pointer line: the cause is
    the scheduler's exception."""
    log = tmp_path / "cell.log"
    log.write_text("\n".join([
        "[2026-11-26 03:00:00] Ignore import error when loading sglang.srt.entrypoints.harmony: ",
        "ModuleNotFoundError: No module named 'openai_harmony'",
        "[2026-11-26 03:00:05] Scheduler hit an exception: Traceback (most recent call last):",
        "  File \"scheduler.py\", line 1, in run_scheduler_process",
        "AssertionError: mamba_track_interval must be a multiple of page_size",
        "Traceback (most recent call last):",
        "RuntimeError: Initialization failed. Please see the error messages above.",
    ]))
    sp = ServerProcess(name="x", argv=[sys.executable, "-c", "pass"], health_url="http://127.0.0.1:1/health", log_path=log)
    assert sp.start_failure_cause() == "AssertionError: mamba_track_interval must be a multiple of page_size"
    log.write_text("ModuleNotFoundError: No module named 'sgl_kernel'\nRuntimeError: Initialization failed. Please see the error messages above.\n")
    assert sp.start_failure_cause() == "ModuleNotFoundError: No module named 'sgl_kernel'"
