"""One run of ``hybrid-conformance mutants``: a plan's pytest selection, clean or with one
seeded fault switched on, judged into an :class:`Outcome` (caught, and by which checks).

Caught = a named check reported it (:mod:`conformance.mutants.scoring`): a failing check of
report.json, the cell teardown's idle check, SGLang's own strict idle check named in the log
of the server it killed; for a plan running the perf suite, ``compare`` flags a perf ratio
against the plan's clean run; for a paired A/B plan (a fault only that test sees), the
paired test flags the server with the fault against a clean one.  A start-up death, a later unexplained death, a check that
errored, a timeout, a real-SGLang fault whose hooks never fired: each its own category,
reported, never scored caught.  A clean run fails on any of them.  The timed-out pytest
is killed with its whole process group (servers included).  Used by :mod:`conformance.mutants.command` (the
scores) and :mod:`conformance.mutants.power` (scripted suites vs request programs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from conformance.matrix.faults import FAULT_ENV, PAIRED_AB
from conformance.mutants.catalogue import MutantPlan
from conformance.mutants.scoring import CAUGHT, category, verdict_lines
from conformance.matrix.suites import suite
from conformance.targets.registry import target_for
from conformance.checks.leaks import leak_report_pools, scan_log
from conformance.sglang_plugins.activation import FAULT_PLUGIN, read_report
from conformance.report.compare import compare_files

@dataclass
class Outcome:
    name: str
    caught: bool  # a fault: a named check caught it; the clean run: it failed (anything at all)
    by: list[str] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int = 0
    fired: int | None = None  # real-SGLang faults: how often the fault's hooks changed SGLang's behaviour
    timed_out: bool = False
    category: str = ""  # a fault: scoring.CAUGHT or one of scoring.UNSCORED
    checks: list[str] = field(default_factory=list)  # a fault: the named checks that caught it


def fault_outcome(fault: str, by: list[str], seconds: float, code: int, *, fired: int | None = None, timed_out: bool = False) -> Outcome:
    """A fault run judged honestly: caught only by a named check (``scoring``)."""
    kind, checks = category(by, timed_out=timed_out, fired=fired)
    return Outcome(fault, kind == CAUGHT, by, seconds, code, fired, timed_out, kind, checks)


def _pytest_argv(plan: MutantPlan, report_dir: Path) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *(["-x"] if plan.stop_at_first else [])]
    if not target_for(plan).serves_http():
        argv += [str(suite("leaks").path), "--target", plan.target, "-m", "pool", "-p", "conformance.mutants.pool_faults"]
    else:
        argv += [str(suite(s).path) for s in plan.suites]
        argv += ["--target", plan.target, "-m", "not pool", f"--report-dir={report_dir}"]
    if plan.keyword:  # e.g. the one cell of a cache variant
        argv += ["-k", plan.keyword]
    for flag, value in (("--models", plan.models), ("--strategies", plan.strategies), ("--page-sizes", plan.page_sizes), ("--server-options", plan.server_options), ("--tier", plan.tier), ("--faults", plan.faults)):
        if value:
            argv.append(f"{flag}={value}")
    argv.append("--timeout=600")
    argv += list(plan.extra_args)
    return argv


#: What ``perf-ab --json`` writes in a paired A/B plan's report folder.
PAIRED_AB_JSON = "perf_ab.json"


def _paired_ab_argv(plan: MutantPlan, fault: str | None, report_dir: Path) -> list[str]:
    """``hybrid-conformance perf-ab`` on the plan's cell: the fault on one drawn side ('none': clean)."""
    return [sys.executable, "-m", "conformance.cli", "perf-ab", "--target", plan.target, "--cell", str(plan.keyword),
            "--fault", fault or "none", "--repeats", "1", "--json", str(report_dir / PAIRED_AB_JSON), "--log-dir", str(report_dir / "logs")]


