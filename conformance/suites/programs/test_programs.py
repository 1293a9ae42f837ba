"""Randomized request programs against each cell's server, judged after every step.

``pytest conformance/suites/programs -m programs --budget premerge --seed 0`` (or
``hybrid-conformance fuzz``): per cell, hypothesis draws programs (``strategies``), each
is played on the cell's one server (``endpoint``) and every answer is re-computed on the
model's cache-off twin (``bind``).  A finding is shrunk, written as a replayable JSON
file, and the test fails with the finding, the file and the one command that replays it.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Iterator

import pytest

from conformance.errors import KitError
from conformance.programs.bind import FAULT_SWITCHES, gen_spec, restart_if_dead, target_for
from conformance.programs.cold_twins import twins_for
from conformance.programs.coverage import vacuous_pressure
from conformance.programs.explore import cell_seed, Exploration, Found, explore, failure_file, parse_budget, replay_command
from conformance.programs.options import program_options
from conformance.programs.runner import run_program
from conformance.checks.findings import VACUOUS, Finding, failing
from conformance.checks.tree_structure import audits_vacuous
from conformance.checks.held import summary
from conformance.matrix.axes import coverage_required
from conformance.records import Verdict
from conformance.session.known_bugs import explaining, installed_release, load
from conformance.session.suite_support import settle

CHECK = "programs"
pytestmark = [pytest.mark.programs]


@pytest.fixture(scope="session")
def cold_twins(pytestconfig: pytest.Config, conformance_options: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The run's cache-off twins: the xdist controller's, shared by every worker (``cold_twins``)."""
    log_dir = conformance_options.log_dir or tmp_path_factory.getbasetemp() / "server-logs"
    twins = twins_for(pytestconfig, conformance_options, log_dir)
    try:
        yield twins
    finally:
        twins.close()


@pytest.fixture(scope="session")
def cold_start(cell: Any, cold_twins: Any) -> Future:
    """Starts the cell's cache-off twin before ``endpoint`` boots (fixture order)."""
    return cold_twins.start(cell)


def programs_verdict(ex: Exploration, *, budget: str, seed: int, failure: str = "", replay: str = "", file: str = "", cold_twin: str = "",
                     noise: dict[str, Any] | None = None, pressure: tuple[str, ...] = (), also: dict[str, dict[str, str]] | None = None) -> Verdict:
    """The cell's verdict; ``pressure``: the coverage counters this run must have moved (a
    pressure cell at the nightly budget, ``axes.coverage_required``), else it is vacuous;
    ``also``: by kind, the ``failure_file`` and ``replay`` command of each other kind met while shrinking."""
    total = ex.total
    metrics: dict[str, Any] = {
        "examples": ex.examples, "seconds": round(ex.seconds, 1), "requests": total.requests, "hits": total.hits,
        "hits_seen_stored": total.hits_seen_stored,
        "compared_tokens": total.compared_tokens, "idle_checks": total.idle_checks, "restarts": ex.restarts, "seed": seed,
        "max_logprob_gap": total.max_logprob_gap, "max_topk_kl": total.max_topk_kl, "max_flip_margin": total.max_flip_margin,
        **{f"noise_{k}": v for k, v in (noise or {}).items()},  # non-exact mode: what the tolerance was measured from
        "cold_s": round(total.cold_s, 1), "idle_s": round(total.idle_s, 1),
        **{f"permitted_{k}": n for k, n in sorted(total.permissions.items())},
        **{f"model_permitted_{k}": n for k, n in sorted(total.model_permissions.items())},
        "expected_exact": total.expected_exact, "expected_bounded": sum(total.expected_bounded.values()),
        "tree_audits": total.tree_audits, "evict_alls": total.evict_alls,
    }
    details: dict[str, Any] = {"budget": budget, **({"cold_twin": cold_twin} if cold_twin else {}), "expected_hit": expected_hit(total),
                               "reuse": total.reuse.to_json(),  # reported, not judged (checks.reuse)
                               "coverage": total.coverage.to_json(),  # programs.coverage: what SGLang did under pressure
                               **({"evict_all_error": total.evict_all_error} if total.evict_all_error else {})}
    known = [f for k in ex.known for f in k.failure.findings]
    if known:
        metrics["known_failures"] = len(ex.known)
        details["known"] = [{"kind": k.failure.kind, "what": k.failure.what, "program": k.program.summary().splitlines()} for k in ex.known[:5]]
    if ex.finding is not None:
        f = ex.finding
        metrics.update({"examples_to_failure": f.examples_to_failure, "seconds_to_failure": round(f.seconds_to_failure, 1),
                        "shrink_runs": f.shrink_runs, "shrunk_steps": f.shrunk_steps})
        first = f.first or f.failure
        details.update({"failure_file": file, "replay": replay, "program": f.program.summary().splitlines(),
                        "first_failure": {"kind": first.kind, "what": first.what, "step": first.step},
                        **({"also_seen": [{"kind": o.failure.kind, "what": o.failure.what, **(also or {}).get(o.failure.kind, {})}
                                          for o in f.others]} if f.others else {})})
        found = [*f.failure.findings, *(g for o in f.others for g in o.failure.findings), *known]
        return failing(CHECK, found, metrics, details, reason=f"{failure}; replay: {replay}")
    if known:
        return failing(CHECK, known, metrics, details, reason=f"{ex.known[0].failure.what}; replay: {replay}" if replay else ex.known[0].failure.what)
    if ex.examples == 0:
        return failing(CHECK, [Finding(VACUOUS, "no program ran within the budget: nothing was tested")], metrics, details)
    if total.requests == 0:
        return failing(CHECK, [Finding(VACUOUS, "the programs sent no request the oracle could judge")], metrics, details)
    if audits_vacuous(total.tree_audits):
        return failing(CHECK, audits_vacuous(total.tree_audits), metrics, details)
    if total.compared_tokens == 0:
        return failing(CHECK, [Finding(VACUOUS, f"the programs judged {total.requests} request(s) but compared no token with the cold "
                                                "computation: nothing was tested")], metrics, details)
    stayed = vacuous_pressure(total.coverage, pressure)
    if stayed:
        return failing(CHECK, [Finding(VACUOUS, f"a pressure cell whose programs never reached the pressure it is for: {', '.join(stayed)}",
                                       {"coverage": total.coverage.to_json(), "required": list(pressure)})], metrics, details)
    return Verdict(CHECK, "pass", metrics, "", details)


