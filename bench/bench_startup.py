"""Where the start-up of a real-SGLang-on-CPU cell goes, and what a pre-imported launcher saves
(issue 23 prototype; measures only, changes nothing in the kit).

    python bench/bench_startup.py --mode plain|A|B|C [--cell ID] [--repeats 3] [--fault NAME] [--probe health|generate]

* ``plain``: the cell's exact argv and env from ``hybrid-conformance plan`` (``python -m
  sglang.launch_server ...``), one fresh interpreter per launch.
* ``A``: this script re-execs itself under the cell's fixed env (platform, plugins allow-list,
  stand-in PYTHONPATH, OMP threads), imports ``sglang.srt.entrypoints.http_server`` and
  ``sglang.srt.server_args`` once (no ``load_plugins()``), then per launch forks; the child
  does ``setsid``, sets ``os.environ`` to the exact launch env and ``sys.argv``, and runs
  ``sglang.launch_server`` as ``__main__``.  SGLang's children are still spawned.
* ``B``: A, and in the forked child ``engine._set_envs_and_config`` (called by global name
  from ``Engine._launch_subprocesses``) is wrapped so that after SGLang's
  ``mp.set_start_method("spawn", force=True)`` the start method becomes ``forkserver`` with
  the heavy modules preloaded: the scheduler and detokenizer are forked from one process that
  imported the stack once, instead of each importing it.

* ``C`` (beyond the brief): A, and SGLang's children are plain ``fork``s of the pre-imported
  launch child (start method switched after SGLang's ``spawn``); ``_plugins_loaded`` is reset in
  each forked child so the scheduler's own ``load_plugins()`` runs and reports.

``--probe health`` (default) polls /health until 200, then sends the first /generate; with
``--sleep-on-idle`` /health itself takes 1-2 s.  ``--probe generate`` polls /generate directly.

Per launch: times (from the launch) of the first log line, the first scheduler log line, the
"Load weight end" line, "The server is fired up", /health ok and the first /generate answer
(max_new_tokens 1), plus the CPU seconds of the whole process session at the first answer, and
the plugin report (``$HYBRID_CONFORMANCE_PLUGIN_REPORT``) checked as
``conformance.targets.plugin_proof`` checks it.  With ``--fault`` a few cache-hitting requests
follow and the fault's records are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from conformance.faults import SGLANG_FAULT_ENV

CELL_DEFAULT = "qwen3-next-80b-extra_buffer-p1-t256"
MARK = "_BENCH_STARTUP_REEXEC"
PATTERNS = {
    "main_args": ("server_args=",),  # main process: imports done, args parsed
    "sched_log": ("Init parallel begin",),  # first scheduler line
    "weights_loaded": ("Load weight end",),
    "fired_up": ("The server is fired up",),
}
PRELOAD = [
    "torch",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
]


def load_cell(cell_id: str) -> dict:
    out = subprocess.run(["hybrid-conformance", "plan", "--target", "sglang-cpu", "--tier", "premerge", "--format", "json"],
                         check=True, capture_output=True, text=True).stdout
    for c in json.loads(out)["cells"]:
        if c["id"] == cell_id:
            return c
    raise SystemExit(f"no cell {cell_id}")


def with_port(argv: list[str], port: int) -> list[str]:
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    return argv


def http(url: str, body: dict | None = None, timeout: float = 2.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def session_cpu(sid: int) -> tuple[float, int]:
    total, n = 0.0, 0
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                t = p.cpu_times()
                total += t.user + t.system
                n += 1
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return total, n


def measure(pid: int, t0: float, log: Path, port: int, report: Path, fault: str | None, timeout: float = 300,
            probe: str = "health") -> dict:
    """Poll the log, /health and /generate of the server whose session leader is ``pid``."""
    res: dict = {}
    seen = 0
    base = f"http://127.0.0.1:{port}"
    healthy = probe == "generate"  # "generate": no /health first, the first answer is polled directly
    while time.time() - t0 < timeout:
        now = time.time() - t0
        text = log.read_text(errors="replace") if log.exists() else ""
        end = text.rfind("\n") + 1  # whole lines only: a pattern split across two reads is not missed
        if end > seen:
            new = text[seen:end]
            seen = end
            if "first_log" not in res and new.strip():
                res["first_log"] = now
            for key, pats in PATTERNS.items():
                if key not in res and any(p in new for p in pats):
                    res[key] = now
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                res["error"] = "server exited"
                break
        except ChildProcessError:
            pass
        if "sched_proc" not in res:
            try:
                if psutil.Process(pid).children(recursive=True):
                    res["sched_proc"] = now  # first child process of the server (resource tracker / scheduler)
            except psutil.Error:
                pass
        if not healthy:
            try:
                if http(base + "/health", timeout=15.0)[0] == 200:
                    healthy = True
                    res["healthy"] = time.time() - t0
            except Exception:
                pass
        if healthy:
            try:
                code, body = http(base + "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=60)
                res["first_answer"] = time.time() - t0
                res["cpu_s"], res["procs"] = session_cpu(pid)
                break
            except Exception as e:  # noqa: BLE001
                res["gen_err"] = repr(e)
        time.sleep(0.05)
    if "fired_up" not in res:  # the loop may stop before it reads that line: take its log timestamp (1 s resolution)
        import datetime as dt
        for line in log.read_text(errors="replace").splitlines():
            if "The server is fired up" in line and line.startswith("["):
                ts = dt.datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S").timestamp()
                res["fired_up_logts"] = ts - t0
                break
    m = [line for line in log.read_text(errors="replace").splitlines() if "Engine startup timings" in line]
    if m:
        res["engine_timings"] = m[-1].split("Engine startup timings")[-1].strip()
    if fault and "first_answer" in res:
        prompt = " ".join(f"word{i}" for i in range(120))
        outs = []
        for _ in range(4):
            _, body = http(base + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=60)
            b = json.loads(body)
            outs.append((b.get("meta_info", {}).get("cached_tokens"), b.get("text")))
        res["fault_requests"] = outs
    recs = []
    if report.exists():
        recs = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    res["report"] = [{k: r.get(k) for k in ("plugin", "role", "status", "fault", "count", "error") if k in r} for r in recs]
    from conformance.targets.plugin_proof import check_plugins
    try:
        expected = ("hybrid_conformance_cpu", "hybrid_conformance_observe") + (("hybrid_conformance_faults",) if fault else ())
        check_plugins("bench", report, expected)
        res["plugin_proof"] = "ok"
    except Exception as e:  # noqa: BLE001
        res["plugin_proof"] = f"FAIL {e}"
    return res


def stop(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                break
        except ChildProcessError:
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    time.sleep(1.0)
    for p in psutil.process_iter():  # stragglers of that session (e.g. the forkserver)
        try:
            if os.getsid(p.pid) == pid:
                p.kill()
        except (psutil.Error, ProcessLookupError):
            pass


def launch_env(cell: dict, report: Path, fault: str | None) -> dict:
    env = {**os.environ, **cell["env"], "HYBRID_CONFORMANCE_PLUGIN_REPORT": str(report)}
    env.pop(MARK, None)
    if fault:
        env[SGLANG_FAULT_ENV] = fault
    return env


def launch_plain(cell, argv, env, log):
    f = open(log, "w")
    p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    f.close()
    return p.pid


def wrap_forkserver():
    import multiprocessing as mp

    import sglang.srt.entrypoints.engine as engine

    original = engine._set_envs_and_config

    def _set_envs_and_config(server_args):
        original(server_args)
        mp.set_start_method("forkserver", force=True)
        mp.set_forkserver_preload(PRELOAD)

    engine._set_envs_and_config = _set_envs_and_config


def wrap_fork():
    """Variant C (beyond the brief): SGLang's children are plain forks of the pre-imported launch
    child.  ``_plugins_loaded`` is inherited as True from the main process, so it is reset in each
    forked child (``os.register_at_fork``) for the scheduler's own ``load_plugins()`` to run."""
    import multiprocessing as mp

    import sglang.srt.entrypoints.engine as engine
    import sglang.srt.plugins as plugins

    original = engine._set_envs_and_config

    def _set_envs_and_config(server_args):
        original(server_args)
        mp.set_start_method("fork", force=True)

    engine._set_envs_and_config = _set_envs_and_config
    os.register_at_fork(after_in_child=lambda: setattr(plugins, "_plugins_loaded", False))


