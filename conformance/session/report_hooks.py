"""The pytest hooks that gather every outcome of a run and write its report.

Registered by ``conformance.plugin`` (``pytest_plugins``). Each test bound to a cell is
tagged with its cell before setup (so every report names it) and refused in one line
when preflight found a need missing; the controller (also under xdist) learns which
tests were collected, feeds every test and collection report to
:class:`~conformance.report.outcomes.Outcomes`, and at the end writes report.json and friends
(``conformance.report.run_report``). With ``HYBRID_CONFORMANCE_PREFLIGHT_ONLY`` the run stops after
collection and preflight.
"""

from __future__ import annotations

import json
import time

import pytest

from conformance.report import phases
from conformance.report.phases import suite_of_nodeid
from conformance.report.outcomes import TEARDOWN_PROPS, cell_json, cell_of_item, cell_of_nodeid, one_line
from conformance.session.run_state import run_state
from conformance.session.preflight import preflight_only
from conformance.session.preflight import item_failures
from conformance.targets.launcher import install_signal_handlers
from conformance.report.run_report import NOTHING_JUDGED_PREFIX, write_run_report

_CONFIG_REF: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    item.user_properties.append((phases.PROPERTY, {"when": call.when, **phases.take()}))  # this phase's timings
    if call.when == "teardown" and TEARDOWN_PROPS:
        item.user_properties.extend(TEARDOWN_PROPS)
        TEARDOWN_PROPS.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tag the test with its cell (every report then names it); refuse, in one line and
    before any fixture starts a server, a test whose need preflight found missing."""
    state = run_state(item.config)
    cell_obj = cell_of_item(item)
    if cell_obj is not None and not any(k == "hc_cell" for k, _ in item.user_properties):
        item.user_properties.append(("hc_cell", json.dumps(cell_json(cell_obj, state.options))))
    reason = state.preflight_failures.get(item.nodeid)
    if reason:
        pytest.fail(f"preflight: {reason}", pytrace=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Find, per collected test, a need this machine lacks (preflight); stop after it
    when asked (``HYBRID_CONFORMANCE_PREFLIGHT_ONLY``); expect every test's report."""
    state = run_state(session.config)
    state.preflight_failures = item_failures(session.items, state.options)
    if not hasattr(session.config, "workerinput"):
        state.collected_at = time.time()
        state.outcomes.expect((item.nodeid, getattr(cell_of_item(item), "id", None)) for item in session.items)
        if preflight_only():
            lines = sorted(set(state.preflight_failures.values()))
            msg = f"preflight only: {len(session.items)} tests collected" + (f"; missing: {lines[0]}" if lines else "; every need met")
            pytest.exit(msg, returncode=1 if lines else 0)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Under xdist: the controller learns the collected test ids from the first worker."""
    config = _CONFIG_REF.get("config")
    if config is None:
        return
    state = run_state(config)
    if state.outcomes.collected:
        return
    known = [c.id for c in state.get_matrix().cells]
    state.collected_at = time.time()
    state.outcomes.expect((nodeid, cell_of_nodeid(nodeid, known)) for nodeid in ids)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    config = _CONFIG_REF.get("config")
    if config is not None and report.failed:
        run_state(config).outcomes.add_collect_error(report.nodeid, one_line(report))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collect every outcome (also from xdist workers) in the controller."""
    config = _CONFIG_REF.get("config")
    if config is None or hasattr(config, "workerinput"):
        return
    state = run_state(config)
    state.outcomes.add(report)
    timed = next((dict(v) for k, v in report.user_properties if k == phases.PROPERTY and v.get("when") == report.when), {})
    timed.pop("when", None)
    state.phases.add(suite_of_nodeid(report.nodeid), report.when, report.duration, timed)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG_REF["config"] = session.config
    install_signal_handlers()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # xdist worker: the controller writes the report
        return
    state = run_state(config)
    state.exitstatus = int(exitstatus)
    state.phases.add("(controller)", "teardown", 0.0, phases.take())  # what the controller timed itself (e.g. cold twins it hosts)
    if state.options.report_dir is None:
        return
    report = write_run_report(state, wall_s=time.time() - state.started)
    if any(r.startswith(NOTHING_JUDGED_PREFIX) for r in report.get("incomplete_reasons", ())) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a run that judged nothing is red, not green
