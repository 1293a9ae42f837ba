"""HTTP client for SGLang's native API, used against any server target.

Every call has a timeout. A connection failure or a 5xx becomes a one-line
:class:`ServerDiedError` / :class:`KitError` naming the URL and the cause, never a
traceback wall. When a ``liveness`` callable is given (the launcher's process
check), a failed call says whether the server process has exited.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import httpx

from conformance.errors import KitError, ServerDiedError
from conformance.sglang_contract.metric_names import (
    KIT_MAMBA_AVAILABLE, KIT_MAMBA_EVICTABLE, KIT_MAMBA_USED, MAMBA_AVAILABLE_TOKENS, MAMBA_EVICTABLE_TOKENS, MAMBA_USED_TOKENS,
)

_METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


#: SGLang gauge -> the kit's observe-plugin gauge of the same SGLang term, read where SGLang
#: does not publish its own: 0.5.11 computes ``PoolStats.mamba_{num_used,available_size,
#: evictable_size}`` but exports only ``sglang:mamba_usage`` (a fraction); 0.5.12 exports
#: them as these gauges (``mamba_used_tokens = PoolStats.mamba_num_used``).
GAUGE_STANDINS = {
    MAMBA_USED_TOKENS: KIT_MAMBA_USED,
    MAMBA_AVAILABLE_TOKENS: KIT_MAMBA_AVAILABLE,
    MAMBA_EVICTABLE_TOKENS: KIT_MAMBA_EVICTABLE,
}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value}, summing a metric's label sets; an SGLang
    gauge the release does not publish takes its :data:`GAUGE_STANDINS` value."""
    out = _parse(text)
    for name, standin in GAUGE_STANDINS.items():
        if name not in out and standin in out:
            out[name] = out[standin]
    return out


def _parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


class SGLangClient:
    """A thin synchronous client; one instance per server."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        liveness: Callable[[], str | None] | None = None,
        batches: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        #: Takes a batched ``/generate`` (lists of prompts and sampling params); SGLang's
        #: ``sglang_router`` in PD mode does not, so runners send its prompts concurrently.
        self.batches = batches
        self.timeout = timeout
        self._liveness = liveness
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=False)

    # -- plumbing -------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SGLangClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _dead_reason(self) -> str:
        if self._liveness is None:
            return ""
        reason = self._liveness()
        return f"; {reason}" if reason else ""

    def request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None, ok: Iterable[int] = (200,)) -> httpx.Response:
        try:
            resp = self._http.request(method, path, json=json, timeout=timeout or self.timeout)
        except httpx.TimeoutException:
            raise ServerDiedError(f"{method} {self.base_url}{path}: no answer within {timeout or self.timeout:.0f}s{self._dead_reason()}") from None
        except httpx.HTTPError as e:
            raise ServerDiedError(f"{method} {self.base_url}{path}: {type(e).__name__}: {e}{self._dead_reason()}") from None
        if resp.status_code not in set(ok):
            raise self._refused(f"{method} {self.base_url}{path}", resp.status_code, resp.text)
        return resp

    def _refused(self, where: str, status: int, text: str) -> KitError:
        """The error of an answer with a failing status: a dead server's cause (its exit and
        last exception, from ``liveness``) comes before the answer's body, so a one-line
        report shows why, not only the router's or server's long JSON."""
        body = text.strip().replace("\n", " ")[:300]
        cls = ServerDiedError if status >= 500 else KitError
        return cls(f"{where}: HTTP {status}{self._dead_reason()}; answer: {body}")

    # -- SGLang's native API ----------------------------------------------------
    def generate(self, payload: Mapping[str, Any], *, timeout: float | None = None) -> Any:
        return self.request("POST", "/generate", json=dict(payload), timeout=timeout).json()

    def generate_stream(self, payload: Mapping[str, Any], *, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """``/generate`` with ``stream: true``: yield each SSE chunk as it arrives (the
        read timeout bounds the wait for every chunk)."""
        body = {**dict(payload), "stream": True}
        where = f"POST {self.base_url}/generate (stream)"
        try:
            with self._http.stream("POST", "/generate", json=body, timeout=timeout or self.timeout) as resp:
                if resp.status_code != 200:
                    raise self._refused(where, resp.status_code, resp.read().decode(errors="replace"))
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except httpx.TimeoutException:
            raise ServerDiedError(f"{where}: no chunk within {timeout or self.timeout:.0f}s{self._dead_reason()}") from None
        except httpx.HTTPError as e:
            raise ServerDiedError(f"{where}: {type(e).__name__}: {e}{self._dead_reason()}") from None

    def flush_cache(self, *, attempts: int = 20, pause_s: float = 0.5) -> None:
        """Flush the radix cache; SGLang refuses while requests run, so retry briefly."""
        last = ""
        for _ in range(max(1, attempts)):
            resp = self.request("POST", "/flush_cache", ok=(200, 400))  # 5xx: a dead server, raised at once
            if resp.status_code == 200:
                return
            last = resp.text.strip()[:200]
            time.sleep(pause_s)
        raise KitError(f"POST {self.base_url}/flush_cache: refused {attempts} times: {last}")

    def metrics_text(self) -> str:
        return self.request("GET", "/metrics", timeout=30).text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def server_info(self) -> dict[str, Any]:
        return self.request("GET", "/server_info", timeout=30).json()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def health_generate(self, timeout: float = 30.0) -> bool:
        try:
            return self._http.get("/health_generate", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def open_session(self, capacity_of_str_len: int, *, session_id: str | None = None, streaming: bool | None = None, timeout: float | None = None) -> str:
        body: dict[str, Any] = {"capacity_of_str_len": capacity_of_str_len}
        if session_id is not None:
            body["session_id"] = session_id
        if streaming is not None:
            body["streaming"] = streaming
        if timeout is not None:
            body["timeout"] = timeout
        out = self.request("POST", "/open_session", json=body).json()
        return out if isinstance(out, str) else out.get("session_id", session_id)

    def close_session(self, session_id: str) -> None:
        self.request("POST", "/close_session", json={"session_id": session_id})

    def abort_request(self, rid: str) -> None:
        self.request("POST", "/abort_request", json={"rid": rid}, ok=(200, 404))

    def wait_gauges(
        self,
        names: Iterable[str],
        *,
        want: float = 0.0,
        deadline_s: float = 45.0,
        poll_s: float = 0.5,
    ) -> tuple[bool, dict[str, float], float]:
        """Poll /metrics until every named gauge equals ``want`` or the deadline passes.

        Returns (reached, last values, seconds waited). SGLang refreshes idle
        gauges lazily (up to every 30 s), hence the generous default deadline.
        """
        names = list(names)
        start = time.monotonic()
        last: dict[str, float] = {}
        while True:
            m = self.metrics()
            last = {n: m.get(n, float("nan")) for n in names}
            if all(v == want for v in last.values()):
                return True, last, time.monotonic() - start
            if time.monotonic() - start >= deadline_s:
                return False, last, time.monotonic() - start
            time.sleep(poll_s)
