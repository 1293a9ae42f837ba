"""The pool tier retries a refused arrival as SGLang's scheduler does (issue 44): it waits,
first come first served, and is matched anew at the next admission; over SGLang's real pools."""

from __future__ import annotations

import pytest

from conformance.sglang_api import pool as sglang_api
from conformance.sglang_api.pool_runtime import PoolKey
from conformance.targets.pool import invariants
from conformance.targets.pool.harness import PoolHarness, PoolSizes
from conformance.targets.pool.machine import pool_machine
from conformance.targets.pool.scenarios import oracle_for

pytestmark = pytest.mark.pool


@pytest.fixture(autouse=True)
def _notes(monkeypatch):
    """The rules called outside a hypothesis run: its notes go nowhere."""
    monkeypatch.setattr("conformance.targets.pool.machine.note", lambda text: None)


def _machine(max_reqs: int):
    sglang_api.require()
    cls = pool_machine(lambda: PoolHarness(PoolKey("extra_buffer", 1, 256, 64, False), PoolSizes(max_reqs=max_reqs)), oracle_for)
    return cls()


def test_a_refused_arrival_waits_and_is_admitted_once_room_frees():
    m = _machine(2)
    for seed in range(3):
        m.arrive(0, (1, 0), (1, 1), seed, None)
    assert [w[0] for w in m.waiting] == ["r3"] and "r3" not in m.h.running  # refused: kept, not dropped
    m.retry_refused()  # still no room: back at the head of the queue
    assert [w[0] for w in m.waiting] == ["r3"]
    m.arrive(0, (1, 0), (1, 1), 3, None)
    assert [w[0] for w in m.waiting] == ["r3", "r4"]  # a new arrival waits behind it
    m.h.finish(m.h.running["r1"], abort=False)
    m.retry_refused()
    assert "r3" in m.h.running and [w[0] for w in m.waiting] == ["r4"]
    invariants.check_all(m.h, m.checker)


def test_with_room_nothing_waits():
    m = _machine(3)
    for seed in range(3):
        m.arrive(0, (1, 0), (1, 1), seed, None)
    assert not m.waiting and len(m.h.running) == 3