def expected_hit(total: Any) -> str:
    """Whether the hit SGLang owed each judged request was exact (its per-node records) or
    only bounded by the prefix model, and why: the verdict says it per cell."""
    return summary(total.expected_exact, total.expected_bounded)


def known_failure(cell: Any, target: str) -> Any:
    """``failure -> bool``: does an entry of ``fixtures/known_bugs.toml`` in range excuse every
    finding of a program failure on this cell (then the exploration goes on past it)?"""
    release = installed_release()
    bugs = load()
    return lambda failure: all(explaining(f, check=CHECK, cell=cell.id, target=target, release=release, bugs=bugs) for f in failure.findings)


def test_programs(cold_start: Future, endpoint: Any, cell: Any, record_verdict: Any, pytestconfig: pytest.Config, conformance_options: Any) -> None:
    opts = program_options(pytestconfig, conformance_options.report_dir)
    budget = parse_budget(opts.budget, shrink_s=opts.shrink_s)
    try:
        cold = cold_start.result(timeout=900)
    except KitError as e:
        pytest.fail(f"cell {cell.id}: the cache-off twin did not start: {e}", pytrace=False)
    target = target_for(endpoint, cold)
    twin = f"{cold.base_url} pid {cold.pid}"  # the run's one twin for this cold cell (the report shows it is shared)
    db = opts.db_root / endpoint.target / cell.id if opts.db_root else None
    ex = explore(lambda p: run_program(p, target), gen_spec(endpoint, target), budget, seed=cell_seed(opts.seed, cell.id), db_dir=db,
                 ensure_alive=lambda: restart_if_dead(endpoint), known=known_failure(cell, endpoint.target))
    failure = replay = path = ""
    also: dict[str, dict[str, str]] = {}
    found = ex.finding or (ex.known[0] if ex.known else None)
    if found is not None:
        env = {**cell.env, **{k: v for k, v in os.environ.items() if k in FAULT_SWITCHES and v}}
        dtype = getattr(conformance_options, "dtype", None)

        def written(f: Found) -> dict[str, str]:
            file = failure_file(f, out_dir=opts.failures_dir, cell=cell.describe(), env=env, target=endpoint.target, seed=opts.seed, budget=budget)
            return {"failure_file": str(file), "replay": replay_command(file, endpoint.target, dtype)}

        main = written(found)
        path, replay, failure = main["failure_file"], main["replay"], found.failure.what
        also = {o.failure.kind: written(o) for o in found.others}
        restart_if_dead(endpoint)  # leave a serving server to the cell's other tests and its teardown check
    pressure = coverage_required(cell) if budget.size == "large" and target.requests is not None else ()  # nightly-size runs on real SGLang
    settle(record_verdict(programs_verdict(ex, budget=budget.label, seed=opts.seed, failure=failure, replay=replay, file=path, cold_twin=twin,
                                           noise=target.noise, pressure=pressure, also=also)))

