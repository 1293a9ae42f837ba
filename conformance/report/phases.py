"""Where a run's wall time goes: named phases timed where they happen, summed per test.

A phase is timed with :func:`phase` (server start and stop per target, idle probes, the
cold twin, lm-eval); :func:`take` hands the sums since the last call to the pytest hook
that attaches them to the test's report (``user_properties``, so they cross from xdist
workers), and :class:`PhaseTotals` adds them up with each suite's setup/call/teardown
durations into report.json's ``phases`` block, which ``bench/bench_phases.py`` prints.
Phases nest in suites' calls (an idle probe inside a kl call counts in both).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from typing import Iterator, Mapping, TypeVar

T = TypeVar("T")

#: The ``user_properties`` key a test report carries its phases under.
PROPERTY = "hybrid_conformance_phases"
_LOCK = threading.Lock()
_PENDING: dict[str, float] = defaultdict(float)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the wall time of the block to phase ``name`` (thread-safe)."""
    start = time.monotonic()
    try:
        yield
    finally:
        with _LOCK:
            _PENDING[name] += time.monotonic() - start


@contextlib.contextmanager
def timed(cm: contextlib.AbstractContextManager[T], name: str) -> Iterator[T]:
    """Enter ``cm`` (a server, say) timing its entry as ``<name>: start`` and its exit as
    ``<name>: stop``."""
    stack = contextlib.ExitStack()
    with phase(f"{name}: start"):
        value = stack.enter_context(cm)
    try:
        yield value
    finally:
        with phase(f"{name}: stop"):
            stack.close()


def take() -> dict[str, float]:
    """The phase sums since the last call (and forget them)."""
    with _LOCK:
        out = {k: round(v, 3) for k, v in _PENDING.items() if v > 0}
        _PENDING.clear()
    return out


def suite_of_nodeid(nodeid: str) -> str:
    """What a test's time is filed under: its suite (``conformance/suites/<suite>/...``), else its file."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    return parts[2] if parts[:2] == ["conformance", "suites"] and len(parts) > 3 else path


class PhaseTotals:
    """Sums over a run: each phase, and per suite the setup/call/teardown time of its tests."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = defaultdict(float)
        self.suites: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.tests: dict[str, int] = defaultdict(int)

    def add(self, suite: str, when: str, duration: float, phases: Mapping[str, float]) -> None:
        self.suites[suite][when] += duration
        if when == "call":
            self.tests[suite] += 1
        for k, v in phases.items():
            self.phases[k] += v

    def to_json(self, *, wall_s: float, collection_s: float | None) -> dict:
        """report.json's ``phases``: wall, collection, each phase and each suite (seconds, summed
        over workers: with ``-n 2`` the sums can reach twice the wall)."""
        return {
            "wall_s": round(wall_s, 3),
            "collection_s": None if collection_s is None else round(collection_s, 3),
            "phases": {k: round(v, 3) for k, v in sorted(self.phases.items())},
            "suites": {s: {"tests": self.tests[s], **{w: round(v, 3) for w, v in d.items()}} for s, d in sorted(self.suites.items())},
        }
