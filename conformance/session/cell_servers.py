"""The cell's one server, kept open from the cell's first test to its last in this process.

pytest would tear a session-scoped, cell-parametrized server down lazily, while setting up
the *next* cell's first test: a dead server's or a leaking pool's teardown finding then
lands on that next cell, and that test never runs.  So the plugin keeps each cell's
server here and closes it in the teardown of the cell's last test (``nextitem`` has
another cell, or none): the teardown finding is that test's, in its own cell.

A start that failed (or was found not applicable) is remembered and raised again for the
cell's other tests, as pytest does for a failed session fixture: one launch per cell.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar, cast

#: What a cell's server is to the caller (the plugin keeps endpoints).
T = TypeVar("T")


@dataclass
class _Open(Generic[T]):
    stack: contextlib.ExitStack
    value: T | None = None
    failure: BaseException | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)


class CellServers(Generic[T]):
    """Per process: the cells whose server is open (normally one at a time)."""

    def __init__(self) -> None:
        self._open: dict[str, _Open[T]] = {}

    def get(self, cell_id: str, start: Callable[[contextlib.ExitStack], T]) -> T:
        """The cell's server, started by ``start(stack)`` on first use (what it enters into
        ``stack`` is exited at close); a remembered start failure is raised again."""
        entry = self._open.get(cell_id)
        if entry is None:
            entry = self._open[cell_id] = _Open(contextlib.ExitStack())
            try:
                entry.value = start(entry.stack)
            except BaseException as e:
                entry.failure = e
                entry.stack.close()
                raise
        if entry.failure is not None:
            raise entry.failure.with_traceback(None)
        return cast(T, entry.value)

    def at_close(self, cell_id: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the cell closes, before its server stops (teardown checks)."""
        self._open[cell_id].closers.append(fn)

    def peek(self, cell_id: str) -> T | None:
        """The cell's open server, or None (not started, or its start failed)."""
        entry = self._open.get(cell_id)
        return entry.value if entry is not None and entry.failure is None else None

    def is_open(self, cell_id: str) -> bool:
        return cell_id in self._open

    def close(self, cell_id: str) -> None:
        """Close the cell: its closers (the first exception is raised after the server
        stopped), then its server."""
        entry = self._open.pop(cell_id, None)
        if entry is None:
            return
        problem: BaseException | None = None
        with entry.stack:
            for fn in entry.closers:
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - raised once the server is down
                    problem = problem or e
        if problem is not None:
            raise problem

    def close_all(self) -> list[str]:
        """At session end (an interrupted run included): close every open cell; the problems."""
        problems = []
        for cid in list(self._open):
            try:
                self.close(cid)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                problems.append(f"{cid}: {e}")
        return problems