def paired_ab_lines(report_dir: Path, output: str, exit_code: int) -> list[str]:
    """A paired A/B run's finding: the paired test flagged the side with the fault (the
    verdict line, named ``PAIRED_AB``); no verdict is an error line (a crash, not a catch)."""
    path = report_dir / PAIRED_AB_JSON
    runs = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    if not runs:
        last = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        return [f"error: perf-ab exited {exit_code} with no verdict: {last[:160]}"]
    return [f"{PAIRED_AB}: {r['fault'] or 'clean pair'} on side {r['slowed']}: {r['line']}" for r in runs if r["flagged"]]


def _caught_by(report_dir: Path, output: str, exit_code: int) -> list[str]:
    found: list[str] = []
    path = report_dir / "report.json"
    if path.exists():
        report = json.loads(path.read_text())
        for cell in report.get("cells", []):
            for check, v in cell.get("checks", {}).items():
                if v.get("status") == "fail":
                    found += verdict_lines(check, v)  # one line per finding, with its kind
                elif v.get("status") == "error" and "ServerDiedError" in (v.get("reason") or ""):
                    # a server died under the check's requests: what its log says killed it
                    # (SGLang's strict idle check is a catch; an unexplained death is not)
                    found.append(_died_line(v.get("reason") or "", report_dir))
                elif v.get("status") == "error":
                    found.append(f"{check} error: {(v.get('reason') or '')[:110]}")
    for line in output.splitlines():
        if not line.startswith(("ERROR ", "FAILED ")):
            continue
        why = line.split(" - ", 1)[-1].strip() if " - " in line else line.strip()
        if "server is not serving" in why or "exited during start-up" in why:
            found.append(_died_line(why, report_dir, startup="exited during start-up" in why))
        elif "pools not idle" in why:
            found.append(f"cell teardown: {why.split(': ', 1)[-1][:110]}")
        elif "/leaks/test_pool" in line or "test_pool_" in line:
            found.append(f"pool invariants: {why[:110]}")
        elif line.startswith("ERROR "):
            found.append(f"error: {why[:110]}")
    if exit_code not in (0, 5) and not found:
        found.append(f"pytest exit {exit_code}")
    return list(dict.fromkeys(found))


_EXIT_CODE = re.compile(r"exit(?:ed)?(?: during start-up)? with (?:code|status) (-?\d+)")


def _leak_line(log: str) -> str:
    """SGLang's idle-check report in one line: the pools whose terms do not add up (the
    report spans one line per pool), else the first leak/error line of the log."""
    if "memory leak detected" in log:
        bad = [line for _, line in leak_report_pools(log)]
        first = next(line for line in log.splitlines() if "memory leak detected" in line)
        return "SGLang's idle check: memory leak detected: " + " | ".join(bad or [first.strip()])
    found = scan_log(log)
    return found[0] if found else ""


def _died_line(why: str, report_dir: Path, *, startup: bool = False) -> str:
    """A dead server in one line: its exit code and what its log says killed it."""
    code = _EXIT_CODE.search(why)
    head = "server died" + (" at start-up" if startup else "") + (f" (exit {code.group(1)})" if code else "")
    for log in sorted((report_dir / "logs").glob("*.log")):
        line = _leak_line(log.read_text(errors="replace"))
        if line:
            return f"{head}: {line[:240]}"
    return f"{head}: {why.split('server is not serving: ', 1)[-1][:110]}"


def fired_count(report_dir: Path, fault: str) -> int:
    """How often a real-SGLang fault's hooks fired in the servers of one run (plugin reports)."""
    counts = [0]
    for path in (report_dir / "logs").rglob("*.plugins.jsonl"):  # a paired A/B: logs/<run>/<side>/
        counts += [int(r.get("count", 0)) for r in read_report(path) if r.get("plugin") == FAULT_PLUGIN and r.get("status") == "fired" and r.get("fault") == fault]
    return max(counts)


