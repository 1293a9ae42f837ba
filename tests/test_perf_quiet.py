"""The perf suite's quiet lock across processes (as xdist workers hold it): a measurement
holding it exclusively keeps shared holders (launches, other tests) out; a waiting
measurement goes before new shared holders; every wait is bounded; a pending file left by
a dead process is ignored."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

from conformance.suites.perf import quiet


def _hold(folder: str, exclusive: bool, hold_s: float, log: str, name: str, wait_s: float = 30.0) -> None:
    ctx = quiet.exclusive if exclusive else quiet.shared
    with ctx(Path(folder), wait_s=wait_s) as got:
        with open(log, "a") as f:
            f.write(f"{name} start {time.monotonic():.3f} {got}\n")
        time.sleep(hold_s)
        with open(log, "a") as f:
            f.write(f"{name} end {time.monotonic():.3f}\n")


def _events(log: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        name, what, t, *rest = line.split()
        out.setdefault(name, {})[what] = float(t)
        if rest:
            out[name]["got"] = rest[0] == "True"
    return out


def _wait_for(log: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never logged")


def _spawn(*args) -> mp.Process:
    p = mp.get_context("spawn").Process(target=_hold, args=args)
    p.start()
    return p


def test_an_exclusive_holder_keeps_shared_holders_out_and_waits_for_them(tmp_path: Path) -> None:
    log = tmp_path / "log"
    first = _spawn(str(tmp_path), False, 6.0, str(log), "shared1")
    _wait_for(log, "shared1 start")
    measure = _spawn(str(tmp_path), True, 1.5, str(log), "perf")
    deadline = time.monotonic() + 60
    while not (tmp_path / quiet.PENDING_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    late = _spawn(str(tmp_path), False, 0.2, str(log), "shared2")  # arrives while the measurement waits
    asked = time.monotonic()
    for p in (first, measure, late):
        p.join(60)
    ev = _events(log)
    assert asked < ev["shared1"]["end"]  # the late holder really came while the measurement was waiting
    assert ev["perf"]["got"] is True
    assert ev["perf"]["start"] >= ev["shared1"]["end"]  # waited for the running test
    assert ev["shared2"]["start"] >= ev["perf"]["end"]  # and went before the later one


def test_waits_are_bounded_and_say_so(tmp_path: Path) -> None:
    log = tmp_path / "log"
    holder = _spawn(str(tmp_path), True, 4.0, str(log), "perf1")
    _wait_for(log, "perf1 start")
    t0 = time.monotonic()
    with quiet.exclusive(tmp_path, wait_s=0.5) as got:
        assert got is False  # measured anyway, and the perf block says quiet: false
    assert time.monotonic() - t0 < 3.0
    holder.join(60)


def test_a_stale_pending_file_of_a_dead_process_does_not_hold_anyone(tmp_path: Path) -> None:
    p = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    (tmp_path / quiet.PENDING_NAME).write_text(str(p.pid))
    t0 = time.monotonic()
    with quiet.shared(tmp_path, wait_s=30) as got:
        assert got is True
    assert time.monotonic() - t0 < 2.0
    (tmp_path / quiet.PENDING_NAME).write_text(str(os.getpid()))  # our own pending file neither
    with quiet.shared(tmp_path, wait_s=30) as got:
        assert got is True
