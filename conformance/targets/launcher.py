"""Start a server process, wait until it is healthy, and tear down its whole process group.

Used for every server the kit starts (SGLang, the embedded reference server, the
PD router). Lifecycle rules:

* the child runs in its own session / process group, stdout+stderr to a log file;
* start-up polls a health URL with a deadline and tells "exited during start-up"
  (exit code + log tail) apart from "not healthy in time";
* ``entry="module:function"`` starts the child from a ``multiprocessing`` forkserver
  that has already imported the heavy modules (``preload``): the same server code,
  without paying torch/transformers imports once per cell;
* teardown sends SIGTERM to the group, waits, then SIGKILLs the group — and every
  live server is also torn down from an ``atexit`` hook and from SIGTERM/SIGHUP
  handlers, so a Ctrl-C, a SIGTERM to pytest or a crashed xdist worker leaves no
  orphans (children additionally get ``PR_SET_PDEATHSIG`` on Linux);
* a process that is killed outright (``kill -9`` of an xdist worker) runs none of that:
  every server's process group, and the forkserver, are registered with a reaper
  process (``conformance.targets.reaper``) that kills them when its parent is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import multiprocessing
import multiprocessing.util  # registers its exit handler now, so ours (registered later) runs first
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx

from conformance.errors import PortTakenError, ServerStartError
from conformance.server_log import last_crash
from conformance.targets import preimport
from conformance.targets.reaper_client import Reaper as _Reaper

_LIVE: "set[ServerProcess]" = set()
#: What names a start-up failure in a server log, most specific first.
_CAUSE_PATTERNS = (
    re.compile(r"hybrid-conformance sglang-cpu: .*"),
    re.compile(r"plugin hybrid_conformance_\w+ .*fail|Failed to (?:execute|load) (?:general )?plugin", re.I),
    re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): "),
)
#: Exception lines that only point elsewhere (SGLang's launcher after a child failed): the
#: cause is the exception before them.  An import error SGLang logs and survives (an
#: optional package of an older release) is not the cause when a later exception follows.
_POINTERS = re.compile(r"see the error messages above|scheduler (?:process )?(?:\d+ )?(?:is dead|died|exited)|"
                       r"Rank \d+ scheduler is dead", re.I)
_LIVE_LOCK = threading.Lock()
#: Background stops under way (:meth:`ServerProcess.stop_soon`), joined by :func:`stop_all`.
_STOPPING: "set[threading.Thread]" = set()
#: How long :func:`stop_all` waits for one background stop (its grace plus the SIGKILL wait).
STOP_JOIN_S = 60.0
#: The server could not bind its port (uvicorn's line; SGLang then hangs in shutdown).
_PORT_TAKEN = re.compile(r"\[Errno 98\]|address already in use", re.I)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    """Ask Linux to SIGTERM the child when its parent dies (crashed xdist worker)."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServerProcess:
    """One child server: ``start()`` returns once healthy; ``stop()`` kills its group."""

    name: str
    argv: Sequence[str]
    health_url: str
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0
    term_grace_s: float = 10.0  # the wait after SIGTERM, before the group is SIGKILLed
    poll_s: float = 0.25
    entry: str | None = None
    entry_argv: Sequence[str] = ()
    preload: Sequence[str] = ()
    #: the target's own environment when the server may be forked from a pre-imported
    #: launcher (``conformance.targets.preimport``); None: always a plain process
    preimport_env: Mapping[str, str] | None = None
    proc: "subprocess.Popen | _ForkedChild | preimport.ForkedServer | None" = None
    #: how it was started: "plain", "pre-imported" or "forkserver"
    launch: str = field(default="", init=False)
    returncode: int | None = None
    _log_start: int = field(default=0, init=False, repr=False)  # where this start's part of the log begins

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {**os.environ, **self.env}
        if self.entry:
            self.proc = _ForkedChild.start(self.entry, list(self.entry_argv), env, self.log_path, self.preload)
            self.launch = "forkserver"
        elif self.preimport_env is not None and self._start_preimported(env):
            self.launch = "pre-imported"
        else:
            self.launch = "plain"
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    list(self.argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
                    start_new_session=not sys.platform.startswith("linux"),
                )
            except OSError as e:
                raise ServerStartError(f"{self.name}: cannot execute {self.argv[0]!r}: {e.strerror}") from None
            finally:
                log.close()
        with _LIVE_LOCK:
            _LIVE.add(self)
        _Reaper.tell("group", self.proc.pid)  # the child's own session: its pid is its group
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_preimported(self, env: Mapping[str, str]) -> bool:
        """Fork the server from its pre-imported launcher; False (and one line saying why,
        also in the server's log) when that cannot serve it."""
        forked = preimport.spawn(self.argv, self.preimport_env or {}, env, self.log_path, tuple(self.preload) or preimport.SGLANG_PRELOAD)
        if isinstance(forked, preimport.PlainLaunch):
            preimport.say_plain_once(forked)
            with open(self.log_path, "a") as log:
                log.write(f"hybrid-conformance: plain launch: {forked.reason}\n")
            return False
        self.proc = forked
        return True

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                code = self.proc.poll() if self.proc else None
                if code is not None:
                    self.returncode = code
                    self._raise_if_port_taken()  # a bind that failed and exited (SGLang's gRPC server) is a taken port too
                    raise ServerStartError(
                        f"{self.name}: exited during start-up with code {code}: {self.start_failure_cause()} (log {self.log_path})"
                    )
                try:
                    if http.get(self.health_url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                self._raise_if_port_taken()
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name}: not healthy at {self.health_url} within {self.start_timeout_s:.0f}s; log {self.log_path}: {self.log_tail(5, joiner=' | ')}"
                    )
                time.sleep(self.poll_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server process's pid (a forked server's own, not the launcher's), None before start."""
        return self.proc.pid if self.proc is not None else None

    def exit_reason(self) -> str | None:
        """None while running; otherwise a short phrase with the exit code, the log's last
        traceback (``conformance.server_log``: which exception, raised where) and its tail."""
        if self.proc is None:
            return "never started"
        code = self.proc.poll()
        if code is None:
            return None
        self.returncode = code
        crash = last_crash(self.log_text())
        cause = f"{crash.describe()}; " if crash else ""
        return f"server process exited with code {code}; {cause}log tail: {self.log_tail(3, joiner=' | ')}"

    def stop(self) -> int | None:
        """SIGTERM the process group, wait, then SIGKILL it. Idempotent."""
        proc = self.proc
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is None:
            return self.returncode
        forget = proc.pid
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.term_grace_s)
            except subprocess.TimeoutExpired:
                pass
            # Kill the rest of the group (grandchildren, or a child ignoring SIGTERM).
            _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
            pass
        if self.returncode is None:
            self.returncode = proc.returncode
        _Reaper.tell("group", forget, forget=True)
        return self.returncode

    def stop_soon(self) -> None:
        """:meth:`stop` in a background thread, so the caller's next server starts while this
        one winds down (SIGTERM, its grace, SIGKILL); :func:`stop_all` waits for it."""
        thread = threading.Thread(target=self._stop_then_forget, name=f"stop {self.name}", daemon=True)
        with _LIVE_LOCK:
            _STOPPING.add(thread)
        thread.start()

    def _stop_then_forget(self) -> None:
        try:
            self.stop()
        finally:
            with _LIVE_LOCK:
                _STOPPING.discard(threading.current_thread())

    def _raise_if_port_taken(self) -> None:
        """Raise :class:`PortTakenError` when this start's log says its port is in use. A
        server that wrote so is on its way out: it gets its stop grace to exit by itself, so
        its own exit code (not the kit's SIGTERM) is what the caller reads."""
        taken = self._port_taken()
        if not taken:
            return
        if self.proc is not None and self.returncode is None:
            try:
                self.returncode = self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        raise PortTakenError(f"{self.name}: its port was taken by another process before it bound it: {taken} (log {self.log_path})")

    def _port_taken(self) -> str:
        """The log line of this start saying the port is in use ('' if none)."""
        return next((ln.strip()[:300] for ln in self.log_text().splitlines() if _PORT_TAKEN.search(ln)), "")

    def log_text(self) -> str:
        """What this start of the server wrote (a restarted server appends to the same file:
        an earlier start's crash is not this one's)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def start_failure_cause(self) -> str:
        """The log line that names why start-up failed: the kit's own stand-in messages
        first (an op the plugin lacks), then the last exception line that is not a mere
        pointer to an earlier one (:data:`_POINTERS`), else the log's tail."""
        lines = [ln.strip() for ln in self.log_text().splitlines() if ln.strip()]
        for pattern in _CAUSE_PATTERNS:
            hits = [ln for ln in lines if pattern.search(ln)]
            if hits:
                specific = [ln for ln in hits if not _POINTERS.search(ln)]
                return (specific or hits)[-1][:400]
        return " | ".join(lines[-3:])[:400] if lines else "(empty log)"

    def log_tail(self, n: int = 20, joiner: str = "\n") -> str:
        lines = [ln for ln in self.log_text().splitlines() if ln.strip()]
        return joiner.join(lines[-n:]) if lines else "(empty log)"

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __hash__(self) -> int:
        return id(self)


