"""Measured power: per seeded fault, did the scripted suites catch it, the random request
programs, or both -- and how many programs (and seconds) the programs needed.

``hybrid-conformance mutants --programs BUDGET [--seed N] [--programs-only]``: for each
fault the usual scripted plan runs (unless ``--programs-only``), then the programs suite
(``conformance/programs``) on the same cell with the budget and seed and no hypothesis
database (a remembered failure would make the count meaningless).  Caught by programs =
the ``programs`` check of that run failed with a finding of its oracle (a server death
under a program is not one: ``conformance.mutants.scoring``); its ``examples_to_failure``
and ``seconds_to_failure`` are the numbers reported.  A fault whose server died before any
program ran is told apart: caught by SGLang's own strict idle check only when the log
names it (and no re-run with the check off missed it), else not caught.  Both clean runs must pass.

Such a fault is then measured once more on the same cell with SGLang's strict idle check
off (matrix fault :data:`NO_STRICT`, as a production build runs), so the programs' own
idle invariant is scored on it; the row says "strict check off".  That cell has no clean
programs run of its own: the check only kills a server that leaked, so the clean run with
the check on, which passed alive, saw everything the clean run with it off would.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from conformance.mutants.catalogue import MutantPlan
from conformance.mutants.runs import Outcome, run_plan
from conformance.mutants.scoring import CAUGHT, SGLANG_IDLE_CHECK, catcher, category, verdict_lines
from conformance.targets.registry import target_for

#: Why a programs run has no finding when no program was judged at all (the server never served).
NO_REPORT, NO_VERDICT = "no report.json", "no programs verdict"
#: Per-test timeout of a programs run: the budget, shrinking and two server starts.
PROGRAMS_TIMEOUT_S = 3600
#: The matrix fault that switches SGLang's strict idle check off (fixtures/matrix.toml).
NO_STRICT = "no_strict_idle_check"


@dataclass
class Power:
    name: str
    scripted: Outcome | None
    programs: Outcome
    examples: int | None = None
    seconds: float | None = None
    programs_reason: str = ""
    died_at_start: str = ""  # the server the fault ran in died before any program (SGLang's idle check on its warmup request)
    strict_off: bool = False  # the programs numbers are from the re-run with SGLang's strict idle check off

    @property
    def caught_by(self) -> str:
        s = bool(self.scripted and self.scripted.caught)
        p = self.programs_caught
        if self.startup_caught and not p:
            return "SGLang's idle check at start-up" if not s else "scripted, SGLang's idle check at start-up"
        return {(True, True): "both", (True, False): "scripted", (False, True): "programs", (False, False): "neither"}[(s, p)]

    @property
    def programs_caught(self) -> bool:
        return self.examples is not None

    @property
    def startup_caught(self) -> bool:
        """SGLang's own invariant (its strict idle check, named in the log) killed the
        server on its warmup request, and no re-run with that check off missed the fault.
        A start-up death the log does not explain is not a catch."""
        return bool(self.died_at_start) and catcher(self.died_at_start) is not None and not self.strict_off


def programs_reach(plans: dict[str, MutantPlan], console: Console) -> dict[str, MutantPlan]:
    """The faults request programs can reach: a PD fault lives in the transfer between a
    prefill and a decode server, which a program (one server) never makes; a performance
    fault changes no answer, so no oracle can see it.  Each left out is named."""
    out = {}
    for name, plan in plans.items():
        if "disagg" in plan.suites:
            console.print(f"{escape(name)}: not applicable to request programs (a PD transfer fault; programs drive one server); scored by the disagg suite")
        elif plan.suites[:1] == ("perf",) or plan.paired_ab:
            console.print(f"{escape(name)}: not applicable to request programs (a performance fault: every answer is unchanged); scored by " + ("the paired A/B" if plan.paired_ab else "compare on the perf suite"))
        else:
            out[name] = plan
    return out


def programs_plan(plan: MutantPlan, *, budget: str, seed: int, shrink_s: float | None = None) -> MutantPlan:
    """The same cell as ``plan``, with the programs suite instead of the scripted ones."""
    shrink = (f"--shrink-budget={shrink_s:g}",) if shrink_s is not None else ()
    return dataclasses.replace(
        plan, key=f"{plan.key}:programs", suites=("programs",), stop_at_first=True, timeout_s=PROGRAMS_TIMEOUT_S + 300,
        extra_args=(f"--budget={budget}", f"--seed={seed}", "--program-db=none", f"--timeout={PROGRAMS_TIMEOUT_S}", *shrink,
                    *(a for a in plan.extra_args if a.startswith("--twin-broker="))),  # the command's shared twins
    )


def programs_finding(report_dir: Path) -> tuple[int | None, float | None, str]:
    """(examples to failure, seconds to failure, reason) of a programs run's verdict."""
    path = report_dir / "report.json"
    if not path.exists():
        return None, None, NO_REPORT
    for cell in json.loads(path.read_text()).get("cells", []):
        v = cell.get("checks", {}).get("programs")
        if v is None:
            continue
        m = v.get("metrics", {})
        if v.get("status") == "fail" and m.get("examples_to_failure") is not None:
            reason = v.get("reason", "")
            kind, _ = category(verdict_lines("programs", v))
            if kind != CAUGHT:  # the server died under a program, a hang, a known bug: not a finding of the oracle
                return None, None, f"{kind}, not scored caught: {reason}"
            return int(m["examples_to_failure"]), float(m.get("seconds_to_failure") or 0.0), reason
        return None, None, v.get("reason") or f"{m.get('examples')} programs, {m.get('seconds')}s: nothing found"
    return None, None, NO_VERDICT


