"""The reference PD router: one URL in front of a prefill role and a decode role
(``conformance.reference.pd``), speaking SGLang's native API like ``sglang_router`` in PD mode.

``/generate`` gives every request a random ``bootstrap_room``, sends it to the prefill role
(which ships the state to the decode role before it answers), then to the decode role, and
answers with the decode role's result, whose ``meta_info`` takes ``cached_tokens`` and the
input logprobs from the prefill role (where the radix cache and the prompt live).
``/flush_cache`` and ``/abort_request`` go to both; ``/health`` is 200 only when both are
healthy; ``/metrics`` is both roles' samples with a ``role`` label (so summed gauges are
both servers' pools); ``/server_info`` is the prefill role's plus the decode role's.

Start: ``python -m conformance.reference.router --prefill URL --decode URL --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import secrets
import sys
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

log = logging.getLogger("sglang_router")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?(\s.*)$")
ROLE_KEYS = ("prefill", "decode")


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "RouterError", "code": status}}, status_code=status)


def label_metrics(text: str, role: str, seen_meta: set[str]) -> list[str]:
    """Prometheus lines with ``role="<role>"`` added to every sample; HELP/TYPE kept once."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            if line not in seen_meta:
                seen_meta.add(line)
                out.append(line)
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = f'role="{role}"' + (f",{m.group(3)}" if m.group(3) else "")
        out.append(f"{m.group(1)}{{{labels}}}{m.group(4)}")
    return out


def batch_shape(data: dict) -> tuple[int, bool]:
    """(number of requests, batched?) of a /generate body (SGLang's rules)."""
    text, ids = data.get("text"), data.get("input_ids")
    if isinstance(text, list):
        return len(text), True
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids), True
    return 1, False


def merge_results(prefill: Any, decode: Any) -> Any:
    """The decode result with the prefill role's cached_tokens and input logprobs."""
    pre = prefill if isinstance(prefill, list) else [prefill]
    dec = decode if isinstance(decode, list) else [decode]
    for p, d in zip(pre, dec):
        pm, dm = p.get("meta_info", {}), d.setdefault("meta_info", {})
        dm["cached_tokens"] = pm.get("cached_tokens", 0)
        for key in ("input_token_logprobs", "input_top_logprobs"):
            if key in pm:
                dm[key] = pm[key]
    return decode


def create_router(prefill_url: str, decode_url: str, *, timeout: float = 600.0) -> FastAPI:
    urls = {"prefill": prefill_url.rstrip("/"), "decode": decode_url.rstrip("/")}
    http = httpx.AsyncClient(timeout=timeout, trust_env=False)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await http.aclose()

    app = FastAPI(title="hybrid-conformance PD router", lifespan=lifespan)

    async def call(role: str, method: str, path: str, **kw) -> httpx.Response | JSONResponse:
        try:
            return await http.request(method, urls[role] + path, **kw)
        except httpx.HTTPError as exc:
            return _error(f"router: {role} server {urls[role]}{path}: {type(exc).__name__}: {exc}", 502)

    def relay(role: str, resp: httpx.Response) -> JSONResponse:
        try:
            body = resp.json()
        except ValueError:
            body = {"error": {"message": f"{role}: {resp.text[:300]}", "code": resp.status_code}}
        return JSONResponse(body, status_code=resp.status_code)

    @app.get("/health")
    async def health():
        answers = await asyncio.gather(*(call(r, "GET", "/health", timeout=5) for r in ROLE_KEYS))
        bad = [f"{r}: HTTP {a.status_code}" for r, a in zip(ROLE_KEYS, answers) if a.status_code != 200]
        return _error(f"router: unhealthy backend(s): {', '.join(bad)}", 503) if bad else PlainTextResponse("")

    @app.post("/generate")
    async def generate(request: Request):
        try:
            data = await request.json()
        except ValueError as exc:
            return _error(f"malformed JSON body: {exc}", 400)
        if not isinstance(data, dict):
            return _error("the JSON body must be an object", 400)
        if data.get("stream"):
            return _error("stream=true is not supported by the reference PD router", 400)
        n, batched = batch_shape(data)
        rooms = [secrets.randbits(62) for _ in range(n)]
        payload = {**data, "bootstrap_room": rooms if batched else rooms[0]}
        payload.pop("rid", None)  # the roles key their requests by room
        pre = await call("prefill", "POST", "/generate", json=payload)
        if pre.status_code != 200:
            return relay("prefill", pre) if isinstance(pre, httpx.Response) else pre
        dec = await call("decode", "POST", "/generate", json=payload)
        if dec.status_code != 200:
            return relay("decode", dec) if isinstance(dec, httpx.Response) else dec
        return merge_results(pre.json(), dec.json())

    @app.get("/health_generate")
    async def health_generate():
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        resp = await call("prefill", "GET", "/health")
        if resp.status_code != 200:
            return _error("router: prefill server unhealthy", 503)
        out = await generate(_json_request(body))
        return out if isinstance(out, JSONResponse) and out.status_code != 200 else PlainTextResponse("")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        answers = await asyncio.gather(*(call(r, "POST", "/flush_cache") for r in ROLE_KEYS))
        bad = [f"{r}: {a.body.decode() if isinstance(a, JSONResponse) else a.text.strip()}"
               for r, a in zip(ROLE_KEYS, answers) if a.status_code != 200]
        if bad:
            return PlainTextResponse(f"Cache not flushed: {'; '.join(bad)}\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.get("/metrics")
    async def metrics():
        answers = await asyncio.gather(*(call(r, "GET", "/metrics", timeout=30) for r in ROLE_KEYS))
        seen: set[str] = set()
        lines: list[str] = []
        for role, a in zip(ROLE_KEYS, answers):
            if a.status_code != 200:
                return _error(f"router: {role} /metrics: HTTP {a.status_code}", 502)
            lines += label_metrics(a.text, role, seen)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def server_info():
        answers = await asyncio.gather(*(call(r, "GET", "/server_info", timeout=30) for r in ROLE_KEYS))
        for role, a in zip(ROLE_KEYS, answers):
            if a.status_code != 200:
                return _error(f"router: {role} /server_info: HTTP {a.status_code}", 502)
        pre, dec = (a.json() for a in answers)
        return {**pre, "disaggregation_mode": "router", "prefill_url": urls["prefill"], "decode_url": urls["decode"],
                "decode_server_info": dec}

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request.body()
        await asyncio.gather(*(call(r, "POST", "/abort_request", content=body) for r in ROLE_KEYS))
        return PlainTextResponse("")

    return app


def _json_request(body: dict) -> Request:
    import json

    raw = json.dumps(body).encode()

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/generate", "query_string": b"", "headers": []}, receive)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conformance.reference.router", description="PD router for the reference roles.")
    p.add_argument("--prefill", required=True, help="the prefill role's base URL")
    p.add_argument("--decode", required=True, help="the decode role's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one backend call may take")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr, format="[%(asctime)s] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_router(args.prefill, args.decode, timeout=args.timeout)
    log.info("PD router: prefill %s, decode %s", args.prefill, args.decode)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=2)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
