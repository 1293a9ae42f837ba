"""``hybrid-conformance history``: the kit against each SGLang release of a list.

Per release: a virtual environment under ``--venv-dir`` (``HYBRID_CONFORMANCE_VENVS``,
default ``~/.cache/hybrid-conformance/venvs``) made with ``--system-site-packages`` so it
shares this Python's torch, and filled by ``ci/setup-cpu.sh`` itself
(``HYBRID_CONFORMANCE_SGLANG=<release>``: ``sglang==X --no-deps`` and the release range's
pins, ``conformance/sglang_api/release_pins.py``); inside the venv, ``sglang`` and each
pin must import at the release's versions, whether the venv holds them or the system
already had exactly those (checked).  Then, in that venv: the feature probe (its one line is
printed), ``plan --target sglang --validate``, the pool tier (each scenario and the state
machine a check of its own), and the ``sglang-cpu`` premerge set where the kit has that
target, the release has the extension points it needs and ``--with-sglang-cpu`` asks
for it (an n/a row saying which, otherwise).

A row is ``(release, check, status, reason)`` with status ``pass``, ``fail`` or ``na``;
the command prints a release x check table (or ``--format json``:
``{"rows": [...], "probes": {...}}``) and exits 1 when any release fails.
"""

from __future__ import annotations

import argparse
import functools

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from conformance.matrix.suites import suite
from conformance.errors import KitError
from conformance.report.history_html import fold
from conformance.sglang_api.release_pins import pins_for, release_of
from conformance.targets.reference import PYTHON_ENV as REFERENCE_PYTHON_ENV
from conformance.matrix.cells import load_matrix
from conformance.commands import sglang_source
from conformance.commands.sglang_source import without_flag
from conformance.report.versions import SOURCE_ENV
from conformance.sglang_api.probes import Features
from conformance.matrix.strategy import STRATEGIES
from conformance.report.run_report import NOTHING_APPLIES
from conformance.commands.selection import workers
from conformance.programs.explore import parse_budget
from conformance.commands.kit_identity import kit_identity
from conformance.commands.night_plan import RELEASE_CHECKS, Costs, Fill, Shard, night_of, parse_release_range, plan_night
from conformance.report.history_html import render_html
from conformance.report.known_bugs import row_hits
from conformance.commands.report_bug import write_hit_folders
from conformance.session.known_bugs import load as load_known_bugs
from conformance.session.options import options_from_args
from conformance.reference.twins import make_twins

ROOT = Path(__file__).resolve().parents[2]
POOL_SUITE = suite("leaks").path / "test_pool_invariants.py"
VENVS_ENV = "HYBRID_CONFORMANCE_VENVS"
READY = ".hybrid-conformance-ready.json"
STATUSES = ("pass", "fail", "na")
CHECKS = ("validate", "pool", "machine", "sglang-cpu")  # --checks: what runs per release
SETUP_TIMEOUT_S, PROBE_TIMEOUT_S, PLAN_TIMEOUT_S, POOL_TIMEOUT_S, CPU_TIMEOUT_S = 1800, 600, 900, 1800, 3600


@dataclass(frozen=True)
class Row:
    release: str
    check: str
    status: str  # pass | fail | na
    reason: str = ""
    cell: str = ""  # the matrix cell (server-level rows), "" for release-level rows
    replay: str = ""  # a FAIL's replay file (request programs), copied under the history's --out
    known_bug: str = ""  # the known SGLang bug (fixtures/known_bugs.toml id) a FAIL was matched to


def default_venv_dir() -> Path:
    return Path(os.environ.get(VENVS_ENV) or Path.home() / ".cache" / "hybrid-conformance" / "venvs")


def parse_releases(text: str) -> list[str]:
    """``0.5.12,0.5.13`` or ``0.5.11..0.5.23`` (every patch release between) -> releases;
    KitError (one line) for anything that is not one."""
    out = []
    for item in (r for t in text.split(",") for r in parse_release_range(t.strip())):
        if not item:
            continue
        release = release_of(item)
        if release is None:
            raise KitError(f"--releases: {item!r} is not a release number (e.g. 0.5.13)")
        try:
            pins_for(release)
        except ValueError as e:
            raise KitError(f"--releases: {e}") from None
        out.append(release)
    if not out:
        raise KitError("--releases: no release given (e.g. --releases 0.5.12,0.5.13)")
    return out


def parse_checks(text: str | None) -> tuple[str, ...]:
    if not text:
        return CHECKS
    chosen = tuple(c.strip() for c in text.split(",") if c.strip())
    bad = [c for c in chosen if c not in CHECKS]
    if bad or not chosen:
        raise KitError(f"--checks: unknown value {', '.join(bad) or repr(text)}; allowed: {', '.join(CHECKS)}")
    return chosen


