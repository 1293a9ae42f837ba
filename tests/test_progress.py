"""The run's progress bar counts finished tests and names the current cell."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from conformance.report.progress import ProgressPlugin


def test_progress_counts_teardowns_and_names_the_cell() -> None:
    out = io.StringIO()
    plugin = ProgressPlugin(Console(file=out, force_terminal=True, width=120))
    plugin.pytest_xdist_node_collection_finished(None, ["a", "b"])
    for when in ("setup", "call", "teardown"):
        plugin.pytest_runtest_logreport(SimpleNamespace(when=when, nodeid="conformance/suites/kl/test_kl.py::test_kl[qwen3-next-80b-no_buffer-p1-t256-prefill_hit]@x"))
    task = plugin.progress.tasks[0]
    assert task.completed == 1 and task.total == 2
    assert task.description.startswith("qwen3-next-80b-no_buffer-p1-t256")
    plugin.pytest_sessionfinish(None)
    assert plugin.task is None