def strict_off_plan(plan: MutantPlan) -> MutantPlan | None:
    """``plan`` on the same cells with SGLang's strict idle check off (the matrix lays that
    fault over any clean cell: same tier, options and pages); None when the cell already
    carries a matrix fault (one per cell) or is not a real-SGLang cell."""
    if not target_for(plan).loads_kit_plugins() or plan.faults not in (None, "none"):
        return None
    model_strategy, _, suites = plan.key.partition(":")
    return dataclasses.replace(plan, key=f"{model_strategy}+{NO_STRICT}:{suites}", faults=NO_STRICT)


def measure(plans: dict[str, MutantPlan], *, budget: str, seed: int, report_dir: Path, programs_only: bool = False,
            shrink_s: float | None = None) -> tuple[list[tuple[str, Outcome]], list[Power]]:
    """Clean runs (scripted and programs, once per cell) then every fault both ways."""
    clean: list[tuple[str, Outcome]] = []
    cells = {p.key: p for p in plans.values()}
    for plan in cells.values():
        if not programs_only:
            clean.append((plan.key, run_plan(plan, None, report_dir)))
        pp = programs_plan(plan, budget=budget, seed=seed, shrink_s=shrink_s)
        clean.append((pp.key, run_plan(pp, None, report_dir)))
    rows = []
    for name, plan in plans.items():
        scripted = None if programs_only else run_plan(plan, name, report_dir)
        pp = programs_plan(plan, budget=budget, seed=seed, shrink_s=shrink_s)
        prog = run_plan(pp, name, report_dir)
        examples, seconds, reason = programs_finding(report_dir / name / pp.key)
        died = next((b for b in prog.by if b.startswith("server died")), "") if reason in (NO_REPORT, NO_VERDICT) else ""
        row = Power(name, scripted, prog, examples, seconds, reason, died)
        lenient = strict_off_plan(plan) if died else None
        if lenient is not None:
            pp = programs_plan(lenient, budget=budget, seed=seed, shrink_s=shrink_s)
            row.programs = run_plan(pp, name, report_dir)
            row.examples, row.seconds, row.programs_reason = programs_finding(report_dir / name / pp.key)
            row.strict_off = True
        rows.append(row)
    return clean, rows


