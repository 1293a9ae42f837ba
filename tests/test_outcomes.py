"""Every outcome reaches report.json: a test that raises (error), a skip without a verdict,
a failing verdict, a server that dies (teardown finding, server block), an early stop
(incomplete, which cells did not fully run), an empty selection; and the test counts in
report.json equal junit.xml's and pytest's own, with and without xdist."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.matrix.cells import load_matrix
from conformance.report.outcomes import Outcomes, cell_of_nodeid, check_of

STANDIN = Path(__file__).parent / "standins" / "server.py"
SELECT = ("--models", "falcon-h1", "--strategies", "extra_buffer", "--page-sizes", "1")

SUITE = """
import pytest
from conformance.records import Verdict

@pytest.mark.kl
def test_a_raises(endpoint, record_verdict):
    raise RuntimeError("boom in the workload")

@pytest.mark.prefix_branching
def test_b_skips_without_verdict(endpoint):
    pytest.skip("nothing to branch here")

@pytest.mark.gsm8k
def test_c_fails_with_verdict(endpoint, record_verdict):
    v = record_verdict(Verdict("gsm8k", "fail", {"n": 1}, "answers differ"))
    pytest.fail(v.summary(), pytrace=False)

@pytest.mark.leaks
def test_d_kills_its_server(endpoint, record_verdict):
    record_verdict(Verdict("leaks", "pass", {"mamba_used_at_idle": 0}))
    endpoint.process.stop()
