"""A rich progress bar for ``hybrid-conformance run`` (tests done / total, current cell).

A pytest plugin object the CLI passes to ``pytest.main``; it lives in the controller
process (also under xdist, where it counts the workers' reports). Shown only on a
terminal, or with ``HYBRID_CONFORMANCE_PROGRESS=1``; it writes to stderr and vanishes
when the run ends, so pytest's own output and the summary table stay readable.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

_CELL = re.compile(r"\[([^\]@]+)")


def wanted() -> bool:
    flag = os.environ.get("HYBRID_CONFORMANCE_PROGRESS")
    if flag is not None:
        return flag not in ("", "0")
    return sys.stderr.isatty()


class ProgressPlugin:
    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console or Console(file=sys.stderr), transient=True,
        )
        self.task: Any = None
        self.done = 0

    def _start(self, total: int) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("collecting", total=total)

    def pytest_collection_finish(self, session: Any) -> None:
        if not hasattr(session.config, "workerinput"):
            self._start(len(session.items))

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._start(len(ids))

    def pytest_runtest_logreport(self, report: Any) -> None:
        if self.task is None or report.when != "teardown":
            return
        m = _CELL.search(report.nodeid)
        self.done += 1
        self.progress.update(self.task, completed=self.done, description=(m.group(1) if m else report.nodeid)[:60])

    def pytest_sessionfinish(self, session: Any) -> None:
        if self.task is not None:
            self.progress.stop()
            self.task = None