def write_json(path: Path, target: str, budget: str, seed: int, clean: list[tuple[str, Outcome]], rows: list[Power]) -> None:
    """The table as data (``<report-dir>/mutants.json``): per fault, who caught it -- the
    scripted suites' category and named checks, the programs' finding or SGLang's invariant,
    examples and seconds to failure -- and each clean run's result."""
    def outcome(o: Outcome | None) -> dict | None:
        return None if o is None else {"caught": o.caught, "category": o.category, "caught_by": o.checks, "by": o.by[:5], "fired": o.fired,
                                       "seconds": round(o.seconds, 1)}

    data = {
        "target": target, "programs_budget": budget, "seed": seed,
        "clean": [{"plan": key, "passed": not out.caught, "by": out.by[:5], "seconds": round(out.seconds, 1)} for key, out in clean],
        "faults": {r.name: {"caught_by": r.caught_by, "scripted": outcome(r.scripted),
                            "programs": {"caught": r.programs_caught, "by": catcher(f"programs: {r.programs_reason}") if r.programs_caught else None,
                                         "reason": r.programs_reason[:300], "examples_to_failure": r.examples,
                                         "seconds_to_failure": None if r.seconds is None else round(r.seconds, 1),
                                         "strict_idle_check_off": r.strict_off, "died_at_start": r.died_at_start[:300] or None,
                                         "startup_caught": r.startup_caught}}
                   for r in rows},
    }
    path.write_text(json.dumps(data, indent=1))


def render(target: str, budget: str, seed: int, clean: list[tuple[str, Outcome]], rows: list[Power], console: Console) -> int:
    table = Table(title=f"mutants: target={target}, scripted suites vs request programs (budget {budget}, seed {seed})")
    for col in ("fault", "scripted", "programs", "caught by", "examples to failure", "seconds to failure"):
        table.add_column(col)
    clean_ok = True
    for key, out in clean:
        clean_ok &= not out.caught
        table.add_row(escape(f"clean [{key}]"), "", "[green]passes[/]" if not out.caught else f"[red]FAILS: {escape('; '.join(out.by[:2]))}[/]", "", "", f"{out.seconds:.0f}s")
    for r in rows:
        scripted = "-" if r.scripted is None else ("[green]caught[/]" if r.scripted.caught else "[red]missed[/]")
        if r.programs_caught:
            via = catcher(f"programs: {r.programs_reason}") or ""  # the oracle's finding, or SGLang's own invariant
            programs = "[green]caught[/]" + (" (SGLang's strict idle check off)" if r.strict_off else "") + (f" by {escape(via)}" if "SGLang" in via else "")
        elif r.died_at_start and r.strict_off:
            programs = f"[red]missed with SGLang's strict idle check off[/]: {escape(r.programs_reason[:60])}"
        elif r.died_at_start:
            programs = f"[yellow]no program ran[/]: {escape(r.died_at_start[:90])}"
        else:
            programs = f"[red]missed[/]: {escape(r.programs_reason[:60])}"
        table.add_row(escape(r.name), scripted, programs, r.caught_by, "-" if r.examples is None else str(r.examples),
                      "-" if r.seconds is None else f"{r.seconds:.0f}")
    console.print(table)
    by_programs = sum(r.programs_caught for r in rows)
    by_scripted = sum(bool(r.scripted and r.scripted.caught) for r in rows)
    if not clean_ok:
        console.print("a clean run failed: the scores are void")
    console.print(f"programs caught {by_programs}/{len(rows)}; scripted caught {by_scripted}/{len(rows) if rows and rows[0].scripted else 0}; "
                  f"only programs: {sum(r.caught_by == 'programs' for r in rows)}, only scripted: {sum(r.caught_by == 'scripted' for r in rows)}; "
                  f"server died at start-up (before any program): {sum(bool(r.died_at_start) and not r.programs_caught for r in rows)}, "
                  f"of which SGLang's idle check named: {sum(r.startup_caught and not r.programs_caught for r in rows)}")
    return 0 if clean_ok and all(r.programs_caught or r.startup_caught for r in rows) else 1
