"""Requests in flight: one thread per ``/generate`` call (streamed or not), with progress a
program step can wait on (a gate, an abort point) and a global event order.

Every call has a timeout; a server that stops answering turns into an ``error`` outcome
naming the call, never a hang.  ``Clock`` numbers sends and completions in one sequence,
so the oracle knows which requests may have overlapped on the server: a request whose
answer arrived before another was sent certainly finished first.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 300.0


class Clock:
    def __init__(self) -> None:
        self._n = itertools.count(1)
        self._lock = threading.Lock()

    def tick(self) -> int:
        with self._lock:
            return next(self._n)


@dataclass
class Flight:
    """One ``/generate`` call: what was sent and, once ``done``, what came back."""

    rids: tuple[str, ...]
    payload: dict[str, Any]
    stream: bool
    sent_seq: int
    done_seq: int = 0
    tokens_seen: int = 0
    responses: list[dict[str, Any]] = field(default_factory=list)
    http_status: int | None = None
    error: str = ""
    abort_sent: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    progress: threading.Condition = field(default_factory=threading.Condition)

    def wait_tokens(self, n: int, timeout: float) -> bool:
        """Until ``n`` output tokens streamed or the call ended; False on timeout."""
        end = time.monotonic() + timeout
        with self.progress:
            while self.tokens_seen < n and not self.done.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.progress.wait(min(left, 0.5))
        return True


class FlightDeck:
    """Starts flights on a thread pool against ``base_url``; ``abort`` by rid."""

    def __init__(self, base_url: str, clock: Clock, *, timeout_s: float = REQUEST_TIMEOUT_S, workers: int = 48) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flight")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, trust_env=False, limits=httpx.Limits(max_connections=workers + 4))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def launch(self, rids: tuple[str, ...], payload: dict[str, Any], *, stream: bool) -> Flight:
        flight = Flight(rids, payload, stream, sent_seq=self.clock.tick())
        self._pool.submit(self._run, flight)
        return flight

    def abort(self, flight: Flight) -> None:
        flight.abort_sent = True
        for rid in flight.rids:
            try:
                self._http.post("/abort_request", json={"rid": rid}, timeout=30)
            except httpx.HTTPError:
                pass  # a dead server shows in the flight's own outcome

    # ------------------------------------------------------------ worker
    def _run(self, flight: Flight) -> None:
        try:
            if flight.stream:
                self._run_stream(flight)
            else:
                resp = self._http.post("/generate", json=flight.payload, timeout=self.timeout_s)
                flight.http_status = resp.status_code
                if resp.status_code == 200:
                    body = resp.json()
                    flight.responses = body if isinstance(body, list) else [body]
                else:
                    flight.error = _error_text(resp.text)
        except httpx.TimeoutException:
            flight.error = f"no answer within {self.timeout_s:.0f}s"
        except (httpx.HTTPError, ValueError) as e:
            flight.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            flight.done_seq = self.clock.tick()
            with flight.progress:
                flight.done.set()
                flight.progress.notify_all()

    def _run_stream(self, flight: Flight) -> None:
        payload = {**flight.payload, "stream": True}
        with self._http.stream("POST", "/generate", json=payload, timeout=self.timeout_s) as resp:
            flight.http_status = resp.status_code
            if resp.status_code != 200:
                flight.error = _error_text(resp.read().decode(errors="replace"))
                return
            last: dict[str, Any] | None = None
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    flight.error = _error_text(json.dumps(event))
                    return
                last = event
                seen = len(event.get("output_ids") or []) or int(event.get("meta_info", {}).get("completion_tokens", 0) or 0)
                with flight.progress:
                    flight.tokens_seen = max(flight.tokens_seen, seen)
                    flight.progress.notify_all()
            if last is None:
                flight.error = "stream ended without an event"
            else:
                flight.responses = [last]


def _error_text(text: str) -> str:
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            err = data.get("error", data)
            if isinstance(err, dict):
                return str(err.get("message", err))[:300]
            return str(err)[:300]
    except ValueError:
        pass
    return text.strip().replace("\n", " ")[:300]
