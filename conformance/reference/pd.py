"""PD disaggregation mode of the reference engine: a prefill role and a decode role, each in
its own process, with the request's state shipped between them over loopback HTTP.

* ``prefill``: runs the prompt as usual (radix cache, input logprobs, the first output token),
  then ships the state after the prompt -- attention KV plus conv/SSM state, ``torch.save``
  bytes -- with the first token and its log-prob row to the decode role's ``POST
  /pd/transfer`` before it answers.
* ``decode``: radix cache off (as SGLang's decode server), admits a request only with the
  state shipped for its ``bootstrap_room`` and decodes from it.

Both roles keep the reference server's API, SGLang's gauges and its idle leak check, and
add ``sglang:pd_pending_transfers`` (states awaiting shipment on the prefill side, shipped
but unclaimed on the decode side): it must read 0 at idle.  Requests come through
``conformance.reference.router``, which gives each one a ``bootstrap_room``.

Start: ``python -m conformance.reference.pd --disaggregation-mode prefill --decode-url URL
--model tiny-qwen3-next --port N`` (and ``--disaggregation-mode decode``).
Seeded PD fault ``HYBRID_CONFORMANCE_PD_FAULT=pd_state_off_by_one`` (or the engine's
``HYBRID_CONFORMANCE_FAULT``): the prefill ships the
recurrent state of one token before the end of the prompt with the right KV, as a
mis-indexed state transfer would (read in :func:`read_faults`, the one place).
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.requests import Request as StarletteRequest

from conformance.errors import KitError
from conformance.matrix.faults import FAULT_ENV, PD_FAULT_ENV, SeededFault, registry
from conformance.reference.engine import Engine
from conformance.reference.faults import FaultSwitch
from conformance.reference.http_common import BadRequest
from conformance.reference.request import Req
from conformance.reference.routes import create_app
from conformance.reference.server import _configure_logging, build_engine, run_app
from conformance.reference.server import build_parser as server_parser
from conformance.sglang_contract.metric_names import PD_PENDING_TRANSFERS

log = logging.getLogger("sglang.srt.disaggregation")
ROLES = ("prefill", "decode")
TRANSFER_PATH = "/pd/transfer"
ROOM_HEADER = "x-bootstrap-room"
PD_FAULTS: dict[str, SeededFault] = registry(
    SeededFault(
        "pd_state_off_by_one",
        "reference-pd",
        "the prefill role ships the recurrent state of one token before the end of the "
        "prompt (KV correct)",
        "a mis-indexed mamba state transfer (cf. SGLang PR 15829's failing PD test)",
        "conformance.reference.pd.PrefillEngine._shipped_state",
        "the decode role continues from the wrong state: the PD cell's outputs differ from the non-PD cell's",
        suites=("disagg",),
        group="pd",
    ),
)


def read_faults(environ: dict | None = None) -> tuple[FaultSwitch, str | None]:
    """(the engine's fault switch, the PD fault name or None) from the environment.

    A PD fault is named by ``HYBRID_CONFORMANCE_PD_FAULT`` (seen by the PD roles only, so a
    whole run can carry it while its non-PD servers stay clean) or by the engine's
    ``HYBRID_CONFORMANCE_FAULT``.
    """
    env = dict(os.environ if environ is None else environ)
    pd_name = env.get(PD_FAULT_ENV, "").strip() or None
    if pd_name is not None and pd_name not in PD_FAULTS:
        raise KitError(f"unknown PD fault {pd_name!r} in {PD_FAULT_ENV}; known: {', '.join(PD_FAULTS)}")
    name = env.get(FAULT_ENV, "").strip()
    if name in PD_FAULTS:
        env.pop(FAULT_ENV)
        pd_name = pd_name or name
    return FaultSwitch.from_env(env), pd_name


def rid_for(room: int) -> str:
    return f"pd-{room}"


def room_of(rid: str) -> int | None:
    """The bootstrap room a PD rid carries (None for any other rid)."""
    if not rid.startswith("pd-"):
        return None
    try:
        return int(rid[3:])
    except ValueError:
        return None


# ------------------------------------------------------------------ the shipped state
@dataclass
class Shipment:
    """What the prefill role ships for one request: the state after the prompt, the
    log-prob row after the prompt's last token, and the first token sampled from it."""

    room: int
    prompt_len: int
    state: Any
    row: torch.Tensor
    first_token: int | None


def pack(s: Shipment) -> bytes:
    buf = io.BytesIO()
    torch.save({"room": s.room, "prompt_len": s.prompt_len, "state": s.state, "row": s.row, "first_token": s.first_token}, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Shipment:
    """Inverse of :func:`pack` (loopback between the kit's own processes only)."""
    try:
        d = torch.load(io.BytesIO(data), weights_only=False)
        return Shipment(int(d["room"]), int(d["prompt_len"]), d["state"], d["row"], d["first_token"])
    except Exception as exc:  # a truncated or foreign body
        raise KitError(f"malformed state transfer: {type(exc).__name__}: {exc}") from None


# ------------------------------------------------------------------ engines
class PrefillEngine(Engine):
    """The normal engine; a PD request's state is captured when it finishes."""

    def __init__(self, model, cfg, faults=None, *, pd_fault: str | None = None) -> None:
        super().__init__(model, cfg, faults)
        self.pd_fault = pd_fault
        self.expected: dict[str, int] = {}  # rid -> room, registered by the route
        self.outbox: dict[int, Shipment] = {}

    def _done(self, req: Req) -> None:
        room = self.expected.pop(req.rid, None)
        if room is not None and not req.error and req.state is not None:
            self.outbox[room] = Shipment(room, len(req.input_ids), self._shipped_state(req), req.last_row,
                                         req.output_ids[0] if req.output_ids else None)
        super()._done(req)

    def _shipped_state(self, req: Req):
        if self.pd_fault != "pd_state_off_by_one" or len(req.input_ids) < 2:
            return req.state
        _, earlier = self.model.extend(self.model.empty_state(), req.input_ids[:-1], keep=1)
        return req.state.with_recurrent_from(earlier)

    def pending(self) -> int:
        return len(self.expected) + len(self.outbox)


class DecodeEngine(Engine):
    """Radix cache off; a request admitted with a shipped state skips its prefill."""

    def __init__(self, model, cfg, faults=None, **_: Any) -> None:
        super().__init__(model, cfg, faults)
        self.inbox: dict[int, Shipment] = {}

    def _prefill(self, req: Req) -> None:
        ship = self.inbox.pop(room_of(req.rid), None)
        if ship is None:  # not a PD request (e.g. /health_generate): compute it here
            super()._prefill(req)
            return
        req.state, req.last_row = ship.state, ship.row
        self.counters["pd_received_tokens"] += ship.prompt_len
        if req.sampling.max_new_tokens > 0 and ship.first_token is not None:
            req.output_ids.append(int(ship.first_token))
            req.output_rows.append(ship.row)

    def pending(self) -> int:
        return len(self.inbox)


ENGINES = {"prefill": PrefillEngine, "decode": DecodeEngine}


# ------------------------------------------------------------------ routes
def _take_route(app: FastAPI, path: str):
    """Remove the route at ``path`` from ``app`` and return its endpoint function."""
    for route in list(app.router.routes):
        if getattr(route, "path", None) == path:
            app.router.routes.remove(route)
            return route.endpoint
    raise KitError(f"the reference server has no {path} route to wrap")


def _as_request(body: bytes) -> StarletteRequest:
    scope = {"type": "http", "method": "POST", "path": "/generate", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return StarletteRequest(scope, receive)


def _rooms(data: dict, bad) -> tuple[list[int], bool]:
    """(rooms, batched) of a PD /generate body; ``bad(msg)`` builds the 400 error."""
    batched = isinstance(data.get("text"), list) or (
        isinstance(data.get("input_ids"), list) and bool(data["input_ids"]) and isinstance(data["input_ids"][0], list))
    raw = data.get("bootstrap_room")
    if raw is None:
        return [], batched
    rooms = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in rooms):
        raise bad("bootstrap_room must be an integer (or a list of integers for a batch)")
    if batched != isinstance(raw, list):
        raise bad("bootstrap_room must be a list exactly when the request is a batch")
    if len(set(rooms)) != len(rooms):
        raise bad("bootstrap_room values of a batch must be distinct")
    return rooms, batched


def _cap_new_tokens(sp: Any, cap: int) -> Any:
    if isinstance(sp, list):
        return [_cap_new_tokens(x, cap) for x in sp]
    if sp is None:
        return {"max_new_tokens": cap}
    n = sp.get("max_new_tokens", 128) if isinstance(sp, dict) else None
    if isinstance(n, int) and not isinstance(n, bool):
        return {**sp, "max_new_tokens": min(n, cap)}
    return sp  # malformed: the inner route answers with its own 400


def install_pd_routes(app: FastAPI, runner, args, role: str, pd_fault: str | None) -> FastAPI:
    """Wrap the reference app's /generate, /metrics and /server_info for ``role``."""
    engine = runner.engine
    inner_generate = _take_route(app, "/generate")
    inner_metrics = _take_route(app, "/metrics")
    inner_info = _take_route(app, "/server_info")
    transfer = httpx.AsyncClient(timeout=args.transfer_timeout, trust_env=False) if role == "prefill" else None

    async def body_of(request: Request) -> dict:
        try:
            data = json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest("the JSON body must be an object")
        return data

    async def ship(rooms: list[int]) -> None:
        for room in rooms:
            s = runner.call(engine.outbox.pop, room, None)
            if s is None:
                raise BadRequest(f"prefill: no state was captured for bootstrap_room {room}", 500)
            try:
                resp = await transfer.post(args.decode_url.rstrip("/") + TRANSFER_PATH, content=pack(s),
                                           headers={ROOM_HEADER: str(room)})
            except httpx.HTTPError as exc:
                raise BadRequest(f"prefill: state transfer to {args.decode_url} failed: {type(exc).__name__}: {exc}", 502) from None
            if resp.status_code != 200:
                raise BadRequest(f"prefill: decode refused the state of room {room}: HTTP {resp.status_code}: {resp.text[:200]}", 502)

    @app.post("/generate")
    async def generate(request: Request):
        data = await body_of(request)
        rooms, batched = _rooms(data, BadRequest)
        if not rooms:
            raise BadRequest(f"{role} server: /generate needs bootstrap_room (send requests through the PD router)")
        rids = [rid_for(r) for r in rooms]
        data["rid"] = rids if batched else rids[0]
        if role == "prefill":
            data["sampling_params"] = _cap_new_tokens(data.get("sampling_params"), 1)
            runner.call(engine.expected.update, dict(zip(rids, rooms)))
            try:
                out = await inner_generate(_as_request(json.dumps(data).encode()))
                await ship(rooms)
            finally:
                runner.call(lambda: [(engine.expected.pop(r, None), engine.outbox.pop(m, None)) for r, m in zip(rids, rooms)])
            return out
        missing = runner.call(lambda: [r for r in rooms if r not in engine.inbox])
        if missing:
            raise BadRequest(f"decode server: no state was received for bootstrap_room {missing[0]}")
        try:
            return await inner_generate(_as_request(json.dumps(data).encode()))
        finally:
            runner.call(lambda: [engine.inbox.pop(r, None) for r in rooms])

    if role == "decode":

        @app.post(TRANSFER_PATH)
        async def receive_transfer(request: Request):
            try:
                s = unpack(await request.body())
            except KitError as exc:
                raise BadRequest(str(exc)) from None
            header = request.headers.get(ROOM_HEADER)
            if header is not None and header != str(s.room):
                raise BadRequest(f"state transfer header room {header} != body room {s.room}")
            runner.call(engine.inbox.__setitem__, s.room, s)
            return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        base = await inner_metrics()
        extra = (f"# HELP {PD_PENDING_TRANSFERS} PD states awaiting shipment (prefill) or unclaimed (decode)\n"
                 f"# TYPE {PD_PENDING_TRANSFERS} gauge\n"
                 f'{PD_PENDING_TRANSFERS}{{model_name="{args.model}"}} {float(runner.call(engine.pending))}\n')
        return PlainTextResponse(base.body.decode() + extra, media_type=base.media_type)

    @app.get("/server_info")
    async def server_info():
        info = inner_info()
        return {**info, "disaggregation_mode": role, "seeded_pd_fault": pd_fault,
                "disaggregation_decode_url": getattr(args, "decode_url", None)}

    return app


# ------------------------------------------------------------------ process entry point
def build_parser():
    p = server_parser()
    p.prog = "python -m conformance.reference.pd"
    p.description = "Serve one PD role (prefill or decode) of a tiny twin with SGLang's HTTP API."
    p.add_argument("--disaggregation-mode", required=True, choices=ROLES, help="the PD role of this process")
    p.add_argument("--decode-url", default=None, help="prefill role: the decode role's base URL (where states are shipped)")
    p.add_argument("--transfer-timeout", type=float, default=60.0, help="seconds one state transfer may take")
    return p


def build_role_engine(args, faults: FaultSwitch, pd_fault: str | None) -> Engine:
    """The role's engine (the decode role always runs with its radix cache off)."""
    if args.disaggregation_mode == "decode":
        args.disable_radix_cache = True
    base = build_engine(args, faults)  # validates the flags and loads the model once
    return ENGINES[args.disaggregation_mode](base.model, base.cfg, faults, pd_fault=pd_fault)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    role = args.disaggregation_mode
    if role == "prefill" and not args.decode_url:
        print("python -m conformance.reference.pd: error: the prefill role needs --decode-url", file=sys.stderr)
        return 2
    try:
        torch.set_num_threads(1)
        faults, pd_fault = read_faults()
        engine = build_role_engine(args, faults, pd_fault)
    except KitError as exc:
        print(f"python -m conformance.reference.pd: error: {exc}", file=sys.stderr)
        return 2
    if faults.name or faults.lazy_alloc_fail or pd_fault:
        log.warning("seeded fault active: %r, pd fault %r", faults, pd_fault)
    log.info("PD %s role, strategy %s, radix cache %s", role, args.strategy, "off" if args.disable_radix_cache else "on")
    return run_app(
        engine,
        lambda runner: install_pd_routes(create_app(runner, args, faults), runner, args, role, pd_fault),
        args,
        prog="python -m conformance.reference.pd",
    )


if __name__ == "__main__":
    sys.exit(main())
