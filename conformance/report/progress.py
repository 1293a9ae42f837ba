"""The progress of ``hybrid-conformance run``: cells done / total, tests done / total, the
time spent and an estimate of the time left.

A pytest plugin object the CLI passes to ``pytest.main``; it lives in the controller
process (also under xdist, where it counts the workers' reports). On a terminal it is a
rich progress bar on stderr that vanishes when the run ends (pytest's output and the
summary table stay readable); elsewhere (CI logs) it prints one line per finished cell.
``HYBRID_CONFORMANCE_PROGRESS=0`` turns it off, ``=1`` forces the bar.

The estimate is the elapsed time over the finished tests' share, weighed by cells: a cell's
first test pays its server start, so tests alone would promise too little time.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from typing import Any, Callable, Iterable, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from conformance.report.outcomes import cell_of_nodeid

ENV = "HYBRID_CONFORMANCE_PROGRESS"


def mode() -> str:
    """``bar`` (a terminal, or ENV=1), ``lines`` (no terminal), ``off`` (ENV=0)."""
    flag = os.environ.get(ENV)
    if flag is not None:
        return "off" if flag in ("", "0") else "bar"
    return "bar" if sys.stderr.isatty() else "lines"


def wanted() -> bool:
    return mode() != "off"


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


class ProgressPlugin:
    """Counts finished tests per cell (a test is finished at its teardown report)."""

    def __init__(self, console: Console | None = None, *, cells: Iterable[str] = (), lines: TextIO | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.cell_ids = tuple(cells)
        self.lines = lines if lines is not None else (sys.stderr if console is None and mode() == "lines" else None)
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[left]}"),
            console=console or Console(file=sys.stderr), transient=True,
        )
        self.task: Any = None
        self.now = now
        self.started = now()
        self.done = 0
        self.total = 0
        self.per_cell: Counter[str] = Counter()
        self.left_in_cell: Counter[str] = Counter()
        self.cells_done = 0

    # ------------------------------------------------------------------ counting
    def _start(self, ids: list[str]) -> None:
        if self.total:
            return
        self.total = len(ids)
        self.per_cell = Counter(c for c in (cell_of_nodeid(i, self.cell_ids) for i in ids) if c)
        self.left_in_cell = Counter(self.per_cell)
        if self.lines is None:
            self.progress.start()
            self.task = self.progress.add_task(self._description(""), total=self.total, left="")
        else:
            print(f"progress: {len(self.per_cell)} cells, {self.total} tests", file=self.lines, flush=True)

    def left_s(self) -> float | None:
        """Seconds left, from the elapsed time and the share done (cells and tests alike)."""
        cells = len(self.per_cell)
        share = (self.cells_done / cells + self.done / self.total) / 2 if cells and self.total else (self.done / self.total if self.total else 0)
        if share <= 0:
            return None
        return (self.now() - self.started) * (1 - share) / share

    def _description(self, current: str) -> str:
        cells = f"cells {self.cells_done}/{len(self.per_cell)}" if self.per_cell else "tests"
        return f"{cells} {current}"[:80]

    # ------------------------------------------------------------------ pytest hooks
    def pytest_collection_finish(self, session: Any) -> None:
        if not hasattr(session.config, "workerinput"):
            self._start([i.nodeid for i in session.items])

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._start(list(ids))

    def pytest_runtest_logreport(self, report: Any) -> None:
        if not self.total or report.when != "teardown":
            return
        self.done += 1
        cell = cell_of_nodeid(report.nodeid, self.cell_ids)
        finished_cell = False
        if cell and self.left_in_cell[cell] > 0:
            self.left_in_cell[cell] -= 1
            if self.left_in_cell[cell] == 0:
                self.cells_done += 1
                finished_cell = True
        left = self.left_s()
        left_text = f"about {_clock(left)} left" if left is not None else ""
        if self.lines is None:
            self.progress.update(self.task, completed=self.done, description=self._description(cell or report.nodeid), left=left_text)
        elif finished_cell:
            print(f"progress: cell {self.cells_done}/{len(self.per_cell)} done ({cell}); tests {self.done}/{self.total}; "
                  f"{_clock(self.now() - self.started)} elapsed, {left_text or 'no estimate yet'}", file=self.lines, flush=True)

    def pytest_sessionfinish(self, session: Any) -> None:
        if self.task is not None:
            self.progress.stop()
            self.task = None
