"""The run's cache-off twins (``conformance.programs.cold_twins``): one twin per cold cell,
shared through the controller's broker by every worker; a dead twin is started again; a
start failure reaches the asker as one line; a wrong key is refused.  The twin itself is a
stand-in (``serve_cold`` replaced): the broker's bookkeeping is what is tested here; a
real xdist run sharing one twin is in ``test_fuzz_two_workers_share_one_twin``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.programs import cold_twins
from conformance.programs.bind import cold_cell
from conformance.programs.cold_twins import RemoteTwins, TwinBroker

ROOT = Path(__file__).resolve().parents[1]
OPTS = SimpleNamespace(target="sglang-cpu", dtype=None, sglang_launcher="python -m sglang.launch_server", twins=False, gpus_per_worker=1)


def _cells(family: str = "qwen3-next"):
    return [c for c in load_matrix().cells if c.model.family == family and c.fault.name == "none" and not c.options]


class FakeTwins:
    """Stands in for ``serve_cold``: counts starts per cold cell; each twin 'lives' until killed."""

    def __init__(self, fail: str = "") -> None:
        self.starts: list[str] = []
        self.fail = fail
        self.lock = threading.Lock()
        self.endpoints: list[SimpleNamespace] = []

    @contextlib.contextmanager
    def serve_cold(self, cell, options, log_dir):
        if self.fail:
            raise KitError(self.fail)
        with self.lock:
            self.starts.append(cold_cell(cell).id)
            n = len(self.starts)
        state = {"alive": True}
        ep = SimpleNamespace(base_url=f"http://127.0.0.1:{40000 + n}", pid=os.getpid(),
                             alive=lambda: state["alive"], kill=lambda: state.update(alive=False))
        self.endpoints.append(ep)
        yield ep


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTwins:
    f = FakeTwins()
    monkeypatch.setattr(cold_twins, "serve_cold", f.serve_cold)
    monkeypatch.setattr(cold_twins, "prepare_twin", lambda cell: None)
    return f


def test_workers_share_one_twin_per_cold_cell(fake: FakeTwins, tmp_path: Path) -> None:
    cells = _cells()
    strategies = {c.strategy.name for c in cells}
    assert len(cells) >= 2 and len(strategies) >= 2  # cells that differ, with one cold cell
    broker = TwinBroker(tmp_path)
    try:
        workers = [RemoteTwins(broker.env_value, OPTS) for _ in range(3)]
        futures = [w.start(c) for w in workers for c in cells]
        urls = {f.result(timeout=30).base_url for f in futures}
        assert len(urls) == 1 and fake.starts == [cold_cell(cells[0]).id]
        other = _cells("nemotron-h")[0]  # another model: its own twin
        assert workers[0].start(other).result(timeout=30).base_url not in urls
        assert len(fake.starts) == 2
        bf16 = RemoteTwins(broker.env_value, SimpleNamespace(**{**vars(OPTS), "dtype": "bfloat16"}))
        assert bf16.start(cells[0]).result(timeout=30).base_url not in urls  # served otherwise: its own twin
        assert len(fake.starts) == 3
    finally:
        broker.close()


def test_a_dead_twin_is_started_again(fake: FakeTwins, tmp_path: Path) -> None:
    cell = _cells()[0]
    broker = TwinBroker(tmp_path)
    try:
        first = RemoteTwins(broker.env_value, OPTS).start(cell).result(timeout=30)
        fake.endpoints[0].kill()
        second = RemoteTwins(broker.env_value, OPTS).start(cell).result(timeout=30)
        assert first.base_url != second.base_url and len(fake.starts) == 2
    finally:
        broker.close()


def test_a_twin_that_cannot_start_is_one_line_for_the_asker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = FakeTwins(fail="server exited during start-up (code 1): no memory")
    monkeypatch.setattr(cold_twins, "serve_cold", f.serve_cold)
    monkeypatch.setattr(cold_twins, "prepare_twin", lambda cell: None)
    broker = TwinBroker(tmp_path)
    try:
        with pytest.raises(KitError, match=r"^server exited during start-up \(code 1\): no memory$"):
            RemoteTwins(broker.env_value, OPTS).start(_cells()[0]).result(timeout=30)
    finally:
        broker.close()


def test_wrong_key_or_gone_broker_is_refused(fake: FakeTwins, tmp_path: Path) -> None:
    broker = TwinBroker(tmp_path)
    address = broker.env_value.rpartition("#")[0]
    try:
        with pytest.raises(Exception):
            RemoteTwins(f"{address}#{'00' * 16}", OPTS).start(_cells()[0]).result(timeout=30)
        assert fake.starts == []
    finally:
        broker.close()
    with pytest.raises(KitError, match="cannot be reached"):
        RemoteTwins(broker.env_value, OPTS).start(_cells()[0]).result(timeout=30)
    with pytest.raises(KitError, match="expected <socket path>#<key hex>"):
        RemoteTwins("no-key", OPTS)


@pytest.mark.scheduled(reason="two fuzzing workers on real SGLang: the nightly's scheduled-tests job")
def test_fuzz_two_workers_share_one_twin(tmp_path: Path) -> None:
    """Two xdist workers, two cells of one model (reference engine): one cold twin's log."""
    cmd = ["hybrid-conformance", "fuzz", "--models", "qwen3-next", "--strategies", "no_buffer,extra_buffer", "--faults", "none",
           "--tier", "premerge", "--budget", "2", "--seed", "0", "-n", "2", "--report-dir", str(tmp_path / "r")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    checks = [c["checks"]["programs"] for c in report["cells"]]
    assert [c["status"] for c in checks] == ["pass", "pass"]
    twins = {c["details"]["cold_twin"] for c in checks}
    assert len(twins) == 1 and re.fullmatch(r"http://127\.0\.0\.1:\d+ pid \d+", twins.pop())
    assert sorted(c["server"]["worker"] for c in report["cells"]) == ["gw0", "gw1"]  # two workers, one twin


def test_the_cold_twin_keeps_the_cells_server_options_but_not_the_radix_trees() -> None:
    """SGLang 0.5.21 refused to start the twin of an ``eviction-tlru`` cell ("--radix-eviction-policy
    tlru requires UnifiedRadixCache, but tree_cache is ChunkCache"): a policy of a tree the
    twin does not have.  Options that change the computation (mixed chunk, chunked prefill)
    stay: the twin must compute as the cell does."""
    from conformance.matrix import axes

    cells = [c for c in load_matrix().cells if dict(c.options).get("eviction") and len(c.options) > 1]
    assert cells, "the nightly matrix has a cell with an eviction policy and another option"
    for cell in cells:
        cold = cold_cell(cell)
        assert "eviction" not in dict(cold.options) and dict(cold.options) == {a: v for a, v in cell.options if not axes.AXES[a].tree_only}
        assert "--radix-eviction-policy" not in axes.server_args(cold), (cell.id, axes.server_args(cold))
        assert "--radix-eviction-policy" in axes.server_args(cell) or dict(cell.options)["eviction"] == "lru"
    # the per-path cap is the tree's too: its cells share the plain cold twin
    capped = [c for c in load_matrix().cells if dict(c.options).get("path_cap") == "1"]
    assert capped and all(cold_cell(c).options == () and axes.PATH_CAP_FLAG not in axes.server_args(cold_cell(c)) for c in capped)
    assert all(axes.AXES[a].tree_only == (a in ("eviction", "path_cap", "tree_core")) for a in axes.NAMES)
