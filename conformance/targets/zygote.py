"""The pre-imported launcher process: imports SGLang's server stack once, then forks one
``python -m sglang.launch_server`` per request, each with the cell's exact argv and env.

Run as ``python -m conformance.targets.zygote <module> ...`` by
``conformance.targets.preimport`` (never by hand), in the environment a cell's server
starts in minus the variables SGLang and the kit read only when a server runs (faults,
the plugin report path: ``preimport.LATE_ENV``).  Protocol, one JSON object per line:

* on start-up it writes ``{"ready": {"import_s": ..}}`` or ``{"unavailable": "<why>"}``;
* ``{"op": "start", "module": m, "argv": [..], "env": {..}, "log": path, "cwd": dir}``
  forks a server (its own session, parent-death signal, stdout+stderr appended to ``log``,
  ``os.environ`` replaced by ``env``, then ``python -m <m> <argv>`` run as ``__main__``:
  SGLang's ``sglang.launch_server``) and answers ``{"pid": n}``;
* ``{"op": "poll", "pid": n}`` answers ``{"code": null | int}`` (it reaps its children);
* every answer carries the question's ``id``;
* end of input (the kit exited, however) kills every server it forked and exits.

SGLang's own children (scheduler, detokenizer) are started by SGLang as it always does
(it forces the ``spawn`` start method); what the fork saves is the server process's own
imports.  Nothing of SGLang is changed: the forked process runs SGLang's launch module.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
import runpy
import signal
import sys
import time

_PR_SET_PDEATHSIG = 1


def _pdeathsig(sig: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # pragma: no cover - not Linux
        pass


def _unavailable() -> str:
    """Why the imported SGLang cannot be served from a pre-imported process ('' when it can)."""
    plugins = sys.modules.get("sglang.srt.plugins")
    if plugins is not None and getattr(plugins, "_plugins_loaded", False):
        # the forked servers would skip load_plugins(): the kit's plugins would never run
        return "SGLang ran load_plugins() while importing its server stack"
    return ""


#: SGLang's start-up step that forces ``spawn`` for its children (scheduler, detokenizer).
START_METHOD_TARGET = "sglang.srt.entrypoints.engine._set_envs_and_config"


def _fork_sglang_children(module: str) -> None:  # pragma: no cover - runs in the forked server
    """Have SGLang fork its own children from this pre-imported server instead of spawning
    fresh interpreters, through SGLang's hook registry (an AFTER hook on the step that sets
    the start method; applied by SGLang's own ``load_plugins()``).  A forked child inherits
    ``load_plugins()``'s done-flag; it is cleared in each child so that SGLang loads the
    plugins there as a spawned child would (the kit's plugins install their scheduler hooks
    only in the scheduler; SGLang's registry skips what the parent already patched).
    Only for SGLang's own server module; a release without the hook registry or the step
    keeps spawning its children, and the server's log says so in one line."""
    import multiprocessing

    if not module.startswith("sglang"):
        return
    target_module, _, target_name = START_METHOD_TARGET.rpartition(".")
    try:
        import sglang.srt.plugins as plugins
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        if not hasattr(importlib.import_module(target_module), target_name):
            raise ImportError(f"{START_METHOD_TARGET} is not in this release")
    except ImportError as e:
        print(f"hybrid-conformance: SGLang's children spawn as in a plain launch ({e})", file=sys.stderr, flush=True)
        return

    def use_fork(result, *args, **kwargs):  # noqa: ANN001, ANN202
        multiprocessing.set_start_method("fork", force=True)
        return result

    os.register_at_fork(after_in_child=lambda: setattr(plugins, "_plugins_loaded", False))
    HookRegistry.register(START_METHOD_TARGET, use_fork, HookType.AFTER)


def _serve_child(req: dict, proto_fds: tuple[int, ...]) -> None:  # pragma: no cover - the forked server
    """In the forked child: become the server SGLang's launcher would have started."""
    code = 1
    try:
        os.setsid()
        _pdeathsig(signal.SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in proto_fds:
            if fd != 0:
                os.close(fd)
        os.dup2(null, 0)  # replaces the protocol's stdin
        os.close(null)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(req.get("cwd") or os.getcwd())
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("fork_children"):
            _fork_sglang_children(req["module"])
        sys.argv = [req["module"], *req["argv"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the server's log, like a plain launch
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ZygoteLoop:
    """The request loop: fork servers, report their exit codes, kill them all at the end."""

    def __init__(self, out: "object") -> None:
        self.out = out
        self.children: dict[int, int | None] = {}

    def say(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def reap(self) -> None:
        for pid, code in list(self.children.items()):
            if code is None:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 255 << 8
                if done == pid:
                    self.children[pid] = os.waitstatus_to_exitcode(status)

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "start":
            if importlib.util.find_spec(req["module"]) is None:
                return {"error": f"no module named {req['module']!r}"}
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                _serve_child(req, (0, self.out.fileno()))
            self.children[pid] = None
            return {"pid": pid}
        if op == "poll":
            self.reap()
            pid = int(req["pid"])
            if pid not in self.children:
                return {"error": f"pid {pid} was not started here"}
            return {"code": self.children[pid]}
        return {"error": f"unknown op {op!r}"}

    def kill_all(self) -> None:
        for pid, code in self.children.items():
            if code is None:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 5
        while any(c is None for c in self.children.values()) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)

    def loop(self, lines: "object") -> None:
        try:
            for line in lines:
                if not line.strip():
                    continue
                req: dict = {}
                try:
                    req = json.loads(line)
                    answer = self.handle(req)
                except Exception as e:  # noqa: BLE001 - the kit reads the one line
                    answer = {"error": f"{type(e).__name__}: {e}"}
                self.say({**answer, "id": req.get("id")})
        finally:
            self.kill_all()


def main(modules: list[str]) -> int:
    # The protocol keeps the original stdout; whatever SGLang prints goes to stderr (the log).
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: kill_all runs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the kit's to handle
    zygote = ZygoteLoop(out)
    t0 = time.monotonic()
    try:
        for module in modules:
            importlib.import_module(module)
        why = _unavailable()
    except Exception as e:  # noqa: BLE001 - one line to the kit, the traceback to the log
        import traceback

        traceback.print_exc()
        why = f"importing the server stack failed: {type(e).__name__}: {e}".splitlines()[0]
    if why:
        zygote.say({"unavailable": why})
        return 0
    zygote.say({"ready": {"import_s": round(time.monotonic() - t0, 2), "pid": os.getpid()}})
    zygote.loop(sys.stdin)
    return 0


if __name__ == "__main__":  # pragma: no cover - the zygote process
    sys.exit(main(sys.argv[1:]))