"""


def _junit_counts(path: Path) -> dict[str, int]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failures, errors, skipped = (int(suite.get(k)) for k in ("failures", "errors", "skipped"))
    return {"passed": int(suite.get("tests")) - failures - errors - skipped, "failed": failures, "skipped": skipped, "errors": errors}


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[pytest.RunResult, dict]:
    monkeypatch.setenv("HYBRID_CONFORMANCE_REFERENCE_SERVER", str(STANDIN))
    pytester.makepyfile(test_suite=SUITE)
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess(*SELECT, f"--report-dir={rep}", f"--junitxml={rep / 'junit.xml'}", "-p", "no:cacheprovider", *extra)
    return result, json.loads((rep / "report.json").read_text())


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_every_outcome_reaches_the_report(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, xdist: bool) -> None:
    result, report = _run(pytester, monkeypatch, *(["-n", "2", "--dist", "loadgroup"] if xdist else []))
    assert len(report["cells"]) == 1
    checks = report["cells"][0]["checks"]
    assert checks["kl"]["status"] == "error" and "boom in the workload" in checks["kl"]["reason"]
    assert checks["prefix_branching"] == {"status": "skip", "metrics": {"requests": None, "hits_expected": None, "hits_observed": None, "mismatches": None}, "reason": "nothing to branch here"}
    assert checks["gsm8k"]["status"] == "fail" and checks["gsm8k"]["reason"] == "answers differ"
    assert checks["leaks"]["status"] == "pass"
    assert checks["teardown"]["status"] == "fail" and "not serving" in checks["teardown"]["reason"]
    server = report["cells"][0]["server"]
    assert server["alive_at_end"] is False and "exited" in server["exit_reason"]
    assert report["summary"] == {"pass": 1, "fail": 2, "skip": 1, "error": 1}
    # test counts: as pytest counts them, as junit.xml counts them
    assert report["tests"] == {"passed": 1, "failed": 2, "skipped": 1, "errors": 1}
    result.assert_outcomes(passed=1, failed=2, skipped=1, errors=1)
    assert _junit_counts(pytester.path / "rep" / "junit.xml") == report["tests"]
    assert report["complete"] is True and report["cells_not_run"] == [] and report["launches"] == 1
    md = (pytester.path / "rep" / "report.md").read_text()
    html = (pytester.path / "rep" / "report.html").read_text()
    line = "checks: 1 pass, 2 fail, 1 skip, 1 error; tests: 1 passed, 2 failed, 1 skipped, 1 errors"
    assert line in md and line in html
    assert set(report["versions"]) >= {"kit", "sglang", "torch", "transformers"}


def test_an_early_stop_is_incomplete_and_names_the_cell(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, report = _run(pytester, monkeypatch, "-x")
    cid = report["cells"][0]["id"]
    assert report["complete"] is False
    assert any("did not run" in r for r in report["incomplete_reasons"])
    assert report["cells_partly_run"] == [cid]
    assert "INCOMPLETE" in (pytester.path / "rep" / "report.md").read_text()


def test_an_empty_selection_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(cell):\n    pass\n")
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess("--page-sizes", "3", f"--report-dir={rep}", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*no matrix cell matches the selection (target reference, tier standard, page_sizes=3)*"])
    report = json.loads((rep / "report.json").read_text())
    assert report["complete"] is False and "no matrix cell matches the selection" in report["incomplete_reasons"]


def test_cell_of_nodeid_takes_the_longest_id_on_separators() -> None:
    ids = [c.id for c in load_matrix().cells]
    lazy = "qwen3-next-80b-extra_buffer_lazy-p1-t256"
    assert cell_of_nodeid(f"conformance/suites/kl/test_kl.py::test_kl[{lazy}-lazy_alloc_fail-prefill_hit]", ids) == f"{lazy}-lazy_alloc_fail"
    assert cell_of_nodeid(f"conformance/suites/kl/test_kl.py::test_kl[{lazy}-prefill_hit]", ids) == lazy
    assert cell_of_nodeid("tests/test_x.py::test_y", ids) is None


def test_check_of_prefers_pool_then_check_markers_then_the_suite_folder() -> None:
    assert check_of({"pool", "leaks"}, "conformance/suites/leaks/test_pool_invariants.py::t") == "pool"
    assert check_of({"gsm8k"}, "x.py::t") == "gsm8k"
    assert check_of(set(), "conformance/suites/disagg/test_disagg.py::test_pd_gsm8k[c]") == "disagg"
    assert check_of(set(), "tests/test_x.py::t") == "test"


def test_not_run_lists_tests_without_any_report() -> None:
    o = Outcomes()
    o.expect([("a[c1]", "c1"), ("b[c1]", "c1"), ("a[c2]", "c2")])
    o.reported.add("a[c1]")
    assert o.not_run() == ["b[c1]", "a[c2]"]
    assert o.cells_not_run() == (["c2"], ["c1"])


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_run_writes_an_incomplete_report(tmp_path: Path, sig: str) -> None:
    """Ctrl-C (or a CI cancel's SIGTERM) in the middle of a cell: report.json still gets
    written, says ``complete: false`` and ``interrupted``, and names the unfinished cell."""
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "started"
    (tmp_path / "test_slow.py").write_text(
        "import time\nfrom pathlib import Path\nfrom conformance.records import Verdict\n"
        "def test_a(endpoint, record_verdict):\n    record_verdict(Verdict('kl', 'pass', {}))\n"
        f"def test_b(endpoint):\n    Path({str(marker)!r}).write_text('x')\n    time.sleep(120)\n"
        "def test_c(endpoint):\n    pass\n"
    )
    rep = tmp_path / "rep"
    env = {**os.environ, "HYBRID_CONFORMANCE_REFERENCE_SERVER": str(STANDIN)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_slow.py"), *SELECT,
                             f"--report-dir={rep}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)
        proc.send_signal(getattr(signal, sig))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((rep / "report.json").read_text())
    assert report["complete"] is False and "interrupted" in report["incomplete_reasons"]
    assert report["cells_partly_run"] == [report["cells"][0]["id"]]
    assert report["cells"][0]["checks"]["kl"]["status"] == "pass"


ALL_SKIP = """
import pytest

@pytest.mark.kl
def test_skips(cell):
    pytest.skip("nothing applies here")
"""


def test_a_run_that_judged_nothing_is_incomplete_and_red(pytester: pytest.Pytester) -> None:
    """Issue 26 finding 8: before, an all-skip run wrote ``complete: true`` and exited 0."""
    pytester.makepyfile(test_x=ALL_SKIP)
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess(*SELECT, f"--report-dir={rep}", "-p", "no:cacheprovider")
    report = json.loads((rep / "report.json").read_text())
    assert report["summary"]["skip"] >= 1 and report["summary"]["pass"] == 0
    assert report["complete"] is False and "nothing was judged: every check of every cell skipped" in report["incomplete_reasons"]
    assert result.ret == 1
    # one judged check makes the same run complete and green
    pytester.makepyfile(test_x=ALL_SKIP + "\n@pytest.mark.leaks\ndef test_passes(cell):\n    pass\n")
    result = pytester.runpytest_subprocess(*SELECT, f"--report-dir={rep}", "-p", "no:cacheprovider")
    report = json.loads((rep / "report.json").read_text())
    assert report["complete"] is True and result.ret == 0


ALL_NOT_APPLICABLE = """
import pytest

@pytest.mark.kl
def test_not_applicable(cell):
    pytest.skip("not applicable: sglang 0.5.99: error: unrecognized arguments: --some-flag")
"""


def test_a_run_whose_every_cell_is_not_applicable_is_incomplete_and_red(pytester: pytest.Pytester) -> None:
    """Before, a run whose every selected cell was not applicable (an option or a strategy the
    release lacks) wrote ``complete: true`` and exited 0: it tested nothing."""
    pytester.makepyfile(test_x=ALL_NOT_APPLICABLE)
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess(*SELECT, f"--report-dir={rep}", "-p", "no:cacheprovider")
    report = json.loads((rep / "report.json").read_text())
    [cell] = report["cells"]
    assert cell["not_applicable"] == "sglang 0.5.99: error: unrecognized arguments: --some-flag" and cell["checks"] == {}
    assert report["complete"] is False and "nothing was judged: every selected cell is not applicable" in report["incomplete_reasons"]
    assert result.ret == 1


TWO_CELLS_SUITE = """
import pytest
from conformance.records import Verdict

@pytest.mark.kl
def test_a_first(endpoint, record_verdict):
    record_verdict(Verdict("kl", "pass", {"n": 1}))
    if endpoint.cell.strategy.name == "no_buffer":
        endpoint.process.stop()  # this cell's server dies after its first test

@pytest.mark.leaks
def test_b_second(endpoint, record_verdict):
    record_verdict(Verdict("leaks", "pass", {"n": 1}))
"""


def test_a_dead_servers_teardown_finding_stays_in_its_cell(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cell whose server died gets the teardown finding; the next cell's tests all run
    (pytest alone would tear the server down while setting up the next cell's first test)."""
    monkeypatch.setenv("HYBRID_CONFORMANCE_REFERENCE_SERVER", str(STANDIN))
    pytester.makepyfile(test_suite=TWO_CELLS_SUITE)
    rep = pytester.path / "rep"
    pytester.runpytest_subprocess("--models", "falcon-h1", "--strategies", "no_buffer,extra_buffer", "--page-sizes", "1",
                                  f"--report-dir={rep}", "-p", "no:cacheprovider")
    report = json.loads((rep / "report.json").read_text())
    cells = {c["id"]: c["checks"] for c in report["cells"]}
    assert len(cells) == 2
    dead = next(cid for cid in cells if "no_buffer" in cid)
    other = next(cid for cid in cells if cid != dead)
    assert cells[dead]["teardown"]["status"] == "fail" and "not serving" in cells[dead]["teardown"]["reason"]
    assert cells[dead]["leaks"]["status"] == "error"  # its second test found the server dead, in its own cell
    assert {k: v["status"] for k, v in cells[other].items()} == {"kl": "pass", "leaks": "pass"}
    assert report["launches"] == 2


KILLED_BY_A_FAILURE_SUITE = """
import pytest
from conformance.records import Verdict

@pytest.mark.kl
def test_a_fails_and_kills(endpoint, record_verdict):
    endpoint.process.stop()  # the server dies during a test that fails for it
    v = record_verdict(Verdict("kl", "fail", {"n": 1}, "server died mid-test"))
    pytest.fail(v.summary(), pytrace=False)

@pytest.mark.leaks
def test_b_second(endpoint, record_verdict):
    assert endpoint.alive()
    record_verdict(Verdict("leaks", "pass", {"n": 1}))
"""


def test_a_server_killed_in_a_failed_test_is_restarted_for_the_cells_later_tests(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A death a failed test already reports (a known SGLang bug that kills the server, say)
    no longer blocks the cell's later suites: they run on a new server, and the report says
    it was restarted and why.  (A death no failure reported still fails the next test.)"""
    monkeypatch.setenv("HYBRID_CONFORMANCE_REFERENCE_SERVER", str(STANDIN))
    pytester.makepyfile(test_suite=KILLED_BY_A_FAILURE_SUITE)
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess("--models", "falcon-h1", "--strategies", "no_buffer", "--page-sizes", "1",
                                           f"--report-dir={rep}", "-p", "no:cacheprovider")
    report = json.loads((rep / "report.json").read_text())
    (cell,) = report["cells"]
    assert cell["checks"]["kl"]["status"] == "fail"
    assert cell["checks"]["leaks"]["status"] == "pass"
    assert "teardown" not in cell["checks"]
    assert report["launches"] == 2 and "exit" in cell["server"]["restarted_after"]
    result.assert_outcomes(passed=1, failed=1)


def _run_one_cell(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, suite: str):
    """Run ``suite`` on the stand-in server's one selected cell: pytest's result and the cell's report."""
    monkeypatch.setenv("HYBRID_CONFORMANCE_REFERENCE_SERVER", str(STANDIN))
    pytester.makepyfile(test_suite=suite)
    rep = pytester.path / "rep"
    result = pytester.runpytest_subprocess(*SELECT, f"--report-dir={rep}", "-p", "no:cacheprovider")
    (cell,) = json.loads((rep / "report.json").read_text())["cells"]
    return result, cell


NOT_IDLE_SUITE = """
import pytest
from conformance.records import Verdict
from conformance.recordings import IdleProbe

@pytest.mark.leaks
def test_leaves_a_probe_not_idle(endpoint, record_verdict):
    record_verdict(Verdict("leaks", "pass", {"mamba_used_at_idle": 0}))
    endpoint.extra.setdefault("idle_probes", []).append(
        IdleProbe("after a seeded scenario", False, {}, 0.1, problems=("mamba: 2 used at idle beyond what sessions hold (used 2, session-held 0): leaked",)))
"""


def test_a_teardown_that_finds_pools_not_idle_files_its_findings_kinds(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scenario's idle probe that did not reach idle fails the cell's teardown: its
    ``teardown`` check carries the findings with their kinds (a known bug may then excuse
    them by kind), once, and the teardown is still an error in pytest's count."""
    result, cell = _run_one_cell(pytester, monkeypatch, NOT_IDLE_SUITE)
    teardown = cell["checks"]["teardown"]
    assert teardown["status"] == "fail" and "pools not idle (after a seeded scenario: mamba: 2 used at idle" in teardown["reason"]
    assert [f["kind"] for f in teardown["details"]["findings"]] == ["leak_mamba"]
    assert cell["checks"]["leaks"]["status"] == "pass"
    result.assert_outcomes(passed=1, errors=1)


DIES_ON_AN_ASSERTION_SUITE = '''
import pytest
from conformance.records import Verdict

TRACE = """Traceback (most recent call last):
  File "/venv/site-packages/sglang/srt/mem_cache/mamba_radix_cache.py", line 556, in cache_unfinished_req
    assert cache_len == page_aligned_len
AssertionError
"""

@pytest.mark.kl
def test_kl_stopped_by_the_death(endpoint, record_verdict):
    endpoint.process.stop()  # the scheduler died on one of SGLang's assertions mid-test
    with open(endpoint.log_path, "a") as log:
        log.write(TRACE)
    endpoint.client.request("GET", "/server_info")  # raises ServerDiedError: no verdict filed

@pytest.mark.leaks
def test_later_suite(endpoint, record_verdict):
    record_verdict(Verdict("leaks", "pass", {"n": 1}))
'''


def test_a_suite_stopped_by_the_servers_death_files_the_death_by_its_kind(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A suite test that raised because the server died (no verdict of its own) files a
    failing verdict of its check whose finding names the death from the log: here SGLang's
    own assertion and where it fired, so a known bug can excuse that kind and no other; it
    is a FAIL, not an untyped error.  The cell's next suite runs on a new server."""
    result, cell = _run_one_cell(pytester, monkeypatch, DIES_ON_AN_ASSERTION_SUITE)
    kl = cell["checks"]["kl"]
    assert kl["status"] == "fail" and kl["reason"].startswith("test test_kl_stopped_by_the_death[")
    (finding,) = kl["details"]["findings"]
    assert finding["kind"] == "server_died:assertion"
    assert finding["facts"] == {"at": "mamba_radix_cache.py:556", "exception": "AssertionError"}
    assert cell["checks"]["leaks"]["status"] == "pass"
    result.assert_outcomes(passed=1, failed=1)
