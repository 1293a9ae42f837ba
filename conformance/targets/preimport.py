"""Start real SGLang servers from a pre-imported process (``conformance.targets.zygote``).

One zygote per (Python, import environment): the environment a cell's server starts in,
minus the variables read only while a server runs (``LATE_ENV``: the seeded faults, the
lazy allocation-failure switch, the plugins' report path), so cells that differ only in
those share one.  The zygote imports SGLang's server stack once (about 7 s of the 17 s a
plain launch takes here) and forks each server with the cell's exact argv (the plain
command's arguments) and exact environment.  Where it cannot serve -- the zygote fails to
import, SGLang loads its plugins at import, the command is not ``python -m
sglang.launch_server`` -- :func:`spawn` returns the reason and the caller launches plainly,
saying so in one line.

Lifetime: the zygote runs in its own session and is registered with the kit's reaper; it
kills every server it forked when its stdin closes (the kit exited, even by ``kill -9``);
each forked server has a parent-death signal on the zygote and its own process group,
which the launcher stops and registers exactly as a plain server's.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping, Sequence

from conformance.errors import KitError
from conformance.matrix.faults import FAULT_SWITCHES
from conformance.sglang_plugins.activation import REPORT_ENV
from conformance.targets.reaper_client import pid_exists, register_with_reaper

#: Read by SGLang or the kit only when a server runs, never while importing: a zygote
#: imported without them serves every value.
LATE_ENV = frozenset((*FAULT_SWITCHES, REPORT_ENV))
#: What a real-SGLang zygote imports: SGLang's server entry points and the kit's plugins.
SGLANG_PRELOAD = (
    "sglang.srt.server_args",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server",
    "conformance.sglang_plugins.general",
)
#: How real-SGLang servers start: ``preimported-fork`` (the default: forked from the zygote,
#: SGLang's children forked from that server too; a release without SGLang's hook registry
#: spawns them), ``preimported`` (forked from the zygote; SGLang spawns its children as in a
#: plain launch) or ``plain`` (``python -m sglang.launch_server``).  The default halves a
#: cell's start (bench/bench_startup.py, bench/bench_phases.py --launch; docs/perf.md).
LAUNCH_ENV = "HYBRID_CONFORMANCE_LAUNCH"
LAUNCH_MODES = ("preimported", "preimported-fork", "plain")
DEFAULT_MODE = "preimported-fork"
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
#: How many zygotes with no live server are kept when another import environment needs a
#: new one (each holds SGLang's imported server stack, ~0.7 GB: a run over cells with
#: several environments -- the lazy fault, the page-size interpreter, a cold twin's -- kept
#: them all and ran a 24 GiB machine out of memory with three runs side by side).
IDLE_KEEP_ENV = "HYBRID_CONFORMANCE_ZYGOTES_IDLE"
DEFAULT_IDLE_KEEP = 1


class ZygoteError(RuntimeError):
    """The zygote cannot serve (the message says why, in one line)."""


@dataclass
class Zygote:
    """One pre-imported launcher process and the pipe to it."""

    python: str
    env: dict[str, str]
    log_path: Path
    preload: tuple[str, ...] = SGLANG_PRELOAD
    proc: "subprocess.Popen[str] | None" = None
    unavailable: str = ""
    import_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _seq: int = 0
    #: the servers it forked (pids) and when it last forked one
    children: set[int] = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)

    def idle(self) -> bool:
        """No server it forked is still running (a zombie it has not reaped counts as gone)."""
        return not any(_exists(pid) for pid in self.children)

    def start(self) -> "Zygote":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "conformance.targets.zygote", *self.preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, env=self.env, text=True, start_new_session=True,
            )
        register_with_reaper("group", self.proc.pid)
        self._answers: "queue.Queue[dict | None]" = queue.Queue()
        threading.Thread(target=self._read_answers, args=(self.proc.stdout,), name="zygote answers", daemon=True).start()
        try:
            answer = self._next(READY_TIMEOUT_S)
        except ZygoteError as e:
            self.unavailable = str(e)
            self.stop()
            return self
        if "ready" in answer:
            self.import_s = float(answer["ready"].get("import_s", 0.0))
        else:
            self.unavailable = str(answer.get("unavailable") or answer.get("error") or answer)
            self.stop()
        return self

    def _read_answers(self, stream: IO[str]) -> None:
        """The one reader of the zygote's answers (None at end of output)."""
        try:
            for line in stream:
                if line.strip():
                    self._answers.put(json.loads(line))
        except (OSError, ValueError):
            pass
        self._answers.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise ZygoteError(f"the pre-imported launcher did not answer within {timeout:.0f}s (log {self.log_path})") from None
        if answer is None:
            self._answers.put(None)  # every later question sees the end too
            code = self.proc.poll() if self.proc else None
            raise ZygoteError(f"the pre-imported launcher exited (code {code}); log {self.log_path}")
        return answer

    def ask(self, request: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        """One question, one answer (matched by id: an answer that came after its question
        timed out is dropped, never taken for the next one's)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                raise ZygoteError(f"the pre-imported launcher is gone (log {self.log_path})")
            self._seq += 1
            ident = self._seq
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({**request, "id": ident}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise ZygoteError(f"the pre-imported launcher is gone: {e} (log {self.log_path})") from None
            deadline = time.monotonic() + timeout
            while True:
                answer = self._next(max(0.0, deadline - time.monotonic()))
                if answer.get("id") == ident:
                    break
        if "error" in answer:
            raise ZygoteError(f"the pre-imported launcher refused: {answer['error']}")
        return answer

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        register_with_reaper("group", proc.pid, forget=True)


class ForkedServer:
    """A server the zygote forked; quacks like ``subprocess.Popen`` for the launcher."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = self.zygote.ask({"op": "poll", "pid": self.pid})["code"]
        except ZygoteError:  # the zygote is gone: it killed its servers on the way out
            self.returncode = None if _exists(self.pid) else -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]


