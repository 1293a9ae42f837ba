"""Explore programs under a budget with hypothesis; shrink a failure; write its replay file.

* ``--budget``: ``ci`` / ``standard`` / ``premerge`` / ``nightly`` (named profiles: examples or
  seconds per cell and the size of the programs drawn; a plain pytest run's default is
  ``ci`` on the premerge tier and ``standard`` above it, sized from the examples the
  catalogue's faults took to fail), a number of examples (``40``) or seconds (``90s``, ``5m``).
* ``--seed``: the run is deterministic given the seed (the k-th program drawn is the
  same on every run; how many are drawn in a time budget depends on the machine).
* the hypothesis database is kept per target and cell (``<db>/<target>/<cell id>``), so
  a failure found once is re-tried first the next time.
* shrinking runs each candidate program on the live server; it gets its own time budget
  (``--shrink-budget``), after which untried candidates count as passing and the
  smallest failing program found so far is the result.  A program that killed the server
  (SGLang's strict idle check) restarts it before the next candidate.

Hypothesis is driven in short rounds of ``ROUND`` examples (each round seeded from the
run's seed) so a time budget stops between rounds; programs already run are remembered,
so a repeat costs nothing and a failing one re-raises its first finding.

Each kind of finding raises its own exception type (``runner.failure_type``), so hypothesis
shrinks each kind apart; the result keeps the first failure as found and the smallest
program that failed with the same kind (other kinds met while shrinking are reported
beside it).  A failure a known SGLang bug explains (``known``) does not end the exploration:
it is kept, and the cell goes on looking for anything else within the same budget.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hyp_seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from conformance.errors import KitError
from conformance.programs.program import Program
from conformance.programs.runner import ProgramFailure, RunStats
from conformance.programs.strategies import GenSpec, programs
from conformance.targets.registry import target_for

ROUND = 4
#: An examples budget whose programs sent no judged request (hypothesis draws the empty
#: program first; a small one may hold only refusals) draws up to this many more.
VACUOUS_EXTRA = 8


@dataclass(frozen=True)
class Budget:
    label: str
    examples: int | None = None
    seconds: float | None = None
    size: str = "small"  # the GenSpec knobs: small (premerge) or large (nightly)
    shrink_s: float = 90.0


PROFILES = {
    "ci": Budget("ci", examples=2, size="small", shrink_s=20.0),  # hypothesis draws the empty program first
    #: a plain pytest run's default from the standard tier up, sized from the examples the
    #: reference catalogue's faults took to fail (``mutants --programs``; docs/fuzzing.md)
    "standard": Budget("standard", examples=8, size="small", shrink_s=20.0),
    "premerge": Budget("premerge", seconds=25.0, size="small", shrink_s=60.0),
    "nightly": Budget("nightly", seconds=600.0, size="large", shrink_s=300.0),
}
SIZES = {
    "small": dict(max_steps=12, decode_budget=96, long_decode=False, max_burst=26, pressure_new=6, hold_new=24, max_holders=3, pressure_budget=96),
    "large": dict(max_steps=18, decode_budget=320, long_decode=True, max_burst=40, pressure_new=16, hold_new=448, max_holders=8,
                  pressure_budget=3600),  # holders whose decodes together outgrow a 4096-token KV pool
}


def default_budget(tier: str | None) -> str:
    """A plain pytest run's budget: ``ci`` for the premerge tier, ``standard`` above it."""
    return "ci" if tier == "premerge" else "standard"


def parse_budget(text: str, *, shrink_s: float | None = None) -> Budget:
    """``ci``, ``standard``, ``premerge``, ``nightly``, ``N`` examples, or ``Ns`` / ``Nm`` seconds; one-line KitError otherwise."""
    t = (text or "").strip().lower()
    if t in PROFILES:
        b = PROFILES[t]
    elif re.fullmatch(r"\d+", t) and int(t) > 0:
        b = Budget(f"{t} examples", examples=int(t))
    elif m := re.fullmatch(r"(\d+(?:\.\d+)?)(s|m)", t):
        secs = float(m.group(1)) * (60 if m.group(2) == "m" else 1)
        if secs <= 0:
            raise KitError(f"--budget: must be positive, got {text!r}")
        b = Budget(f"{m.group(1)}{m.group(2)}", seconds=secs, size="large" if secs >= 300 else "small")
    else:
        raise KitError(f"--budget: expected premerge, nightly, standard, ci, a number of examples (40) or seconds (90s, 5m); got {text!r}")
    return replace(b, shrink_s=shrink_s) if shrink_s is not None else b


