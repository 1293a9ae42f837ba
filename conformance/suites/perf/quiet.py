"""Quiet measurement: while a perf test times its requests, the run's other tests wait.

The xdist workers of one run share a lock file (``fcntl.flock``) in the run's shared
folder.  Every server launch and every other test bound to a server holds it *shared*;
a perf measurement holds it *exclusive*, so on a small machine the timings are not
those of a neighbour cell's launch or GSM8K pass.  A waiting measurement leaves a
``pending`` file with its pid, which new shared holders let go first (no starvation).

Every wait is bounded: a measurement that could not get the lock in
:data:`EXCLUSIVE_WAIT_S` runs anyway and says so (``quiet: false`` in its perf block);
a shared holder waits at most :data:`SHARED_WAIT_S` for a pending measurement.
Loaded as a pytest plugin by ``conformance.plugin``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import IO, Iterator

import pytest

from conformance.targets.reaper_client import pid_exists

LOCK_NAME = "perf-quiet.lock"
PENDING_NAME = "perf-quiet.pending"
EXCLUSIVE_WAIT_S = 900.0
SHARED_WAIT_S = 600.0
POLL_S = 0.1


def shared_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the run's xdist workers share: ``<report-dir>/shared`` or the temp base."""
    report_dir = config.getoption("--report-dir", default=None)
    if report_dir:
        return Path(report_dir) / "shared"
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


def _try(f: IO[str], mode: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def _pending_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    return pid_exists(pid)


@contextlib.contextmanager
def exclusive(folder: Path, *, wait_s: float = EXCLUSIVE_WAIT_S) -> Iterator[bool]:
    """Hold the run's lock alone; yields whether it was obtained within ``wait_s``."""
    folder.mkdir(parents=True, exist_ok=True)
    pending = folder / PENDING_NAME
    pending.write_text(str(os.getpid()))
    try:
        with open(folder / LOCK_NAME, "a+") as f:
            got = _try(f, fcntl.LOCK_EX, time.monotonic() + wait_s)
            pending.unlink(missing_ok=True)
            try:
                yield got
            finally:
                if got:
                    fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        if pending.exists() and pending.read_text().strip() == str(os.getpid()):
            pending.unlink(missing_ok=True)


@contextlib.contextmanager
def shared(folder: Path, *, wait_s: float = SHARED_WAIT_S) -> Iterator[bool]:
    """Hold the run's lock with the other non-perf work; lets a pending measurement go first."""
    folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    pending = folder / PENDING_NAME
    while pending.exists() and _pending_alive(pending) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    with open(folder / LOCK_NAME, "a+") as f:
        got = _try(f, fcntl.LOCK_SH, deadline)
        try:
            yield got
        finally:
            if got:
                fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _quiet_shared(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test bound to a server but a perf measurement holds the lock shared."""
    if "endpoint" not in request.fixturenames or request.node.get_closest_marker("perf"):
        yield
        return
    folder = shared_dir(request.config, request.getfixturevalue("tmp_path_factory"))
    with shared(folder):
        yield