class _ForkedChild:
    """A server forked from the kit's forkserver; quacks like ``subprocess.Popen``."""

    _ctx: Any = None

    def __init__(self, process: Any) -> None:
        self._p = process
        self.pid = process.pid

    @classmethod
    def start(cls, entry: str, argv: list[str], env: dict[str, str], log_path: Path, preload: Sequence[str]) -> "_ForkedChild":
        if cls._ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(preload))
            cls._ctx = ctx
        from multiprocessing import forkserver

        # The forkserver is started, and told to the reaper, before the first request: a
        # parent killed while the forkserver still preloads would otherwise leave a server
        # it forks later, which nobody was told of (the forkserver lives as long as it).
        forkserver.ensure_running()
        cls.register_forkserver()
        p = cls._ctx.Process(target=_forked_main, args=(entry, argv, env, str(log_path)), daemon=False)
        p.start()
        return cls(p)

    @classmethod
    def register_forkserver(cls) -> None:
        """Tell the reaper the forkserver's pid (it outlives a SIGKILLed parent otherwise)."""
        from multiprocessing import forkserver

        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # no public accessor
        if pid and pid != _Reaper.told_forkserver:
            _Reaper.told_forkserver = pid
            _Reaper.tell("pid", pid)

    def poll(self) -> int | None:
        return None if self._p.is_alive() else self._p.exitcode

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.is_alive():
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self._p.exitcode


