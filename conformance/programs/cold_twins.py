"""The run's cache-off twins: one per cold cell (model, dtype, server options) per run,
shared by every xdist worker of the run, and by every pytest run of a ``mutants`` run.

The twin's answers do not depend on the cell beyond its cold cell (``bind.cold_cell``:
no_buffer, page 1, no fault, radix cache off), so the xdist controller hosts a
:class:`TwinBroker` (this module is a pytest plugin, registered by ``conformance.plugin``):
a ``multiprocessing.connection`` listener on a Unix socket with a random key, named to
each worker in its ``workerinput`` (``<socket path>#<key hex>``; not an environment
variable, so a pytest started inside a test never finds its parent's broker).  ``mutants``
hosts one for all its runs and names it with ``--twin-broker``.  A worker sends the cell
and its run's options (the twin is served as that run would serve it: target, dtype,
launcher), the broker starts that cold
cell's twin once (:class:`ColdTwins`, in a thread that lives until the broker closes: a
server the kit starts gets SIGTERM when the thread that started it exits) and answers
its URL and pid.  A twin whose process died is started again for the next asker.  The
twins are the controller's children, so they end with it however it ends (the
launcher's reaper and parent-death signal).  Without xdist, :class:`ColdTwins` serves the
one process.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import pytest

from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.programs.bind import cold_cell, prepare_twin, serve_cold
from conformance.targets.reaper_client import pid_exists
from conformance.session.run_state import run_state

WORKERINPUT_KEY = "hybrid_conformance_twin_broker"
_BROKER = pytest.StashKey["TwinBroker"]()
#: Seconds a twin may take to answer its first health check (the launcher's own ready wait is inside).
READY_S = 900.0


class ColdTwins:
    """One cache-off twin per cold cell for this process, each started in a thread so it
    boots while the cell's own server does."""

    def __init__(self, options: Any, log_dir: Any) -> None:
        self.options, self.log_dir = options, log_dir
        self._futures: dict[str, Future] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self, cell: Any) -> Future:
        key = cold_cell(cell).id
        with self._lock:
            old = self._futures.get(key)
            if old is not None and old.done() and old.exception() is None and not old.result().alive():
                del self._futures[key]  # its process died: the next asker gets a fresh twin
            if key not in self._futures:
                prepare_twin(cell)
                fut: Future = Future()
                self._futures[key] = fut
                thread = threading.Thread(target=self._serve, args=(cell, fut), name=f"cold twin {key}", daemon=True)
                self._threads.append(thread)
                thread.start()
            return self._futures[key]

    def _serve(self, cell: Any, fut: Future) -> None:
        try:
            with serve_cold(cell, self.options, self.log_dir) as ep:
                fut.set_result(ep)
                self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the test that waits on it
            if not fut.done():
                fut.set_exception(e)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


@dataclass
class TwinHandle:
    """A twin served by another process of the run: what the programs need of it."""

    base_url: str
    pid: int | None
    client: SGLangClient

    def alive(self) -> bool:
        return self.pid is None or pid_exists(self.pid)


def serving_key(options: Any) -> tuple:
    """What of a run's options decides how its twin is served (the cold cell decides the rest)."""
    return tuple(getattr(options, k, None) for k in ("target", "dtype", "sglang_launcher", "twins", "gpus_per_worker"))