def launch_fork(argv, env, log, forkserver: bool, fork: bool = False):
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["sglang.launch_server", *argv[3:]]
            if forkserver:
                wrap_forkserver()
            if fork:
                wrap_fork()
            import runpy

            runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return pid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("plain", "A", "B", "C"), required=True)
    ap.add_argument("--cell", default=CELL_DEFAULT)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fault", default=None)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--probe", choices=("health", "generate"), default="health",
                    help="health: /health until 200, then /generate; generate: /generate polled from the launch on")
    ap.add_argument("--cell-json", default=None, help="internal: the cell, passed to the re-exec'd parent")
    args = ap.parse_args()

    cell = json.loads(Path(args.cell_json).read_text()) if args.cell_json else load_cell(args.cell)
    if args.mode != "plain" and os.environ.get(MARK) != "1":
        # The pre-imported parent must import under the cell's fixed env (PYTHONPATH, platform, plugins, OMP).
        cj = Path(tempfile.mkdtemp(prefix="bench_startup_")) / "cell.json"
        cj.write_text(json.dumps(cell))
        env = {**os.environ, **cell["env"], MARK: "1"}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:], "--cell-json", str(cj)], env)

    pre = {}
    if args.mode != "plain":
        c0, t0 = time.process_time(), time.time()
        import sglang.srt.entrypoints.http_server  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
        pre = {"preimport_wall": round(time.time() - t0, 2), "preimport_cpu": round(time.process_time() - c0, 2)}
        if args.mode in ("B", "C"):
            import sglang.srt.entrypoints.engine  # noqa: F401
        import sglang.srt.plugins as sp
        pre["plugins_loaded_in_parent"] = getattr(sp, "_plugins_loaded", "?")
        print(json.dumps({"mode": args.mode, **pre}), flush=True)

    work = Path(tempfile.mkdtemp(prefix=f"bench_startup_{args.mode}_"))
    results = []
    for i in range(args.repeats):
        port = args.port + i
        argv = with_port(cell["command"], port)
        log, report = work / f"run{i}.log", work / f"run{i}.report.jsonl"
        env = launch_env(cell, report, args.fault)
        t0 = time.time()
        if args.mode == "plain":
            pid = launch_plain(cell, argv, env, log)
        else:
            pid = launch_fork(argv, env, log, forkserver=args.mode == "B", fork=args.mode == "C")
        try:
            r = measure(pid, t0, log, port, report, args.fault, probe=args.probe)
        finally:
            stop(pid)
        r = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
        r["log"], r["t0"] = str(log), round(t0, 2)
        print(json.dumps({"mode": args.mode, "run": i, **r}), flush=True)
        results.append(r)
    summary = {"mode": args.mode, **pre}
    for key in ("first_log", "main_args", "sched_proc", "sched_log", "weights_loaded", "fired_up", "healthy", "first_answer", "cpu_s"):
        vals = [r[key] for r in results if key in r]
        if vals:
            summary[f"median_{key}"] = round(statistics.median(vals), 2)
    print("SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
