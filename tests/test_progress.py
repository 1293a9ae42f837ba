"""The run's progress: cells done / total, tests done / total, an estimate of the time left;
a bar on a terminal, one line per finished cell in a log."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from conformance.report.progress import ProgressPlugin

A, B = "qwen3-next-80b-no_buffer-p1-t256", "qwen3-next-80b-extra_buffer-p1-t256"
IDS = [f"conformance/suites/kl/test_kl.py::test_kl[{A}-prefill_hit]@{A}", f"conformance/suites/kl/test_kl.py::test_kl[{A}-decode_hit]@{A}",
       f"conformance/suites/kl/test_kl.py::test_kl[{B}-prefill_hit]@{B}", "tests/test_x.py::test_plain"]


def finish(plugin: ProgressPlugin, nodeid: str) -> None:
    for when in ("setup", "call", "teardown"):
        plugin.pytest_runtest_logreport(SimpleNamespace(when=when, nodeid=nodeid))


def test_the_bar_counts_tests_and_cells_and_estimates_the_time_left() -> None:
    clock = [0.0]
    plugin = ProgressPlugin(Console(file=io.StringIO(), force_terminal=True, width=160), cells=[A, B], now=lambda: clock[0])
    plugin.pytest_xdist_node_collection_finished(None, IDS)
    task = plugin.progress.tasks[0]
    assert task.total == 4 and task.description.startswith("cells 0/2")
    clock[0] = 10.0
    finish(plugin, IDS[0])
    assert task.completed == 1 and task.description.startswith(f"cells 0/2 {A}")
    clock[0] = 20.0
    finish(plugin, IDS[1])  # the first cell is done: half the cells, half the tests in 20 s
    assert task.description.startswith("cells 1/2") and task.fields["left"] == "about 0:20 left"
    plugin.pytest_sessionfinish(None)
    assert plugin.task is None


def test_a_log_gets_one_line_per_finished_cell() -> None:
    out = io.StringIO()
    clock = [0.0]
    plugin = ProgressPlugin(cells=[A, B], lines=out, now=lambda: clock[0])
    plugin.pytest_xdist_node_collection_finished(None, IDS)
    for nodeid in IDS[:3]:
        clock[0] += 30.0
        finish(plugin, nodeid)
    lines = out.getvalue().splitlines()
    assert lines[0] == "progress: 2 cells, 4 tests"
    assert lines[1].startswith(f"progress: cell 1/2 done ({A}); tests 2/4; 1:00 elapsed, about")
    assert lines[2].startswith(f"progress: cell 2/2 done ({B}); tests 3/4")
    assert len(lines) == 3