class TwinBroker:
    """Hosts the run's :class:`ColdTwins` for the run's other processes (see the module)."""

    def __init__(self, log_dir: Any) -> None:
        self.log_dir = log_dir
        self._twins: dict[tuple, ColdTwins] = {}
        self._twins_lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="hc-twins-")
        self.address = os.path.join(self._dir, "broker")
        self._key = os.urandom(16)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._key)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="twin broker", daemon=True).start()

    @property
    def env_value(self) -> str:
        return f"{self.address}#{self._key.hex()}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - a closed listener, or a caller without the key
                continue
            threading.Thread(target=self._serve, args=(conn,), name="twin broker conn", daemon=True).start()

    def _serve(self, conn: Any) -> None:
        with conn:
            while True:
                try:
                    cell, options = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    ep = self._twins_for(options).start(cell).result(timeout=READY_S)
                    answer: tuple = ("ok", ep.base_url, ep.pid)
                except BaseException as e:  # noqa: BLE001 - the asker reports it
                    answer = ("error", str(e) if isinstance(e, KitError) else f"{type(e).__name__}: {e}")
                try:
                    conn.send(answer)
                except OSError:
                    return

    def _twins_for(self, options: Any) -> ColdTwins:
        with self._twins_lock:
            key = serving_key(options)
            if key not in self._twins:
                self._twins[key] = ColdTwins(options, self.log_dir)
            return self._twins[key]

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._twins_lock:
            twins = list(self._twins.values())
        for t in twins:
            t.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RemoteTwins:
    """The workers' side: asks the broker named by ``value`` for a cell's twin, served as
    ``options`` (this run's) say."""

    def __init__(self, value: str, options: Any) -> None:
        self.options = options
        address, _, key = value.rpartition("#")
        if not address or not key:
            raise KitError(f"twin broker {value!r}: expected <socket path>#<key hex>")
        self.address, self._key = address, bytes.fromhex(key)
        self._clients: list[SGLangClient] = []

    def start(self, cell: Any) -> Future:
        fut: Future = Future()
        threading.Thread(target=self._ask, args=(cell, fut), name=f"cold twin {cold_cell(cell).id}", daemon=True).start()
        return fut

    def _ask(self, cell: Any, fut: Future) -> None:
        try:
            with Client(self.address, family="AF_UNIX", authkey=self._key) as conn:
                conn.send((cell, self.options))
                if not conn.poll(READY_S):
                    raise KitError(f"the run's twin broker gave no twin within {READY_S:.0f}s")
                answer = conn.recv()
        except (OSError, EOFError) as e:
            fut.set_exception(KitError(f"the run's twin broker ({self.address}) cannot be reached: {e}"))
            return
        except BaseException as e:  # noqa: BLE001 - handed to the test that waits on it
            fut.set_exception(e)
            return
        if answer[0] != "ok":
            fut.set_exception(KitError(answer[1]))
            return
        _, url, pid = answer
        client = SGLangClient(url, liveness=lambda: "" if pid is None or pid_exists(pid) else f"the cache-off twin (pid {pid}) exited")
        self._clients.append(client)
        fut.set_result(TwinHandle(url, pid, client))

    def close(self) -> None:
        for c in self._clients:
            c.close()


def twins_for(config: pytest.Config, options: Any, log_dir: Any) -> "ColdTwins | RemoteTwins":
    """An enclosing run's broker (``--twin-broker``), or the xdist controller's on a worker,
    else twins of this process alone."""
    value = config.getoption("--twin-broker", None) or getattr(config, "workerinput", {}).get(WORKERINPUT_KEY)
    return RemoteTwins(value, options) if value else ColdTwins(options, log_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller, per worker: name the run's broker (hosted at the first worker,
    unless an enclosing run named its own with ``--twin-broker``: workers read that option)."""
    config = node.config
    if config.getoption("--twin-broker", None):
        return
    broker = config.stash.get(_BROKER, None)
    if broker is None:
        options = run_state(config).options
        factory = getattr(config, "_tmp_path_factory", None)
        log_dir = options.log_dir or (factory.getbasetemp() / "server-logs" if factory else Path(tempfile.mkdtemp(prefix="hc-twin-logs-")))
        broker = config.stash[_BROKER] = TwinBroker(log_dir)
    node.workerinput[WORKERINPUT_KEY] = broker.env_value


def pytest_unconfigure(config: pytest.Config) -> None:
    broker = config.stash.get(_BROKER, None)
    if broker is not None:
        broker.close()
