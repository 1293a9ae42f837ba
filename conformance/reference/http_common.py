"""What every route of the reference server shares: SGLang-shaped JSON errors, body parsing,
request building against the engine's limits, running (whole or streamed), and SSE framing.

Errors are ``{"error": {"message", "type", "code"}}`` with a 4xx status for bad input; a dead
scheduler makes generation 503, as SGLang's server does once its scheduler died.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from conformance.errors import KitError
from conformance.reference.api_models import SamplingParamsIn
from conformance.reference.request import Req, SamplingParams, new_rid


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "ServiceUnavailableError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def parse_body(request: Request, model):
    """JSON body of any content type, validated by ``model``; 400 on malformed JSON or bad fields."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(f"invalid request: {where}: {first.get('msg', 'bad value')}") from None


def sse(payload: Any) -> str:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Serving:
    """The engine as the routes see it: liveness, request building, whole and streamed runs."""

    def __init__(self, runner, args) -> None:
        self.runner, self.args = runner, args
        self.engine, self.model = runner.engine, runner.engine.model

    def alive(self) -> None:
        if self.engine.dead:
            raise BadRequest(f"scheduler is dead: {self.engine.dead}", 503)

    def make_req(self, ids: list[int], sp: SamplingParamsIn, *, rid, return_logprob=False, start=-1, top=0) -> Req:
        model = self.model
        if not ids:
            raise BadRequest("empty input: give a non-empty text or input_ids")
        if any(t >= model.vocab_size for t in ids):
            raise BadRequest(f"token id out of range [0, {model.vocab_size})")
        if len(ids) + sp.max_new_tokens > model.max_context:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of {model.max_context} "
                             f"tokens: input ({len(ids)} tokens) plus max_new_tokens ({sp.max_new_tokens})")
        if start > len(ids):
            raise BadRequest(f"logprob_start_len={start} is higher than the number of input tokens {len(ids)}")
        if top < 0:
            raise BadRequest("top_logprobs_num must be >= 0")
        params = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                                ignore_eos=sp.ignore_eos, stop=sp.stop_list(),
                                stop_token_ids=list(sp.stop_token_ids or []), seed=sp.sampling_seed)
        return Req(rid or new_rid(), list(ids), params, return_logprob=return_logprob,
                   logprob_start_len=start, top_logprobs_num=top)

    def _check(self, req: Req) -> None:
        if req.error and self.engine.dead:
            raise BadRequest(f"scheduler is dead: {self.engine.dead}", 503)

    async def run(self, reqs: list[Req]) -> list[Req]:
        """Run ``reqs`` to completion (a user abort is a result; a refused request an error)."""
        try:
            done = await self.runner.run(reqs)
        except KitError as exc:
            raise BadRequest(str(exc), 503) from None
        except TimeoutError:
            raise BadRequest("request timed out", 504) from None
        for r in done:
            self._check(r)
            if r.error:
                raise BadRequest(f"request {r.rid} aborted: {r.error}", 400)
        return done

    async def stream(self, req: Req) -> AsyncIterator[Req]:
        """``req`` after each new output token, then once finished (errors end the stream)."""
        try:
            async for r in self.runner.stream(req):
                self._check(r)
                yield r
        except KitError as exc:
            raise BadRequest(str(exc), 503) from None