def cell_seed(seed: int, cell_id: str) -> int:
    """The generator seed of one cell: ``--seed`` mixed with the cell's id, so cells draw
    different programs and a cell draws the same ones on every run with that ``--seed``."""
    return int(hashlib.sha256(f"{seed}:{cell_id}".encode()).hexdigest()[:12], 16)


def spec_for_size(base: GenSpec, size: str) -> GenSpec:
    return replace(base, **SIZES[size])


@dataclass
class Found:
    """A failing program: ``failure``/``program`` the smallest of the first failure's kind,
    ``first``/``first_program`` the first failure as found, ``others`` one failure of each
    other kind met while shrinking."""

    failure: ProgramFailure
    program: Program
    examples_to_failure: int
    seconds_to_failure: float
    shrink_runs: int = 0
    shrunk_steps: int = 0
    first: ProgramFailure | None = None
    first_program: Program | None = None
    #: one smallest failing program of each other kind, each with its own replay file
    others: list["Found"] = field(default_factory=list)



@dataclass
class Exploration:
    """What one exploration did: ``stats`` per passing program, ``total`` their sum."""

    examples: int = 0
    seconds: float = 0.0
    restarts: int = 0
    finding: Found | None = None
    #: failures a known SGLang bug explains, each with its program (exploration went on past them)
    known: list[Found] = field(default_factory=list)
    replayed_from_db: bool = False
    rounds: int = 0
    stats: list[RunStats] = field(default_factory=list)

    @property
    def total(self) -> RunStats:
        return RunStats.total(self.stats)