def _exists(pid: int) -> bool:
    if not pid_exists(pid):
        return False
    try:  # a zombie whose parent (the zygote) has not reaped it yet counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


_ZYGOTES: dict[tuple, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()
_SAID: set[str] = set()


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a server's environment its zygote must import under."""
    return {k: v for k, v in env.items() if k not in LATE_ENV}


def mode() -> str:
    value = os.environ.get(LAUNCH_ENV) or DEFAULT_MODE
    if value not in LAUNCH_MODES:
        raise KitError(f"{LAUNCH_ENV}={value!r}: not one of {', '.join(LAUNCH_MODES)}")
    return value


def enabled() -> bool:
    return mode() != "plain"


def zygote_for(python: str, spec_env: Mapping[str, str], log_dir: Path, preload: tuple[str, ...] = SGLANG_PRELOAD) -> Zygote:
    """The zygote for this Python, import environment and preload (started on first use)."""
    fixed = import_env(spec_env)
    key = (python, preload, tuple(sorted(fixed.items())))
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None:
            _retire_idle(keep=idle_keep())
            env = {**import_env(os.environ), **fixed}
            zygote = _ZYGOTES[key] = Zygote(python, env, Path(log_dir) / f"zygote-{len(_ZYGOTES)}.log", preload)
            zygote.start()
        return zygote


def idle_keep() -> int:
    value = os.environ.get(IDLE_KEEP_ENV, "")
    if not value:
        return DEFAULT_IDLE_KEEP
    if not value.isdigit():
        raise KitError(f"{IDLE_KEEP_ENV}={value!r}: not a count of zygotes (0, 1, 2, ...)")
    return int(value)


def _retire_idle(*, keep: int) -> None:
    """Stop the zygotes that have no live server, all but the ``keep`` most recently used
    (caller holds ``_ZYGOTES_LOCK``); a later cell of their environment starts a new one."""
    idle = sorted(((k, z) for k, z in _ZYGOTES.items() if z.idle()), key=lambda kz: kz[1].last_used, reverse=True)
    for key, zygote in idle[keep:]:
        del _ZYGOTES[key]
        zygote.stop()


@dataclass(frozen=True)
class PlainLaunch:
    """Why a server starts as the plain command instead; ``chosen`` when the user asked for it."""

    reason: str
    chosen: bool = False


def spawn(argv: Sequence[str], spec_env: Mapping[str, str], env: Mapping[str, str], log_path: Path,
          preload: tuple[str, ...] = SGLANG_PRELOAD) -> "ForkedServer | PlainLaunch":
    """Fork ``argv`` (a plain ``python -m <module> ...`` command: SGLang's
    ``sglang.launch_server``) from its zygote with ``env``; or why it cannot be, for a
    plain launch instead."""
    if not enabled():
        return PlainLaunch(f"{LAUNCH_ENV}=plain", chosen=True)
    if len(argv) < 3 or argv[1] != "-m":
        return PlainLaunch(f"not a 'python -m <module>' command: {' '.join(argv[:3])}")
    try:
        zygote = zygote_for(argv[0], spec_env, log_path.parent, preload)
        if zygote.unavailable:
            return PlainLaunch(zygote.unavailable)
        request = {"op": "start", "module": argv[2], "argv": list(argv[3:]), "env": dict(env), "log": str(log_path), "cwd": os.getcwd(),
                   "fork_children": mode() == "preimported-fork"}
        pid = int(zygote.ask(request)["pid"])
    except ZygoteError as e:
        return PlainLaunch(str(e))
    zygote.children.add(pid)
    zygote.last_used = time.monotonic()
    return ForkedServer(zygote, pid)


def say_plain_once(plain: PlainLaunch, out: IO[str] | None = None) -> None:
    """The one line saying why servers start plainly (once per reason and process; nothing
    when the plain launch was asked for)."""
    if plain.chosen or plain.reason in _SAID:
        return
    _SAID.add(plain.reason)
    print(f"hybrid-conformance: pre-imported launch unavailable ({plain.reason}); plain launch", file=out or sys.stderr, flush=True)


def stop_all() -> None:
    with _ZYGOTES_LOCK:
        zygotes = list(_ZYGOTES.values())
        _ZYGOTES.clear()
    for zygote in zygotes:
        zygote.stop()


atexit.register(stop_all)
