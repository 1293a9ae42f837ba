"""Zero orphans on every launch path (Popen, the preloaded forkserver, the pre-imported
launcher of real-SGLang servers), however the run ends: SIGINT, SIGTERM, an interpreter exiting with a live server, kill -9 of an xdist
worker. Each variant starts real servers from a real process, ends it, and counts every
process it started that is still alive (the servers, their grandchildren, the forkserver)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).parent
STANDIN = TESTS / "standins" / "server.py"

_HOLD = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from conformance.targets import launcher
    from conformance.targets.launcher import ServerProcess, free_port, install_signal_handlers

    def start(path, tmp):
        pids, servers = [], []
        modes = ("healthy", "ignore-term") if path != "forkserver" else ("healthy",)
        for mode in modes:
            port = free_port()
            args = ["--port", str(port), "--mode", mode] + (["--spawn-child"] if path != "forkserver" else [])
            argv = [sys.executable, {standin!r}, *args]
            kw = dict(entry="standins.server:entry", entry_argv=args) if path == "forkserver" else {{}}
            if path == "preimported":
                tests = {{"PYTHONPATH": {tests!r}}}
                argv = [sys.executable, "-m", "standins.server", *args]
                kw = dict(preimport_env=tests, env=tests, preload=("standins.server",))
            sp = ServerProcess(name=mode, argv=argv, health_url=f"http://127.0.0.1:{{port}}/health",
                               log_path=Path(tmp) / f"{{mode}}.log", stop_timeout_s=2.0, **kw)
            sp.start()
            servers.append(sp)
            time.sleep(0.3)
            for line in sp.log_path.read_text().splitlines():
                pids += [int(w[4:]) for w in line.split() if w.startswith("pid=")]
        if path == "forkserver":
            from multiprocessing import forkserver
            pids.append(forkserver._forkserver._forkserver_pid)
        if path == "preimported":
            from conformance.targets import preimport
            assert {{sp.launch for sp in servers}} == {{"pre-imported"}}, [sp.log_text() for sp in servers]
            pids += [z.proc.pid for z in preimport._ZYGOTES.values()]
        pids.append(launcher._Reaper.pid())
        Path({pidfile!r}).write_text(json.dumps({{"pids": pids, "me": os.getpid()}}))
        return servers

    def test_hold_servers(tmp_path):
        install_signal_handlers()
        start({path!r}, tmp_path)
        time.sleep(120)

    if __name__ == "__main__":  # exit-live: the interpreter ends with the servers still up
        import tempfile
        servers = start({path!r}, tempfile.mkdtemp())
        go = Path({pidfile!r} + ".go")
        for _ in range(600):
            if go.exists():
                break
            time.sleep(0.1)
        sys.exit(0)
    """
)


def gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _wait_for(pidfile: Path, proc: subprocess.Popen, within: float = 90.0) -> dict:
    deadline = time.monotonic() + within
    while not pidfile.exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.2)
    assert pidfile.exists(), "servers did not start"
    time.sleep(0.2)
    return json.loads(pidfile.read_text())


def _kill_tree(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize("path", ["popen", "forkserver", "preimported"])
@pytest.mark.parametrize("ending", ["sigint", "sigterm", "exit-live", "kill9-xdist-worker"])
def test_zero_orphans(tmp_path: Path, path: str, ending: str) -> None:
    pidfile = tmp_path / "pids.json"
    script = tmp_path / "test_hold.py"
    script.write_text(_HOLD.format(tests=str(TESTS), standin=str(STANDIN), pidfile=str(pidfile), path=path))
    if ending == "exit-live":
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(script)]
        if ending == "kill9-xdist-worker":
            argv += ["-n", "1"]
    # SIGINT at its default, as a user's shell starts pytest: a child inherits an ignored SIGINT from its
    # parent, and a long xdist worker was seen handing one on (Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    try:
        info = _wait_for(pidfile, proc)
        pids = info["pids"]
        assert pids and all(psutil.pid_exists(p) for p in pids)
        if ending == "sigint":
            proc.send_signal(signal.SIGINT)
        elif ending == "sigterm":
            proc.send_signal(signal.SIGTERM)
        elif ending == "exit-live":
            Path(str(pidfile) + ".go").write_text("")
        elif ending == "kill9-xdist-worker":
            assert info["me"] != proc.pid
            psutil.Process(info["me"]).kill()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {'interpreter' if ending == 'exit-live' else 'pytest process'} hung at exit with servers alive ({path} path)")
        survivors = [p for p in pids if not gone(p)]
        assert survivors == [], f"orphans after {ending} on the {path} path: {survivors}"
    finally:
        _kill_tree(proc, pids)


_UNTOLD = textwrap.dedent(
    """
    import json, sys, threading, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from multiprocessing import forkserver
    from conformance.targets import launcher
    from conformance.targets.launcher import ServerProcess, free_port

    told = launcher._Reaper.tell

    def slow_tell(kind, ident, **kw):  # the parent stalls between the fork and telling the reaper of the server
        if kind == "group" and not kw.get("forget"):
            Path({pidfile!r}).write_text(json.dumps({{"server": ident, "forkserver": forkserver._forkserver._forkserver_pid}}))
            time.sleep(120)
        return told(kind, ident, **kw)

    if __name__ == "__main__":
        launcher._Reaper.tell = slow_tell
        port = free_port()
        args = ["--port", str(port), "--mode", "healthy"]
        sp = ServerProcess(name="untold", argv=[sys.executable, {standin!r}, *args], health_url=f"http://127.0.0.1:{{port}}/health",
                           log_path=Path({tmp!r}) / "untold.log", entry="standins.server:entry", entry_argv=args, stop_timeout_s=2.0)
        sp.start()
    """
)


def test_kill9_between_the_fork_and_telling_the_reaper_leaves_nothing(tmp_path: Path) -> None:
    """The parent dies (kill -9) after the forkserver forked its server but before the
    parent told its reaper of that server: the forkserver was told first, so the reaper
    ends it and the server (whose parent-death signal follows the forkserver) ends too."""
    pidfile = tmp_path / "pids.json"
    script = tmp_path / "untold.py"
    script.write_text(_UNTOLD.format(tests=str(TESTS), standin=str(STANDIN), pidfile=str(pidfile), tmp=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        info = _wait_for(pidfile, proc)
        assert psutil.pid_exists(info["server"]) and psutil.pid_exists(info["forkserver"])
        proc.kill()
        proc.wait(timeout=30)
        survivors = [p for p in (info["server"], info["forkserver"]) if not gone(p)]
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or ())]
        left = [p for p in left if not gone(p)]
        assert survivors == [] and left == [], f"left after kill -9 before the reaper was told: {survivors or left}"
    finally:
        if proc.poll() is None:
            proc.kill()