class _Stop(BaseException):
    """Leaves hypothesis at once (an infrastructure error, not a finding)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def explore(
    run: Callable[[Program], RunStats],
    spec: GenSpec,
    budget: Budget,
    *,
    seed: int = 0,
    db_dir: Path | None = None,
    ensure_alive: Callable[[], bool] | None = None,
    known: Callable[[ProgramFailure], bool] | None = None,
) -> Exploration:
    """Run random programs until the budget is spent or one fails (then shrink it).

    ``run(program)`` plays one program and raises :class:`ProgramFailure` on a finding;
    any other exception stops the exploration and propagates.  ``ensure_alive()`` is
    called before each program and restarts a dead server (True when it restarted one).
    ``known(failure)``: a known SGLang bug explains every finding of ``failure`` -- kept in
    ``Exploration.known``, counted as a program that ran, and the exploration goes on.
    """
    spec = spec_for_size(spec, budget.size)
    out = Exploration()
    memo: dict[str, ProgramFailure | None] = {}
    t0 = time.monotonic()
    state: dict = {"failed_at": None, "shrink_runs": 0, "by_kind": {}}

    def keep(program: Program, failure: ProgramFailure) -> None:
        """The last failing program of each kind: hypothesis shrinks each kind (exception type)
        on its own and accepts only smaller programs, so the last is its smallest."""
        state["by_kind"][failure.kind] = (program, failure)

    def out_of_time() -> bool:
        if budget.seconds is not None and time.monotonic() - t0 >= budget.seconds:
            return True
        if budget.examples is None or out.examples < budget.examples:
            return False
        # a count of programs that sent nothing judged proves nothing: draw on, a few more at most
        return any(s.requests for s in out.stats) or out.examples >= budget.examples + VACUOUS_EXTRA

    def body(program: Program) -> None:
        key = hashlib.sha256(program.dumps().encode()).hexdigest()
        if key in memo:
            if memo[key] is not None:
                keep(program, memo[key])  # hypothesis replays its smallest failing program last
                raise memo[key]
            return
        failed_at = state["failed_at"]
        if failed_at is None and out_of_time():
            return  # the budget is spent: the rest of this round is not run
        if failed_at is not None and time.monotonic() - failed_at >= budget.shrink_s:
            return  # the shrink budget is spent: untried candidates count as passing
        if ensure_alive is not None and ensure_alive():
            out.restarts += 1
        try:
            stats = run(program)
        except ProgramFailure as failure:
            if known is not None and known(failure):  # a known SGLang bug: keep it, look on for anything else
                memo[key] = None
                if failed_at is None:
                    out.examples += 1
                    out.known.append(Found(failure, program, out.examples, time.monotonic() - t0, first=failure, first_program=program))
                else:
                    state["shrink_runs"] += 1
                return
            memo[key] = failure
            keep(program, failure)
            if failed_at is None:
                state["failed_at"] = time.monotonic()
                out.examples += 1
                out.finding = Found(failure, program, out.examples, time.monotonic() - t0, first=failure, first_program=program)
            else:
                state["shrink_runs"] += 1
            raise failure
        except Exception as e:  # noqa: BLE001 - infrastructure, not a finding
            raise _Stop(e) from e
        memo[key] = None
        if failed_at is None:
            out.examples += 1
            out.stats.append(stats)
        else:
            state["shrink_runs"] += 1

    db = DirectoryBasedExampleDatabase(str(db_dir)) if db_dir is not None else None
    round_no = 0
    try:
        while not out_of_time():
            hyp = settings(
                max_examples=ROUND,  # body() stops at the budget; a 1-example round would only redraw the simplest program
                database=db, deadline=None, verbosity=Verbosity.quiet, print_blob=False, report_multiple_bugs=False,
                phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
                suppress_health_check=list(HealthCheck),
            )
            # settings go on after @seed, which would otherwise switch the example database off
            test = hyp(hyp_seed(seed * 1_000_003 + round_no)(given(programs(spec))(body)))
            round_no += 1
            before = out.examples
            try:
                test()
            except ProgramFailure:
                break
            if out.examples == before and round_no > 3 * ROUND:
                break  # hypothesis keeps drawing programs it already ran: the space is exhausted
    except _Stop as stop:
        raise stop.error from None
    finally:
        out.seconds = time.monotonic() - t0
        out.rounds = round_no
        if out.finding is not None:
            kind = out.finding.failure.kind
            out.finding.program, out.finding.failure = state["by_kind"][kind]
            found = out.finding
            found.others = [Found(f, p, found.examples_to_failure, found.seconds_to_failure) for k, (p, f) in state["by_kind"].items() if k != kind]
            out.finding.shrink_runs = state["shrink_runs"]
            out.finding.shrunk_steps = len(out.finding.program.steps)
    return out


def failure_file(finding: Found, *, out_dir: Path, cell: dict, env: dict[str, str], target: str, seed: int, budget: Budget) -> Path:
    """Write the shrunk program with what it found; returns the file."""
    program = replace(finding.program, cell=cell, env=env, note=finding.failure.what)
    data = program.to_json()
    first = finding.first or finding.failure
    data["finding"] = {
        "step": finding.failure.step,
        "what": finding.failure.what,
        "kind": finding.failure.kind,
        "findings": [f.to_json() for f in finding.failure.findings],
        "first": {"step": first.step, "what": first.what, "kind": first.kind},
        "trace": finding.failure.trace[-60:],
        "target": target,
        "seed": seed,
        "budget": budget.label,
        "examples_to_failure": finding.examples_to_failure,
        "seconds_to_failure": round(finding.seconds_to_failure, 1),
        "shrink_runs": finding.shrink_runs,
    }
    digest = hashlib.sha256(program.dumps().encode()).hexdigest()[:10]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{cell.get('id', 'cell')}-{digest}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def replay_command(path: Path, target: str, dtype: str | None = None) -> str:
    return f"hybrid-conformance replay {path} --target {target}{target_for(target).replay_options(dtype)}"