def _forked_main(entry: str, argv: list[str], env: dict[str, str], log_path: str) -> None:  # pragma: no cover - child
    """In the forked child: own session, parent-death signal, log file, env, then the entry."""
    _set_pdeathsig()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    module, func = entry.split(":")
    code = 1
    try:
        code = int(getattr(importlib.import_module(module), func)(argv) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all() -> int:
    """Tear down every live server, and wait for the stops under way in the background
    (:meth:`ServerProcess.stop_soon`); returns how many live servers were stopped."""
    with _LIVE_LOCK:
        live = list(_LIVE)
        stopping = list(_STOPPING)
    for sp in live:
        sp.stop()
    for t in stopping:
        t.join(timeout=STOP_JOIN_S)
    return len(live)


def live_servers() -> list[ServerProcess]:
    with _LIVE_LOCK:
        return list(_LIVE)


_PREVIOUS: dict[int, object] = {}
_TERMINATING: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    stop_all()
    prev = _PREVIOUS.get(signum)
    if callable(prev):
        prev(signum, frame)  # type: ignore[misc]
    elif prev == signal.SIG_IGN:
        return
    elif signum == signal.SIGTERM and not _TERMINATING and threading.current_thread() is threading.main_thread():
        # The first SIGTERM unwinds like Ctrl-C, so pytest still writes an (incomplete)
        # report; a second one takes the default action.
        _TERMINATING.append(signum)
        raise KeyboardInterrupt("SIGTERM")
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def install_signal_handlers() -> None:
    """Make SIGTERM/SIGHUP tear down live servers before the default action.

    SIGINT is left to Python (KeyboardInterrupt unwinds through fixtures and the
    ``atexit`` hook), so pytest still reports an interrupted run; the first SIGTERM
    does the same after stopping the servers.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig in _PREVIOUS:
            continue
        try:
            _PREVIOUS[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # pragma: no cover
            pass


# atexit runs handlers last-registered first: this one must precede multiprocessing's, which
# joins every non-daemon child (our forked servers) and would wait forever for a live one.
atexit.register(stop_all)