def perf_regressions(clean_dir: Path, report_dir: Path) -> list[str]:
    """``compare``'s perf rows between the clean run of a plan and a fault's run of it."""
    if not (clean_dir / "report.json").exists() or not (report_dir / "report.json").exists():
        return []
    rows = compare_files(clean_dir / "report.json", report_dir / "report.json").rows
    return [f"perf (compare): {r.cell} {r.check} {r.old} -> {r.new}" for r in rows if r.kind == "perf"]


def run_plan(plan: MutantPlan, fault: str | None, out_dir: Path) -> Outcome:
    report_dir = out_dir / (fault or "clean") / plan.key
    report_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}  # keep the short summary's reasons
    env.pop(FAULT_ENV, None)
    env.pop(plan.fault_env, None)
    if fault:
        env[plan.fault_env] = fault
    t0 = time.monotonic()
    if plan.paired_ab:  # both servers' fault switches are the A/B's own (one side only)
        env.pop(plan.fault_env, None)
    argv = _paired_ab_argv(plan, fault, report_dir) if plan.paired_ab else _pytest_argv(plan, report_dir)
    code, output, timed_out = run_bounded(argv, env=env, timeout_s=plan.timeout_s)
    (report_dir / "pytest.log").write_text(output)
    if timed_out:  # proves nothing either way: not caught, and a clean run that fails
        why = f"timed out after {plan.timeout_s:.0f}s: not caught" if fault else f"timed out after {plan.timeout_s:.0f}s"
        if fault:
            return fault_outcome(fault, [why], time.monotonic() - t0, code, timed_out=True)
        return Outcome("clean", True, [why], time.monotonic() - t0, code, timed_out=True)
    by = paired_ab_lines(report_dir, output, code) if plan.paired_ab else _caught_by(report_dir, output, code)
    if fault and plan.suites[:1] == ("perf",):  # a slowdown fails no check: compare against the clean run catches it
        by += perf_regressions(out_dir / "clean" / plan.key, report_dir)
    if code == 5:  # the selection ran nothing: a clean run that proves nothing, a fault not caught
        return Outcome(fault or "clean", fault is None, [f"no test selected by {plan.key}"], time.monotonic() - t0, code,
                       category="" if fault is None else "crash")
    if target_for(plan).loads_kit_plugins():
        return _judge_sglang(plan, fault, by, code, report_dir, time.monotonic() - t0)
    if fault is None:
        return Outcome("clean", bool(by) or code != 0, by, time.monotonic() - t0, code)
    return fault_outcome(fault, by, time.monotonic() - t0, code)


def run_bounded(argv: list[str], *, env: dict[str, str], timeout_s: float) -> tuple[int, str, bool]:
    """(exit code, output, timed out): the child runs in its own process group, which is
    SIGTERMed then SIGKILLed on timeout -- or when this process is interrupted (Ctrl-C, or a
    SIGTERM unwinding through ``launcher.install_signal_handlers``) -- so no server it started
    outlives it."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output or "", False
    except subprocess.TimeoutExpired:
        return -1, stop_group(proc) + f"\ntimed out after {timeout_s:.0f}s", True
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> str:
    """SIGTERM, then SIGKILL, the child's process group; what it printed meanwhile."""
    output = ""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            output, _ = proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            output = ""
        except (ValueError, OSError):  # an interrupted communicate can leave its pipes closed: wait instead
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
    return output or ""


def _judge_sglang(plan: MutantPlan, fault: str | None, by: list[str], code: int, report_dir: Path, seconds: float) -> Outcome:
    """Real SGLang: a timed-out run is not caught; a fault that never fired was not reached."""
    if code == -1:
        why = [f"timed out after {plan.timeout_s:.0f}s on {plan.key}"]
        return fault_outcome(fault, why, seconds, code, timed_out=True) if fault else Outcome("clean", True, why, seconds, code, timed_out=True)
    if fault is None:
        return Outcome("clean", bool(by) or code != 0, by, seconds, code)
    fired = fired_count(report_dir, fault)
    if not fired:
        return fault_outcome(fault, [f"never reached: {fault} did not fire on {plan.key}", *by], seconds, code, fired=0)
    return fault_outcome(fault, by, seconds, code, fired=fired)
