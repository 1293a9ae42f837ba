"""``hybrid-conformance mutants``: run the suites clean and once per seeded fault, print who caught what.

Reference target: each fault of ``conformance.reference.faults.FAULTS`` is switched on
with ``HYBRID_CONFORMANCE_FAULT=<name>`` for the server-tier suites on the cells its plan
names (``catalogue.reference_plans``); caught = a named check reported it
(:mod:`conformance.mutants.scoring`: a finding of a failing check of report.json whose kind
names the fault's effect, the cell teardown's idle check, SGLang's own strict idle check or
assertion); a death, a timeout, a hang, a vacuity, a known bug's xfail or a crash is reported
in its own category, not scored caught.  Per fault, ``<report-dir>/mutants.json`` holds its
category and the checks that caught it (with ``--programs``: the scripted and the programs
outcome side by side, :func:`conformance.mutants.power.write_json`).
Pool target: each fault of ``conformance.mutants.pool_faults`` is loaded as a pytest
plugin (``-p conformance.mutants.pool_faults``) into the pool suite; caught = the pool
suite failed.  The clean run of the same selection must pass, or the score means nothing.
sglang-cpu target: each fault of ``conformance.sglang_plugins.faults`` is loaded into the
real SGLang servers of its plan with ``HYBRID_CONFORMANCE_SGLANG_FAULT=<name>``; caught =
a named check failed, or SGLang's strict idle check killed the server and its log says so,
or, for a plan running the perf suite, ``compare`` flags a perf ratio against the plan's
clean run, or, for a fault whose record says only the paired A/B sees it (``seen_by``), the
paired test flags a server with the fault against a clean one (``perf-ab --fault``; its
clean run is a pair without the fault, which must not be flagged); a fault whose hooks
never fired was not reached, which is a failure too.
A run that times out proved nothing: a fault is then NOT caught and a clean run fails
(one run and its judgement: :mod:`conformance.mutants.runs`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.errors import KitError
from conformance.mutants import power
from conformance.mutants.catalogue import catalogue_for, sglang_cpu_plans
from conformance.mutants.runs import run_plan
from conformance.mutants.scoring import catcher
from conformance.programs.cold_twins import TwinBroker
from conformance.targets.registry import HTTP_TARGETS, MUTANT_TARGETS, target_for
from conformance.programs.explore import parse_budget
from conformance.sglang_api import probes
from conformance.sglang_plugins.faults.catalogue import faults
from conformance.session.preflight import preflight_only
from conformance.targets.launcher import install_signal_handlers


def sglang_not_applicable(names: tuple[str, ...]) -> dict[str, str]:
    """Fault -> SGLang's own line, for each seeded fault whose hook target the installed
    release lacks (``sglang_api.probes``): a renamed symbol makes the fault not applicable,
    reported, not scored."""
    features = probes.probe()
    if not features.importable:
        raise KitError(f"mutants --target sglang-cpu: sglang {features.version} is not importable: {features.import_error}")
    known = faults()
    out = {}
    for name in names:
        line = features.hook_target_missing(h.target for h in known[name].hooks)
        if line:
            out[name] = f"sglang {features.version} has no {line}"
    return out


def write_scores(path: Path, target: str, clean: list, outcomes: list) -> None:
    """Per fault: its category, the named checks that caught it, its lines (``mutants.json``)."""
    data = {
        "target": target,
        "clean": [{"plan": key, "passed": not out.caught, "by": out.by} for key, out in clean],
        "faults": {o.name: {"category": o.category, "caught_by": o.checks, "by": o.by, "fired": o.fired, "seconds": round(o.seconds, 1)}
                   for o in outcomes},
    }
    path.write_text(json.dumps(data, indent=1))


def run_mutants(*, target: str, only: str | None, report_dir: Path, fast: bool = False, console: Console | None = None,
                programs: str | None = None, seed: int = 0, programs_only: bool = False, shrink_s: float | None = None) -> int:
    console = console or Console(width=200)
    catalogue = catalogue_for(target)
    plans = catalogue.plans()
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in names if n not in plans]
        if unknown:
            raise KitError(f"--only: unknown fault {unknown[0]!r}; known: {', '.join(plans)}")
        plans = {n: plans[n] for n in names}
    elif fast:
        plans = {n: dataclasses.replace(p, stop_at_first=True) for n, p in plans.items() if n in catalogue.fast}
    not_applicable: dict[str, str] = {}
    if target_for(target).loads_kit_plugins():  # a cell runs only the suites the selected faults need
        not_applicable = sglang_not_applicable(tuple(plans))
        for name, line in not_applicable.items():
            console.print(f"{escape(name)}: not applicable: {escape(line)}")
        if len(not_applicable) == len(plans):
            raise KitError(f"mutants: no selected fault applies to the installed SGLang ({next(iter(not_applicable.values()))})")
        plans = sglang_cpu_plans(tuple(n for n in plans if n not in not_applicable))
    if preflight_only():  # what would run, and nothing else (the docs test's "as typed" mode)
        for name, plan in plans.items():
            console.print(f"{escape(name)}: {escape(plan.key)} (timeout {plan.timeout_s:.0f}s)")
        console.print(f"preflight only: {len(plans)} faults planned, nothing started")
        return 0
    report_dir.mkdir(parents=True, exist_ok=True)
    install_signal_handlers()  # a SIGTERM unwinds: the running pytest's group and the cold twins are stopped
    with contextlib.ExitStack() as stack:
        if target_for(target).serves_http():  # one cache-off twin per cold cell for every run of this command
            broker = stack.enter_context(contextlib.closing(TwinBroker(report_dir / "twins")))
            plans = {n: dataclasses.replace(p, extra_args=(*p.extra_args, f"--twin-broker={broker.env_value}")) for n, p in plans.items()}
        return _run_plans(target, plans, report_dir, console, programs=programs, seed=seed, programs_only=programs_only, shrink_s=shrink_s,
                          not_applicable=not_applicable)


def _run_plans(target: str, plans: dict, report_dir: Path, console: Console, *, programs: str | None, seed: int, programs_only: bool,
               shrink_s: float | None, not_applicable: dict[str, str]) -> int:
    if programs or programs_only:  # scripted suites vs request programs, per fault (conformance/mutants/power.py)
        budget = programs or "premerge"
        plans = power.programs_reach(plans, console)
        clean, rows = power.measure(plans, budget=budget, seed=seed, report_dir=report_dir, programs_only=programs_only, shrink_s=shrink_s)
        power.write_json(report_dir / "mutants.json", target, budget, seed, clean, rows)
        return power.render(target, budget, seed, clean, rows, console)

    clean_rows = []
    clean_ok = True
    for plan in {p.key: p for p in plans.values()}.values():
        out = run_plan(plan, None, report_dir)
        clean_rows.append((plan.key, out))
        if out.caught:
            clean_ok = False
    outcomes = [run_plan(plan, name, report_dir) for name, plan in plans.items()]

    table = Table(title=f"mutants: target={target}")
    for col in ("fault", "caught by (check: numbers)", "time"):
        table.add_column(col)
    for key, out in clean_rows:
        table.add_row(escape(f"clean [{key}]"), "[green]passes[/]" if not out.caught else f"[red]FAILS: {escape('; '.join(out.by[:3]))}[/]", f"{out.seconds:.1f}s")
    for out in outcomes:
        fired = "" if out.fired is None else f" (fired {out.fired}x)"
        if out.caught:
            named = [b for b in out.by if catcher(b)]
            cell = escape("\n".join(named[:4]))
        elif out.timed_out:
            cell = f"[red]NOT CAUGHT[/] ({escape(out.by[0])})"
        else:
            cell = "[red]NOT CAUGHT[/] " + escape(f"[{out.category}]") + (f": {escape(out.by[0])}" if out.by else "")
        table.add_row(escape(out.name + fired), cell, f"{out.seconds:.1f}s")
    console.print(table)
    write_scores(report_dir / "mutants.json", target, clean_rows, outcomes)
    caught = sum(o.caught for o in outcomes)
    unscored = Counter(o.category for o in outcomes if not o.caught)
    if unscored:
        console.print("not scored as caught: " + ", ".join(f"{n} {kind}" for kind, n in sorted(unscored.items())))
    if not clean_ok:
        console.print("clean run failed: the score is void")
    skipped = f" ({len(not_applicable)} not applicable on this SGLang: {', '.join(not_applicable)})" if not_applicable else ""
    console.print(f"mutation score: {caught}/{len(outcomes)}{skipped}")
    return 0 if clean_ok and caught == len(outcomes) else 1


def cmd_mutants(args: argparse.Namespace) -> int:
    if args.programs:
        parse_budget(args.programs)  # one line before anything starts
        if not target_for(args.target).serves_http():
            served = " or ".join(t for t in MUTANT_TARGETS if t in HTTP_TARGETS)
            raise KitError(f"--programs: the {args.target} tier has no server for request programs; use --target {served}")
    return run_mutants(target=args.target, only=args.only, report_dir=Path(args.report_dir), fast=args.fast,
                       programs=args.programs, seed=args.seed, programs_only=args.programs_only, shrink_s=args.shrink_budget)
