"""The pytest plugin (entry point ``pytest11``): options, markers, cells, one server per cell.

Order of this module: ``pytest_addoption`` (the options are declared once, in
``conformance.session.options``), ``pytest_configure`` (markers), option resolution,
parametrisation, fixtures. The run state lives in ``conformance.session.run_state``.

* A test that asks for ``cell`` is parametrised over the selected matrix cells
  (session scope, so pytest groups a cell's tests together and the cell's server
  is started once and shared by every check of that cell).
* ``endpoint`` starts the cell's server on the selected target; every launch is
  recorded, so a run can prove ``launches == distinct cells``.
* Tests marked ``pool`` bind to the in-process pool harness and run whatever the
  server target is; ``--target pool`` runs only them.
* ``record_verdict`` files a check's :class:`~conformance.records.Verdict` under its
  cell; at the end of the run the controller writes ``report.json`` (and friends)
  to ``--report-dir``. Verdicts travel as ``user_properties`` so xdist works.
  The hooks that gather every outcome and write the report are in
  ``conformance.session.report_hooks`` (registered below through ``pytest_plugins``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator

import pytest

from conformance.errors import KitError, ServerDiedError
from conformance.matrix.cells import DEFAULT_TARGET, DEFAULT_TIER, STRATEGIES, Cell, Matrix
from conformance.session.options import PLUGIN_OPTIONS, Options, add_pytest_options, resolve
from conformance.report.outcomes import cell_json, cell_of_item, check_of, note_launch, note_server, note_server_end, note_teardown_verdict
from conformance.checks.findings import failing
from conformance.checks.leaks import death_findings, teardown_verdict
from conformance.records import Verdict
from conformance.report.phases import timed
from conformance.session.cell_servers import CellServers
from conformance.session.run_state import RUN_KEY, RunState, run_state
from conformance.matrix.suites import SUITES, suite_of_module
from conformance.targets.registry import POOL, Target, target_for
from conformance.targets.serving import not_serving
from conformance.sglang_api import probes
from conformance.workloads.gsm8k import load_gsm8k
from conformance.suites.perf import quiet
from conformance.targets.serving import serve_cell
from conformance.targets.option_refusal import log_refusal
from conformance.targets.serving import log_path_for
from conformance.report.run_report import NOT_APPLICABLE_SKIP
from conformance.session.suite_support import idle_probe
from conformance.session.suite_support import idle_deadline
from conformance.workloads.cell_store import CellStore
from conformance.session.known_bugs import expect, installed_release

#: The report hooks, perf selection and quiet mode, the request-program suite's options and marker, and its run-wide cache-off twins.
pytest_plugins = ["conformance.session.report_hooks", "conformance.suites.perf.selection", "conformance.suites.perf.quiet", "conformance.programs.options",
                  "conformance.programs.cold_twins"]

#: This process's open cell servers (``endpoint``).
_CELL_SERVERS = CellServers()
_FAILED_CELLS: set[str] = set()  # cells (in this process) where a test failed

def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybrid-conformance", "hybrid-conformance: Mamba state caching conformance")
    add_pytest_options(g, PLUGIN_OPTIONS)
    parser.addini("hybrid_conformance_target", "default --target", default=DEFAULT_TARGET)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lazy_alloc_fail: cells with SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1 injected")
    config.addinivalue_line("markers", "premerge: cells in the premerge set (they also run nightly)")
    config.addinivalue_line("markers", "nightly: cells in the nightly set")
    config.addinivalue_line("markers", "gpu: needs a GPU (target sglang)")
    config.addinivalue_line("markers", "cpu: runs on CPU (reference target, pool tier)")
    config.addinivalue_line("markers", "pool: the in-process pool tier over SGLang's real memory classes")
    config.addinivalue_line("markers", "disagg_transfer_fail: PD cells with SGLANG_TEST_DISAGG_FAILURE_PROB on the decode server")
    config.addinivalue_line("markers", "forced_retract: cells with SGLang's SGLANG_TEST_RETRACT=1 (every 3rd decode step retracts)")
    config.addinivalue_line("markers", "release_range: runs hybrid-conformance history over SGLang releases in their own venvs (tests/test_release_range.py)")
    for name, gate in target_for(config.getoption("target", None) or DEFAULT_TARGET).session_plugins().items():
        config.pluginmanager.register(gate, name)  # e.g. the pool tier's: a pool run that ran nothing is not green
    for suite in SUITES.values():
        config.addinivalue_line("markers", f"{suite.name}: {suite.help}")
    for s in STRATEGIES:
        config.addinivalue_line("markers", f"{s}: cells of the {s} strategy")
    config.stash[RUN_KEY] = RunState(options=_resolve_options(config))


# ------------------------------------------------------------------ options

def _resolve_options(config: pytest.Config) -> Options:
    """CLI > env > ini (``conformance.session.options.resolve``); a bad value is one UsageError line."""
    try:
        return resolve(config.getoption, ini_target=config.getini("hybrid_conformance_target"))
    except KitError as e:
        raise pytest.UsageError(str(e)) from None


def select_cells(state: RunState, target: str) -> list[Cell]:
    o = state.options
    try:
        return state.get_matrix().select(
            target=target,
            models=o.models,
            strategies=o.strategies,
            faults=o.faults,
            page_sizes=o.page_sizes,
            server_options=o.server_options,
            cells=o.cells,
            tier=o.tier or DEFAULT_TIER,
        )
    except KitError as e:
        raise pytest.UsageError(str(e)) from None


# ------------------------------------------------------------------ parametrisation

def _is_pool_test(definition: Any) -> bool:
    return definition.get_closest_marker("pool") is not None


def _parametrizes_cell_itself(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "cell" in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames or _parametrizes_cell_itself(metafunc):
        return
    state = run_state(metafunc.config)
    pool = _is_pool_test(metafunc.definition)
    target = POOL if pool else target_for(state.options)
    selected = select_cells(state, target.name)
    suite = suite_of_module(metafunc.module.__name__)
    cells = [c for c in selected if c.fault.binds_suite(suite)]
    params = []
    for cell in cells:
        marks = [getattr(pytest.mark, m) for m in cell.markers]
        marks.append(getattr(pytest.mark, target.marker))
        marks.append(pytest.mark.xdist_group(cell.id))
        params.append(pytest.param(cell, id=cell.id, marks=marks))
    if not selected:  # an empty selection is a failure of the run, never a silent skip
        params = [pytest.param(None, id="no-cell")]
    elif not params:  # every selected cell is for other suites (its matrix fault's ``suites``): a stated skip
        why = "; ".join(sorted({f"fault {c.fault.name} binds only {', '.join(c.fault.suites)}" for c in selected}))
        params = [pytest.param(None, id="no-cell-of-this-suite", marks=pytest.mark.skip(reason=f"not applicable: {why}"))]
    metafunc.parametrize("cell", params, indirect=True, scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """--target pool runs only the pool tier; server suites need a server target."""
    state = run_state(config)
    pool_only = not target_for(state.options).serves_http()
    keep, drop = [], []
    for item in items:
        is_pool = item.get_closest_marker("pool") is not None
        binds_server = "endpoint" in getattr(item, "fixturenames", ())
        if pool_only and binds_server and not is_pool:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> list[str]:
    o = run_state(config).options
    sel = ", ".join(f"{k}={v}" for k, v in (("models", o.models), ("strategies", o.strategies), ("faults", o.faults), ("page_sizes", o.page_sizes), ("tier", o.tier)) if v)
    lines = [f"hybrid-conformance: target={o.target}" + (" twins" if o.twins else "") + (f"; {sel}" if sel else "")]
    if not target_for(o).serves_http():  # the pool tier: the release's feature probes, one line (conformance.sglang_api.probes)
        lines.append(f"hybrid-conformance: {probes.probe().summary()}")
    return lines


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="session")
def cell(request: pytest.FixtureRequest) -> Cell:
    """The matrix cell this test runs against (session scope: shared by the cell's tests)."""
    value = getattr(request, "param", None)
    if value is None:
        o = run_state(request.config).options
        sel = ", ".join(f"{k}={','.join(map(str, v))}" for k, v in (("models", o.models), ("strategies", o.strategies), ("faults", o.faults), ("page_sizes", o.page_sizes)) if v)
        pytest.fail(f"no matrix cell matches the selection (target {o.target}, tier {o.tier or DEFAULT_TIER}{', ' + sel if sel else ''})", pytrace=False)
    return value


@pytest.fixture(scope="session")
def conformance_options(pytestconfig: pytest.Config) -> Options:
    return run_state(pytestconfig).options


@pytest.fixture(scope="session")
def gsm8k_data(conformance_options: Options) -> Any:
    """GSM8K from --gsm8k-dir / HYBRID_CONFORMANCE_GSM8K_DIR (sha256-checked), else datasets."""
    try:
        return load_gsm8k(conformance_options.gsm8k_dir)
    except KitError as e:
        problem = str(e)
    pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def matrix(pytestconfig: pytest.Config) -> Matrix:
    return run_state(pytestconfig).get_matrix()


@pytest.fixture
def endpoint(cell: Cell, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A healthy server for ``cell`` on the selected target, started once per cell and kept
    until the teardown of the cell's last test (``conformance.session.cell_servers``: a teardown
    finding is then that cell's).  A launch that cannot happen is one line, never a traceback."""
    start = lambda stack: _start_endpoint(cell, request, tmp_path_factory, stack)  # noqa: E731
    ep = _CELL_SERVERS.get(cell.id, start)
    dead = _dead_reason(ep) if cell.id in _FAILED_CELLS else None
    if dead:  # an earlier test of the cell failed with (or before) the death: the rest get a new server
        with contextlib.suppress(KitError):  # its teardown finding ("not serving") is that failure's
            _CELL_SERVERS.close(cell.id)
        ep = _CELL_SERVERS.get(cell.id, start)
        note_server(request, cell, ep.info, restarted_after=dead[:300])
    return ep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Remember the cells where a test failed: a server found dead after that is restarted
    for the cell's later tests, since the failure already reports the death; a death no
    failure reported fails the next test ("server is not serving") first."""
    report = yield
    cell = cell_of_item(item)
    if report.failed and cell is not None:
        _FAILED_CELLS.add(cell.id)
        if call.excinfo is not None and call.excinfo.errisinstance(ServerDiedError):
            _file_death(item, report, cell, str(call.excinfo.value))
    return report


def _file_death(item: pytest.Item, report: pytest.TestReport, cell: Cell, error: str) -> None:
    """A suite's test that the server's death stopped files a failing verdict of its check
    whose findings name the death by its log (``checks.leaks.death_findings``: SGLang's own
    assertion, an exception in SGLang, its idle check, or nothing the log explains), so the
    row has a kind a known bug can excuse (only its own), instead of an untyped error.  A
    test that already filed a failing verdict, or has no served endpoint, is left as it is."""
    endpoint = getattr(item, "funcargs", {}).get("endpoint")
    if endpoint is None or not hasattr(endpoint, "log_text"):
        return
    check = check_of(getattr(item, "keywords", {}) or {}, item.nodeid)
    filed = [json.loads(v) for k, v in report.user_properties if k == "hc_verdict"]
    if any(f["check"] == check and f["verdict"].get("status") == "fail" for f in filed):
        return
    line = f"test {item.name}: {(error.splitlines() or ['server died'])[0]}"
    try:
        log_text = endpoint.log_text()
    except OSError:
        log_text = ""
    verdict = failing(check, death_findings(line, log_text), {"server_died": 1}, reason=line)
    report.user_properties.append(filed_verdict(verdict, cell, run_state(item.config).options)[1])


def filed_verdict(verdict: Verdict, cell: Cell | None, options: Options) -> tuple[Verdict, tuple[str, str]]:
    """``verdict`` as the report files it (a failure a known SGLang bug explains marked so,
    ``fixtures/known_bugs.toml``) and the ``hc_verdict`` user property that carries it."""
    if verdict.status == "fail":
        verdict = expect(verdict, cell=cell.id if cell else None, target=options.target, release=installed_release())
    payload = {"cell": cell_json(cell, options) if cell else None, "check": verdict.check, "verdict": verdict.to_json()}
    return verdict, ("hc_verdict", json.dumps(payload, default=float))


def _start_endpoint(cell: Cell, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, stack: contextlib.ExitStack) -> Any:
    state = run_state(request.config)
    log_dir = state.options.log_dir or tmp_path_factory.getbasetemp() / "server-logs"
    if cell.id in state.not_applicable:  # SGLang already refused it at an earlier test's launch
        _not_applicable(state, cell, state.not_applicable[cell.id])
    _skip_if_options_not_applicable(state, cell, target_for(state.options))
    try:
        with quiet.shared(quiet.shared_dir(request.config, tmp_path_factory)):  # no launch while a perf test times
            ep = stack.enter_context(timed(serve_cell(cell, state.options, log_dir=log_dir), f"{state.options.target} server"))
    except KitError as e:
        problem = str(e)
        refused = log_refusal(cell, log_path_for(cell, log_dir))
        if refused:
            _not_applicable(state, cell, f"SGLang refuses the cell's {'server options' if cell.options else 'strategy for this model'} at start: {refused}")
        pytest.fail(problem, pytrace=False)
    note_launch(request, cell, kind="server")
    note_server(request, cell, ep.info, target=state.options.target, worker=os.environ.get("PYTEST_XDIST_WORKER") or "main")
    _CELL_SERVERS.at_close(cell.id, lambda: _close_endpoint(ep, state.options))
    return ep


def _close_endpoint(ep: Any, options: Options) -> None:
    note_server_end(ep.cell, alive_at_end=ep.alive(), exit_reason=None if ep.alive() else _dead_reason(ep),
                    launch=getattr(ep.process, "launch", None) or None, **ep.extra.get("server", {}))
    _teardown_idle_check(ep, options)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the cell's last test here (the next test has another cell, or none): close
    its server, so its teardown finding is this test's, in its own cell."""
    try:
        return (yield)
    finally:
        cell = cell_of_item(item)
        if cell is not None and _CELL_SERVERS.is_open(cell.id) and getattr(cell_of_item(nextitem), "id", None) != cell.id:
            try:
                _CELL_SERVERS.close(cell.id)
            except KitError as e:
                pytest.fail(str(e), pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An interrupted run (``-x``, a signal) leaves a cell open: close it, and say so."""
    import sys

    for problem in _CELL_SERVERS.close_all():
        print(f"hybrid-conformance: at session end, cell {problem}", file=sys.stderr)


def _not_applicable(state: RunState, cell: Cell, reason: str) -> None:
    """Record the cell as not applicable (report.json ``not_applicable``) and skip its test."""
    state.not_applicable[cell.id] = reason
    pytest.skip(f"{NOT_APPLICABLE_SKIP}{reason}")


def _skip_if_options_not_applicable(state: RunState, cell: Cell, target: Target) -> None:
    """``na`` before launch when the installed SGLang's parser lacks what the cell's
    server-option axes pass (its own line), or, on the CPU target, when the release gates
    the cell's extra-buffer strategy on the device with nothing the kit's plugin answers
    (``Target.option_refusal``)."""
    reason = target.option_refusal(cell)
    if reason:
        _not_applicable(state, cell, reason)


def _dead_reason(ep: Any) -> str | None:
    """None while the cell's server serves (``targets.base.not_serving``: SGLang's ``/server_info``,
    not its ``/health``, which sleeps a second); else the exit status or the log's last error."""
    if not ep.alive():
        return ep.process.exit_reason() if ep.process else "server gone"
    return not_serving(ep.client, log_text=ep.log_text)


def _teardown_idle_check(ep: Any, options: Options) -> None:
    """At cell teardown: every scenario's idle probe, and one last one, must read 0; when not,
    the ``teardown`` verdict (its findings' kinds, a known bug that excuses them) is filed on
    the tearing-down test and the teardown fails."""
    dead = _dead_reason(ep)
    if dead:
        raise KitError(f"cell {ep.cell.id}: server is not serving at teardown: {dead}")
    probes = list(ep.extra.get("idle_probes", []))
    probes.append(idle_probe(ep.client, "cell teardown", requests=0, deadline_s=idle_deadline(ep)))
    bad = [p for p in probes if not p.reached]
    if bad:
        verdict = expect(teardown_verdict(ep.cell.id, bad), cell=ep.cell.id, target=options.target, release=installed_release())
        note_teardown_verdict(ep.cell, options, verdict.to_json())
        raise KitError(verdict.reason)


@pytest.fixture(autouse=True)
def _scenario_idle_probe(request: pytest.FixtureRequest) -> Iterator[None]:
    """Before each test bound to a server: fail at once if it is dead (with why).
    After it: flush, wait for the idle gauges, keep the probe for the leaks suite."""
    if "endpoint" in request.fixturenames:
        ep = request.getfixturevalue("endpoint")
        dead = _dead_reason(ep)
        if dead:
            pytest.fail(f"cell {ep.cell.id}: server is not serving: {dead}", pytrace=False)
    yield
    if "endpoint" not in request.fixturenames or request.node.get_closest_marker("leaks"):
        return
    cell = cell_of_item(request.node)
    ep = _CELL_SERVERS.peek(cell.id) if cell is not None else None  # still open: it closes after this teardown
    if ep is None or _dead_reason(ep):
        return
    try:
        probe = idle_probe(ep.client, f"after {request.node.name}", requests=1, deadline_s=idle_deadline(ep))
    except KitError:
        return
    ep.extra.setdefault("idle_probes", []).append(probe)


@pytest.fixture(scope="session")
def cell_store(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Recordings shared by the run's cells (also across xdist workers)."""
    o = run_state(pytestconfig).options
    if o.report_dir is not None:
        return CellStore(o.report_dir / "shared")
    base = tmp_path_factory.getbasetemp()
    return CellStore((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")


@pytest.fixture
def record_verdict(request: pytest.FixtureRequest) -> Callable[[Verdict], Verdict]:
    """Callable filing a Verdict under the test's cell (for report.json); returns it."""
    cell_obj: Cell | None = request.getfixturevalue("cell") if "cell" in request.fixturenames else None

    def record(verdict: Verdict) -> Verdict:
        verdict, prop = filed_verdict(verdict, cell_obj, run_state(request.config).options)
        request.node.user_properties.append(prop)
        return verdict

    return record
