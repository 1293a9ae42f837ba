"""Where a run's time goes: phases timed where they happen, attached to each test's report,
summed by the controller into report.json's ``phases`` (bench/bench_phases.py prints them)."""

from __future__ import annotations

import contextlib
import json
import time

from conformance.report import phases


def test_timed_splits_a_context_into_start_and_stop_and_take_forgets():
    phases.take()
    events = []

    @contextlib.contextmanager
    def server():
        time.sleep(0.05)
        events.append("up")
        yield "ep"
        time.sleep(0.02)
        events.append("down")

    with phases.timed(server(), "x server") as ep:
        assert ep == "ep" and events == ["up"]
    got = phases.take()
    assert events == ["up", "down"]
    assert got["x server: start"] >= 0.05 and 0.02 <= got["x server: stop"] < got["x server: start"]
    assert phases.take() == {}


def test_totals_file_each_suite_and_each_phase():
    totals = phases.PhaseTotals()
    totals.add(phases.suite_of_nodeid("conformance/suites/kl/test_kl.py::test_kl[c]"), "setup", 12.0, {"sglang-cpu server: start": 11.5})
    totals.add(phases.suite_of_nodeid("conformance/suites/kl/test_kl.py::test_kl[c]"), "call", 3.0, {"idle probes": 0.4})
    totals.add(phases.suite_of_nodeid("tests/test_cli.py::test_x"), "call", 1.0, {})
    out = totals.to_json(wall_s=20.0, collection_s=2.5)
    assert out["suites"]["kl"] == {"tests": 1, "setup": 12.0, "call": 3.0}
    assert out["suites"]["tests/test_cli.py"]["call"] == 1.0
    assert out["phases"] == {"idle probes": 0.4, "sglang-cpu server: start": 11.5}
    assert out["wall_s"] == 20.0 and out["collection_s"] == 2.5


def test_a_run_reports_its_phases(pytester):
    """A pytest run of the plugin over the reference target writes ``phases``: the cell's
    server start in the setup of its first test, every idle probe, the suite's call time."""
    pytester.makepyfile(test_one="""
        def test_a(endpoint, record_verdict):
            assert endpoint.client.server_info()
    """)
    result = pytester.runpytest_subprocess("--target", "reference", "--tier", "premerge", "--models", "qwen3-next",
                                          "--strategies", "no_buffer", f"--report-dir={pytester.path / 'r'}", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    got = json.loads((pytester.path / "r" / "report.json").read_text())["phases"]
    assert got["phases"]["reference server: start"] > 0 and got["phases"]["reference server: stop"] >= 0
    assert got["phases"]["idle probes"] > 0
    assert got["suites"]["test_one.py"]["call"] > 0 and got["collection_s"] is not None