def parse_models(text: str | None) -> tuple[str, ...]:
    """--models: model ids, families or twins of the matrix (checked before any venv is made)."""
    if not text:
        return ()
    chosen = tuple(m.strip() for m in text.split(",") if m.strip())
    if not chosen:
        raise KitError(f"--models: no model given in {text!r}")
    load_matrix().select(models=list(chosen))
    return chosen


# ------------------------------------------------------------------ venvs

def _run(argv: Sequence[str], *, timeout: float, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise KitError(f"{shlex.join(argv[:4])} ... did not finish in {timeout:.0f} s") from None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def venv_env(venv: Path) -> dict[str, str]:
    """The environment the kit's own code runs with inside a release's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join((str(venv / "bin"), env.get("PATH", "")))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not same_engine_libraries(venv):
        # the reference engine (agreement's other side) keeps the kit's interpreter and transformers
        env.setdefault(REFERENCE_PYTHON_ENV, sys.executable)
    return env


#: The libraries the reference engine's numerics are defined on.
ENGINE_LIBRARIES = ("torch", "transformers")
_ORIGINS = "import importlib.util as u, json, sys; print(json.dumps([getattr(u.find_spec(m), 'origin', None) for m in sys.argv[1:]]))"


@functools.lru_cache(maxsize=None)
def same_engine_libraries(venv: Path) -> bool:
    """True when the release's venv imports the kit's own torch and transformers (its pins
    left them as they are): the reference engine then runs in the venv's interpreter and
    starts from the run's pre-imported forkserver instead of a fresh kit interpreter per
    server.  Any doubt (the probe fails) keeps the kit's interpreter."""
    import importlib.util

    mine = [getattr(importlib.util.find_spec(m), "origin", None) for m in ENGINE_LIBRARIES]
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", _ORIGINS, *ENGINE_LIBRARIES], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return False
    return None not in mine and theirs == mine


_SHADOW_CHECK = """
import importlib.metadata as md, json, sys
import sglang
names = sys.argv[1:]
print(json.dumps({"sglang_file": sglang.__file__, "versions": {n: md.version(n) for n in ["sglang", *names]}}))
"""


def ensure_venv(release: str, root: Path, *, reinstall: bool = False, python: str = sys.executable,
                spec: str | None = None, name: str | None = None) -> Path:
    """The venv for ``release`` (made once, then reused); KitError with one line on failure.
    ``spec``/``name``: what pip installs as sglang (default ``sglang==<release>``) and the
    venv's folder name (default ``sglang-<release>``): a source checkout's ``python/`` folder
    in a venv named by its commit (``conformance.commands.sglang_source``)."""
    venv = root / (name or f"sglang-{release}")
    pins = pins_for(release)
    ready = venv / READY
    want = {"release": release, "pins": list(pins)} | ({"spec": spec} if spec else {})
    if not reinstall and ready.exists() and json.loads(ready.read_text()) == want:
        return venv
    if ready.exists():
        ready.unlink()
    root.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        made = _run([python, "-m", "venv", "--system-site-packages", str(venv)], timeout=300)
        if made.returncode:
            raise KitError(f"sglang {release}: python -m venv failed: {_last_line(made.stderr)}")
    env = dict(os.environ, PYTHON=str(venv / "bin" / "python"), HYBRID_CONFORMANCE_SGLANG=spec or f"sglang=={release}",
               HYBRID_CONFORMANCE_SGLANG_PINS_FOR=release)
    setup = _run(["bash", str(ROOT / "ci" / "setup-cpu.sh")], timeout=SETUP_TIMEOUT_S, env=env)
    if setup.returncode:
        raise KitError(f"sglang {release}: ci/setup-cpu.sh failed: {_last_line(setup.stderr or setup.stdout)}")
    names = [p.split("==")[0] for p in pins]
    shown = _run([str(venv / "bin" / "python"), "-c", _SHADOW_CHECK, *names], timeout=PROBE_TIMEOUT_S, env=venv_env(venv))
    if shown.returncode:
        raise KitError(f"sglang {release}: the venv cannot import sglang: {_last_line(shown.stderr)}")
    seen = json.loads(shown.stdout.strip().splitlines()[-1])
    expected = {"sglang": release, **{p.split("==")[0]: p.split("==")[1] for p in pins}}
    wrong = {n: v for n, v in seen["versions"].items() if v != expected[n]}
    if wrong:
        raise KitError(f"sglang {release}: the venv does not shadow the system's packages: {wrong} (expected {expected})")
    ready.write_text(json.dumps(want))
    return venv


def ensure_source_venv(co, venv_dir: Path, *, reinstall: bool = False) -> Path:
    """The venv of a source checkout (``conformance.commands.sglang_source.Checkout``), keyed by its commit."""
    return ensure_venv(co.version, venv_dir, reinstall=reinstall, spec=str(co.path / "python"), name=co.venv_name)


def rerun_in_source(argv: Sequence[str], path: str, *, venv_dir: Path | None = None) -> int:
    """``hybrid-conformance <argv>`` (``--sglang-source`` removed) inside the checkout's venv."""
    co = sglang_source.checkout(path)
    venv = ensure_source_venv(co, venv_dir or default_venv_dir())
    print(f"hybrid-conformance: sglang from {co.path} at {co.commit[:12]} (version {co.version}) in {venv}", file=sys.stderr)
    env = venv_env(venv) | {SOURCE_ENV: f"{co.path}@{co.commit}"}
    return subprocess.call([str(venv / "bin" / "python"), "-m", "conformance.cli", *without_flag(argv)], env=env)


# ------------------------------------------------------------------ checks

def probe_in(venv: Path) -> dict:
    out = _run([str(venv / "bin" / "python"), "-m", "conformance.sglang_api.probes", "--json"], timeout=PROBE_TIMEOUT_S, env=venv_env(venv))
    if out.returncode:
        raise KitError(f"the feature probe crashed: {_last_line(out.stderr)}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary_of(features: dict) -> str:
    known = {k: v for k, v in features.items() if k in Features.__dataclass_fields__}
    known["strategies"] = tuple(known.get("strategies") or ())
    return Features(**known).summary()


def validate_rows(release: str, venv: Path, tier: str) -> list[Row]:
    argv = [str(venv / "bin" / "python"), "-m", "conformance.cli", "plan", "--target", "sglang", "--validate", "--tier", tier, "--format", "json"]
    out = _run(argv, timeout=PLAN_TIMEOUT_S, env=venv_env(venv))
    if out.returncode not in (0, 1):
        return [Row(release, "plan --validate", "fail", f"exit {out.returncode}: {_last_line(out.stderr)}")]
    try:
        cells = json.loads(out.stdout)["cells"]
    except (ValueError, KeyError):
        return [Row(release, "plan --validate", "fail", f"no JSON plan: {_last_line(out.stderr)}")]
    ok = na = 0
    refused: list[str] = []
    for c in cells:
        pd = c.get("pd")
        for message in [str(c.get("validation", "")), *(pd.values() if isinstance(pd, dict) else [])]:
            if message.startswith("ok"):
                ok += 1
            elif message.startswith("n/a"):
                na += 1
            else:
                refused.append(f"{c.get('id')}: {message}")
    counts = f"{len(cells)} cells, {ok + na + len(refused)} commands: {ok} accepted, {na} n/a, {len(refused)} refused"
    if refused or out.returncode == 1:
        return [Row(release, "plan --validate", "fail", f"{counts}; first: {refused[0] if refused else _last_line(out.stderr)}")]
    if not ok:
        return [Row(release, "plan --validate", "na", f"{counts} (nothing this release accepts)")]
    return [Row(release, "plan --validate", "pass", counts)]


def _case_check(case: ET.Element, scenarios: Sequence[str]) -> str:
    name = case.get("name", "")
    if name.startswith("test_pool_machine"):
        return "pool:machine"
    param = name[name.find("[") + 1 : -1] if "[" in name else ""
    for s in sorted(scenarios, key=len, reverse=True):
        if param.startswith(f"{s}-") or param.endswith(f"-{s}") or param == s:
            return f"pool:{s}"
    return f"pool:{name}"


def _case_outcome(case: ET.Element) -> tuple[str, str]:
    for tag, status in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
        el = case.find(tag)
        if el is not None:
            text = " ".join((el.get("message") or el.text or "").split())
            return status, text[:400]
    return "pass", ""


def pool_rows(release: str, venv: Path, tier: str, *, machine: bool = True) -> list[Row]:
    from conformance.targets.pool.scenarios import SCENARIOS  # deferred: the pool tier imports torch and SGLang's pools; only the pool rows need it

    with tempfile.TemporaryDirectory(prefix="history-pool-") as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [
            str(venv / "bin" / "python"), "-m", "pytest", str(POOL_SUITE), "--target", "pool", "--tier", tier,
            "-p", "no:cacheprovider", "-p", "no:xdist", "-q", f"--junitxml={junit}", f"--report-dir={tmp}/report",
        ] + ([] if machine else ["-k", "test_pool_scenario"])
        env = venv_env(venv) | {"HYBRID_CONFORMANCE_REQUIRE_SGLANG": "1"}
        out = _run(argv, timeout=POOL_TIMEOUT_S, env=env)
        if out.returncode not in (0, 1) or not junit.exists():
            return [Row(release, "pool tier", "fail", f"pytest exited {out.returncode}: {_last_line(out.stdout + out.stderr)}")]
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    by_check: dict[str, list[tuple[str, str, str]]] = {}
    for case in cases:
        status, text = _case_outcome(case)
        by_check.setdefault(_case_check(case, list(SCENARIOS)), []).append((status, text, case.get("name", "")))
    rows = [] if machine else [Row(release, "pool:machine", "na", "not selected (--checks without machine)")]
    for check in (["pool:machine"] if machine else []) + [*(f"pool:{s}" for s in SCENARIOS)] + sorted(set(by_check) - {"pool:machine", *(f"pool:{s}" for s in SCENARIOS)}):
        rows.append(_aggregate(release, check, by_check.get(check, [])))
    if not cases:
        rows.append(Row(release, "pool tier", "fail", "pytest ran no test"))
    return rows


def _aggregate(release: str, check: str, outcomes: list[tuple[str, str, str]]) -> Row:
    """fail if any case failed; pass if any passed; na if every case was not applicable."""
    fails = [(t, n) for s, t, n in outcomes if s == "fail"]
    if fails:
        text, name = fails[0]
        return Row(release, check, "fail", f"{len(fails)} of {len(outcomes)} failed; {name}: {text}")
    passed = sum(1 for s, _, _ in outcomes if s == "pass")
    na = [t for s, t, _ in outcomes if s == "skip" and t.startswith("n/a")]
    if passed:
        return Row(release, check, "pass", f"{passed} passed, {len(na)} n/a")
    if na:
        return Row(release, check, "na", na[0][len("n/a: "):] if na[0].startswith("n/a: ") else na[0])
    return Row(release, check, "na", "no cell of the selected tier applies" if outcomes else "not collected")


SGLANG_CPU = "sglang-cpu"
BUDGET_ENV = "HYBRID_CONFORMANCE_BUDGET"  # the request programs' budget (conformance/programs/options.py)
CPU_SUITES = ("agreement", "kl", "prefix_branching", "gsm8k", "leaks", "programs")  # the premerge set + programs at its budget
_CPU_STATUS = {"pass": "pass", "fail": "fail", "error": "fail", "skip": "na"}


def sglang_cpu_rows(release: str, venv: Path, features: dict, *, requested: bool, tier: str, out_dir: Path | None = None,
                    models: Sequence[str] = (), workers: int = 1, cells: Sequence[str] = (), budget: str | None = None, part: str = "") -> list[Row]:
    """The sglang-cpu cells of ``tier`` (premerge by default) and the request programs on this release: one row per
    (cell, check) from the run's report.json; n/a rows (SGLang's own line) for the cells of a
    strategy the release's parser refuses; one row when it cannot run at all.  ``models``
    (ids, families or twins) keeps only those models' cells, so one release's rows can be
    produced in parts that each fit a time slot.  ``workers``: the run's pytest-xdist workers
    (a cell's tests stay on one; each worker runs one server at a time).  ``cells``: only those
    cell ids (a shard's, ``conformance/commands/night_plan.py``); ``budget``: the request
    programs' budget (default: the run's own for the tier); ``part``: names its run folder
    (``runs/<release>-<part>``)."""
    check = SGLANG_CPU
    if not (ROOT / "conformance" / "targets" / "sglang_cpu.py").exists():
        return [Row(release, check, "na", "the sglang-cpu target is not in this kit")]
    gap = features.get("sglang_cpu_gap")
    if gap:
        return [Row(release, check, "na", gap)]
    if not requested:
        return [Row(release, check, "na", "not requested (--with-sglang-cpu runs it; minutes per release)")]
    chosen = list(cells)
    cells = load_matrix().select(target=SGLANG_CPU, tier=tier, models=list(models) or None, cells=chosen or None)
    ungated = _gate_refusal(features)  # extra-buffer strategies SGLang would stop at its device assert
    accepted = [s for s in STRATEGIES if s in features.get("strategies", ()) and not (ungated and STRATEGIES[s].has_buffer)]
    rows = [Row(release, check, "na", _refused(features, c.strategy.name), cell=c.id) for c in cells if c.strategy.name not in accepted]
    if not any(c.strategy.name in accepted for c in cells):
        return rows or [Row(release, check, "na", "no sglang-cpu cell of the tier")]
    with tempfile.TemporaryDirectory(prefix="history-cpu-") as tmp:
        if out_dir is not None:  # keep the run's report and server logs: the evidence behind each row
            # absolute: the run's cwd is the kit's root, not the caller's (a relative --out is the caller's)
            tmp = str((out_dir / "runs" / "-".join([release, *models, *([part] if part else [])])).resolve())
            shutil.rmtree(tmp, ignore_errors=True)
            Path(tmp).mkdir(parents=True)
        argv = [str(venv / "bin" / "python"), "-m", "conformance.cli", "run", "--target", SGLANG_CPU, "--tier", tier, "--report-dir", tmp,
                "-n", str(workers), "--suite", ",".join(CPU_SUITES), "--strategies", ",".join(accepted)] + (["--models", ",".join(models)] if models else [])
        argv += ["--cells", ",".join(c.id for c in cells if c.strategy.name in accepted)] if chosen else []
        out = _run(argv, timeout=CPU_TIMEOUT_S, env=venv_env(venv) | ({BUDGET_ENV: budget} if budget else {}))
        report_file = Path(tmp) / "report.json"
        if not report_file.exists():
            return rows + [Row(release, check, "fail", f"exit {out.returncode}, no report.json: {_last_line(out.stderr or out.stdout)}")]
        report = json.loads(report_file.read_text())
        rows += report_rows(release, report, replay_dir=(out_dir / "replays" / release) if out_dir else None)
        reported = {r.cell for r in rows}
        rows += [Row(release, check, "fail", f"asked for, but the run reported no test of it (suites {', '.join(CPU_SUITES)})", cell=c)
                 for c in chosen if c not in reported]
        if not report.get("complete", True) and report.get("incomplete_reasons") != [NOTHING_APPLIES]:  # n/a rows say it all
            why = "; ".join(report.get("incomplete_reasons") or []) or "incomplete"
            rows.append(Row(release, f"{check} run", "fail", f"exit {out.returncode}: the run is incomplete: {why}"[:400]))
    return rows


def _features(features: dict):
    known = {k: v for k, v in features.items() if k in Features.__dataclass_fields__}
    known["strategies"] = tuple(known.get("strategies") or ())
    return Features(**known)


def _refused(features: dict, strategy: str) -> str:
    gate = _gate_refusal(features) if STRATEGIES[strategy].has_buffer else None
    return _features(features).not_applicable(strategy) or gate or f"sglang {features.get('version')}: {strategy} not accepted"


def _gate_refusal(features: dict) -> str | None:
    """The missing device-gate capability (None when the probe found a gate, or did not say)."""
    return _features(features).device_gate_not_applicable() if "extra_buffer_gate" in features else None


def report_rows(release: str, report: dict, *, replay_dir: Path | None = None) -> list[Row]:
    """report.json -> one row per (cell, check): pass; fail for a finding or an error; n/a for
    a skip (its stated reason) and for a cell the run declared not applicable."""
    rows = []
    for cell in report.get("cells", []):
        cid = cell.get("id", "?")
        if cell.get("not_applicable"):
            rows.append(Row(release, SGLANG_CPU, "na", str(cell["not_applicable"]), cell=cid))
            continue
        killer = _known_bug_of(cell)
        for name, verdict in (cell.get("checks") or {}).items():
            status = _CPU_STATUS.get(verdict.get("status"), "fail")
            replay = unexplained_replay(verdict.get("details")) if isinstance(verdict.get("details"), dict) else ""
            if replay and replay_dir is not None and Path(replay).is_file():
                replay_dir.mkdir(parents=True, exist_ok=True)
                replay = str(shutil.copy2(replay, replay_dir / Path(replay).name))
            reason = " ".join(str(verdict.get("reason") or ("" if status == "pass" else verdict.get("status"))).split())[:400]
            if killer and status == "fail" and SERVER_GONE in reason:
                reason = f"after known SGLang bug {killer} killed the cell's server: {reason}"[:400]
            known = (verdict.get("details") or {}).get("known_bug") if isinstance(verdict.get("details"), dict) else None
            bug = str(known.get("id") or "") if isinstance(known, dict) and status == "fail" else (killer or "") if status == "fail" and SERVER_GONE in reason else ""
            rows.append(Row(release, f"{SGLANG_CPU}:{name}", status, reason, cell=cid, replay=replay, known_bug=bug))
    for cid in report.get("cells_not_run") or []:
        rows.append(Row(release, SGLANG_CPU, "fail", "cell not run", cell=str(cid)))
    return rows


def unexplained_replay(details: dict) -> str:
    """The replay file a FAIL row links: the shrunk program's, unless a known bug explains
    every finding of its kind while a kind met while shrinking (``also_seen``) has a
    finding none explains -- then that kind's program, the one a judge has to play."""
    main = str(details.get("failure_file") or "")
    known = {(k.get("kind"), k.get("line")) for k in details.get("known_findings") or ()}
    if not known:
        return main
    open_kinds = {f.get("kind") for f in details.get("findings") or () if (f.get("kind"), str(f.get("line", ""))[:200]) not in known}
    if (details.get("first_failure") or {}).get("kind") in open_kinds:
        return main
    return next((str(o["failure_file"]) for o in details.get("also_seen") or () if o.get("kind") in open_kinds and o.get("failure_file")), main)


#: How a suite that found the cell's server already dead says so (the serving layer's line).
SERVER_GONE = "server is not serving"


def _known_bug_of(cell: dict) -> str | None:
    """The known SGLang bug one of the cell's failing checks was matched to (None: none), so
    the later suites that found the server it killed say what killed it."""
    for verdict in (cell.get("checks") or {}).values():
        known = (verdict.get("details") or {}).get("known_bug") if isinstance(verdict.get("details"), dict) else None
        if verdict.get("status") in ("fail", "error") and isinstance(known, dict) and known.get("id"):
            return str(known["id"])
    return None


# ------------------------------------------------------------------ the command

def history(releases: Sequence[str], *, venv_dir: Path, tier: str, checks: Sequence[str] = CHECKS, with_sglang_cpu: bool = False,
            reinstall: bool = False, log: Callable[[str], None] = print, out_dir: Path | None = None,
            sources: Sequence[str] = (), models: Sequence[str] = (), workers: int = 1, budget: str | None = None,
            shard: Shard | None = None) -> tuple[list[Row], dict[str, str]]:
    """Rows for each release, then for each source checkout (column ``src-<commit>``).
    ``shard``: only its part of each release (its once-a-night checks and its cells)."""
    rows: list[Row] = []
    probes: dict[str, str] = {}
    installs: list[tuple[str, Callable[[], Path]]] = [(r, lambda r=r: ensure_venv(r, venv_dir, reinstall=reinstall)) for r in releases]
    for path in sources:
        co = sglang_source.checkout(path)
        installs.append((co.label, lambda co=co: ensure_source_venv(co, venv_dir, reinstall=reinstall)))
    for release, install in installs:
        start = time.monotonic()
        try:
            venv = install()
        except KitError as e:
            rows.append(Row(release, "install", "fail", str(e)))
            continue
        rows.append(Row(release, "install", "pass", str(venv)))
        try:
            features = probe_in(venv)
        except KitError as e:
            rows.append(Row(release, "import", "fail", str(e)))
            continue
        probes[release] = summary_of(features)
        log(probes[release])
        if features.get("import_error"):
            rows.append(Row(release, "import", "fail", f"sglang {release} is not importable: {features['import_error']}"))
            continue
        part = shard.part(release) if shard else None
        mine = [c for c in checks if part is None or c in part.checks or c == SGLANG_CPU]
        with ThreadPoolExecutor(max_workers=1) as beside:
            pending = beside.submit(rows_beside_the_server_run, release, venv, tier, mine)
            served = (sglang_cpu_rows(release, venv, features, requested=with_sglang_cpu or part is not None, tier=tier, out_dir=out_dir,
                                      models=models, workers=workers, budget=budget, cells=part.cells if part else (),
                                      part=f"shard-{shard.index}" if shard else "")
                      if SGLANG_CPU in mine and (part is None or part.cells) else [])
            rows += pending.result() + served
        log(f"history: sglang {release} done in {time.monotonic() - start:.0f} s")
    return rows, probes


def rows_beside_the_server_run(release: str, venv: Path, tier: str, mine: Sequence[str]) -> list[Row]:
    """The plan's validation and the pool tier, one process at a time, run beside the release's
    server run (whose workers wait on servers, idle checks and the reference engine's
    start-ups), so a release's time is not their sum."""
    out = validate_rows(release, venv, tier) if "validate" in mine else []
    return out + (pool_rows(release, venv, tier, machine="machine" in mine) if "pool" in mine else [])


def parse_workers(text: str | None) -> int:
    """``-n`` as ``run`` reads it for the sglang-cpu target (default min(2, cores); ``auto``;
    ``0`` for none), checked before any release is installed: one-line KitError otherwise."""
    return workers(text, target=SGLANG_CPU)


def parse_budget_arg(text: str | None) -> str | None:
    """--budget as the programs' options read it, checked before any release is installed."""
    if text:
        parse_budget(text)
    return text


def shard_of(args, releases: Sequence[str], models: Sequence[str]) -> Shard | None:
    """``--shard K/N``: shard K of tonight's plan over these releases (``plan --releases ...
    --shards N`` with the same --tier, --models, --budget, --night and --fill prints it); None without."""
    if not args.shard:
        if args.fill:
            raise KitError("--fill goes with --shard K/N (plan --releases ... --fill FILE prints the shards)")
        return None
    if not releases:
        raise KitError("--shard goes with --releases (the plan's releases)")
    count = args.shard.partition("/")[2]
    cells = load_matrix().select(target=SGLANG_CPU, tier=args.tier, models=list(models) or None)
    plan = plan_night(releases, cells, Costs.load(), night=night_of(args.night), tier=args.tier, budget=parse_budget_arg(args.budget),
                      suites=CPU_SUITES, checks=RELEASE_CHECKS, shards=int(count) if count.isdigit() and int(count) > 0 else None,
                      fill=fill_of(args))
    return plan.shard(args.shard)


def fill_of(args) -> Fill | None:
    """``--fill FILE`` (with ``--rerun-unexplained``: against this kit's commit), as ``plan``
    and ``history --shard`` both read it; None without."""
    if args.rerun_unexplained and not args.fill:
        raise KitError("--rerun-unexplained goes with --fill FILE")
    if not args.fill:
        return None
    return Fill.load(args.fill, rerun_unexplained_for=kit_identity()["commit"] if args.rerun_unexplained else None)


def render_table(rows: Sequence[Row], releases: Sequence[str]) -> str:
    checks = list(dict.fromkeys(r.check for r in rows))
    cell = fold(rows)
    width = max([len("check")] + [len(c) for c in checks]) + 2
    lines = ["check".ljust(width) + "".join(rel.ljust(10) for rel in releases)]
    for check in checks:
        marks = []
        for rel in releases:
            r = cell.get((rel, check))
            marks.append(("-" if r is None else {"pass": "pass", "fail": "FAIL", "na": "n/a"}[r[0]]).ljust(10))
        lines.append(check.ljust(width) + "".join(marks))
    notes = [f"  {r.release} {r.check}{' [' + r.cell + ']' if r.cell else ''}: {'FAIL' if r.status == 'fail' else 'n/a'}: {r.reason}"
             + (f" (replay: {r.replay})" if r.replay else "") for r in rows if r.status != "pass"]
    if notes:
        lines += ["", "why (fail and n/a):", *notes]
    return "\n".join(lines)


def failed_releases(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r.release for r in rows if r.status == "fail"))


def run_history(args) -> int:
    if args.write:
        raise KitError("history: --write goes with --bisect ID")
    if not args.releases and not args.sglang_source:
        raise KitError("history: give --releases, --sglang-source or both")
    releases = parse_releases(args.releases) if args.releases else []
    models = parse_models(args.models)
    shard = shard_of(args, releases, models)
    releases = [p.release for p in shard.parts] if shard else releases
    sources = [args.sglang_source] if args.sglang_source else []
    columns = [*releases, *(sglang_source.checkout(p).label for p in sources)]
    venv_dir = Path(args.venv_dir).expanduser() if args.venv_dir else default_venv_dir()
    start = time.monotonic()
    as_json = args.format == "json"
    log = (lambda line: print(f"hybrid-conformance: {line}", file=sys.stderr)) if as_json else print
    checks = parse_checks(args.checks)
    out_dir = Path(args.out)
    if args.with_sglang_cpu or shard:  # the twins from the kit's own transformers: a release venv's older one makes other weights
        make_twins()
    rows, probes = history(releases, venv_dir=venv_dir, tier=args.tier, checks=checks, with_sglang_cpu=args.with_sglang_cpu,
                           reinstall=args.reinstall, log=log, out_dir=out_dir, sources=sources, models=models,
                           workers=parse_workers(args.workers), budget=parse_budget_arg(args.budget), shard=shard)
    failed = failed_releases(rows)
    doc = {"rows": [asdict(r) for r in rows], "probes": probes}
    if shard:
        doc["shard"] = {"index": shard.index, "of": args.shard.split("/")[1], "night": night_of(args.night).isoformat(), "tier": args.tier,
                        "planned_minutes": round(shard.seconds / 60, 1), "wall_minutes": round((time.monotonic() - start) / 60, 1),
                        "parts": {p.release: {"checks": list(p.checks), "cells": list(p.cells)} for p in shard.parts},
                        "left_out": [{"cell": c, "why": why} for c, why in shard.left_out], "kit": kit_identity(),
                        **({"fill": args.fill, "rerun_unexplained": bool(args.rerun_unexplained)} if args.fill else {})}
    if sources:
        doc["sources"] = {co.label: {"path": str(co.path), "commit": co.commit, "version": co.version} for co in map(sglang_source.checkout, sources)}
    for line in write_outputs(out_dir, doc, columns):
        log(f"history: {line}")
    log(f"history: {out_dir / 'history.json'} and {out_dir / 'history.html'}")
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(rows, columns))
        verdict = f"{len(failed)} of {len(columns)} releases failed ({', '.join(failed)})" if failed else f"all {len(columns)} releases passed"
        print(f"history: {verdict} in {time.monotonic() - start:.0f} s; venvs in {venv_dir}")
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--releases", help="comma list of SGLang releases, e.g. 0.5.12,0.5.13")
    p.add_argument("--sglang-source", metavar="PATH", help="also an SGLang git checkout (column src-<commit>): its python/ installed --no-deps in a venv keyed by its commit")
    p.add_argument("--venv-dir", help=f"where the per-release venvs live (default: ${VENVS_ENV} or ~/.cache/hybrid-conformance/venvs)")
    p.add_argument("--tier", choices=("premerge", "standard", "nightly"), default="premerge",
                   help="matrix tier of the pool tier, plan --validate and the --with-sglang-cpu cells (default: %(default)s)")
    p.add_argument("--budget", help="with --with-sglang-cpu: the request programs' budget per cell (ci, standard, premerge, nightly, N, Ns; "
                   "default: the run's own for the tier)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--checks", help=f"comma list of {', '.join(CHECKS)} (default: all; machine is the pool tier's state machine)")
    p.add_argument("--with-sglang-cpu", action="store_true", help="also run the sglang-cpu target's premerge set where it can run")
    p.add_argument("--models", help="with --with-sglang-cpu: only these models' cells (comma list of ids, families or twins; "
                   "default: all), so one release's server rows can run in parts")
    p.add_argument("-n", dest="workers", default=None, help="with --with-sglang-cpu: pytest-xdist workers of each release's server run "
                   "(as run's -n; default: min(2, cores); each runs one server at a time)")
    p.add_argument("--shard", metavar="K/N", help="only shard K of tonight's N (plan --releases ... --shards N prints them): each release's "
                   "part of it, the server rows with --with-sglang-cpu implied (conformance/commands/night_plan.py)")
    p.add_argument("--night", help="with --shard: the night's date, YYYY-MM-DD (default: today, UTC), as plan --night")
    p.add_argument("--fill", metavar="HISTORY_JSON", help="with --shard: shard K of the plan that fills what this (merged) history.json "
                   "still lacks (plan --releases ... --fill FILE prints it)")
    p.add_argument("--rerun-unexplained", action="store_true", help="with --fill: as plan --rerun-unexplained (the same plan)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="instead: merge these shards' --out folders into one history.json and "
                   "history.html under --out (conformance/commands/history_merge.py)")
    p.add_argument("--previous", metavar="FILE", help="with --merge: the last night's history.json, for the FAILs new since then")
    p.add_argument("--leads-dir", metavar="DIR", help="with --merge: copy the programs' FAILs no known bug explains here (fixtures/leads locally)")
    p.add_argument("--reinstall", action="store_true", help="rebuild each release's venv")
    p.add_argument("--out", default="reports/history", help="where history.json, history.html and FAILs' replay files go (default: %(default)s)")
    p.add_argument("--bisect", metavar="ID", help="instead: find the first bad and first good release of a known bug (fixtures/known_bugs.toml) "
                   "by replaying its program file in each release's venv (default releases: those with a venv); conformance/commands/bisect.py")
    p.add_argument("--write", action="store_true", help="with --bisect: write the bracket into the entry's measured lines")
    p.add_argument("--peer-kits", metavar="ID,...|all", help="instead: play SGLang's own test kits, as each release ships them, on each known "
                   "bug's cell on its bad and good release, beside the kit's replay: the peer baseline (conformance/commands/peer_kits.py)")
    p.add_argument("--doc", metavar="FILE", help="with --peer-kits: write the table page here (docs/peer-baseline.md) instead of printing it")


def write_outputs(out_dir: Path, doc: dict, releases: Sequence[str]) -> list[str]:
    """history.json (the --format json document) and history.html (release x check grid),
    and a bug folder (``bugs/ID/``, as ``report-bug`` writes it; nothing is started) for each
    known SGLang bug a FAIL row was matched to, listed in ``doc["known_bugs"]``; returns one
    line per bug folder (written, or why not)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [Row(**r) for r in doc["rows"]]
    hits = row_hits(rows, {b.id: b.to_json() for b in load_known_bugs()})
    written = write_hit_folders(hits, out_dir, options_from_args(argparse.Namespace()))
    doc["known_bugs"] = [hit.to_json() for hit, _ in written]
    (out_dir / "history.json").write_text(json.dumps(doc, indent=2))
    (out_dir / "history.html").write_text(render_html(rows, releases, doc.get("probes", {}), base=out_dir, extra=doc))
    return [line for _, line in written]
