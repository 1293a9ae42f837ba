"""Routes of the reference server: SGLang's native API and OpenAI ``/v1/completions``.

Errors are SGLang-shaped JSON (``{"error": {"message", "type", "code"}}``) with a 4xx
status for bad input; a dead scheduler (idle leak check in strict mode, or a crash) makes
``/health`` 503 and generation 503, as SGLang's server does once its scheduler died.
"""

from __future__ import annotations

import json
import time

from pydantic import ValidationError

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse

from conformance.errors import KitError
from conformance.reference.api_models import (AbortIn, CloseSessionIn, CompletionIn, GenerateIn, OpenSessionIn,
                                              SamplingParamsIn, per_item)
from conformance.reference.metrics import render_metrics
from conformance.reference.request import Req, SamplingParams, result_dict


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> JSONResponse:
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


def create_app(runner, args, faults) -> FastAPI:
    engine, model = runner.engine, runner.engine.model
    app = FastAPI(title="hybrid-conformance reference server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(f"invalid request: {where}: {first.get('msg', 'bad value')}".replace(": :", ":"), 400)

    @app.exception_handler(BadRequest)
    async def _bad(_request, exc: BadRequest):
        return _error(str(exc), exc.status)

    def alive() -> None:
        if engine.dead:
            raise BadRequest(f"scheduler is dead: {engine.dead}", 503)

    def make_req(ids: list[int], sp: SamplingParamsIn, *, rid, return_logprob=False, start=-1, top=0) -> Req:
        if not ids:
            raise BadRequest("empty input: give a non-empty text or input_ids")
        if any(t >= model.vocab_size for t in ids):
            raise BadRequest(f"token id out of range [0, {model.vocab_size})")
        if len(ids) + sp.max_new_tokens > model.max_context:
            raise BadRequest(f"input ({len(ids)} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds "
                             f"the context length {model.max_context}")
        if start > len(ids):
            raise BadRequest(f"logprob_start_len={start} is higher than the number of input tokens {len(ids)}")
        if top < 0:
            raise BadRequest("top_logprobs_num must be >= 0")
        params = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                                ignore_eos=sp.ignore_eos, stop=sp.stop_list(),
                                stop_token_ids=list(sp.stop_token_ids or []), seed=sp.sampling_seed)
        from conformance.reference.server import new_rid

        return Req(rid or new_rid(), list(ids), params, return_logprob=return_logprob,
                   logprob_start_len=start, top_logprobs_num=top)

    async def run(reqs: list[Req]) -> list[Req]:
        try:
            done = await runner.run(reqs)
        except KitError as exc:
            raise BadRequest(str(exc), 503) from None
        except TimeoutError:
            raise BadRequest("request timed out", 504) from None
        for r in done:
            if r.error and engine.dead:
                raise BadRequest(f"scheduler is dead: {engine.dead}", 503)
        return done

    # ------------------------------------------------------------ health / info
    @app.get("/health")
    async def health():
        alive()
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate():
        alive()
        req = make_req([model.eos_token_id + 1 if model.eos_token_id + 1 < model.vocab_size else 0],
                       SamplingParamsIn(max_new_tokens=1, temperature=0.0), rid=None)
        await run([req])
        return PlainTextResponse("")

    def server_info() -> dict:
        return {
            "model_path": args.model, "served_model_name": args.model, "engine": "hybrid-conformance reference",
            "tokenizer_path": str(getattr(model, "path", "")) or None,
            "version": "0.5.23-reference", "mamba_radix_cache_strategy": args.strategy,
            "mamba_scheduler_strategy": args.strategy, "disable_radix_cache": args.disable_radix_cache,
            "page_size": args.page_size, "mamba_track_interval": args.track_interval,
            "mamba_cache_chunk_size": engine.chunk, "mamba_checkpoint_grid": engine.checkpoint_grid,
            "mamba_track_grid": engine.track_grid, "max_mamba_cache_size": args.max_mamba_slots,
            "max_running_requests": args.max_running_requests, "max_total_num_tokens": args.kv_tokens,
            "context_length": model.max_context, "vocab_size": model.vocab_size,
            "disable_overlap_schedule": True, "chunked_prefill_size": None, "seeded_fault": faults.name,
            "lazy_alloc_fail": faults.lazy_alloc_fail,
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)
    app.get("/get_model_info")(lambda: {"model_path": args.model, "is_generation": True})
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": args.model, "object": "model",
                                                                "max_model_len": model.max_context}]})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(runner.call(engine.stats), args.model),
                                 media_type="text/plain; version=0.0.4")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if runner.call(engine.flush):
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed: there are running or waiting requests.\n", status_code=400)

    # ------------------------------------------------------------ sessions
    @app.post("/open_session")
    async def open_session(request: Request):
        body = await parse_body(request, OpenSessionIn)
        try:
            return runner.call(engine.sessions.open, body.session_id, body.capacity_of_str_len,
                               body.streaming, body.timeout)
        except KitError as exc:
            raise BadRequest(str(exc)) from None

    @app.post("/close_session")
    async def close_session(request: Request):
        body = await parse_body(request, CloseSessionIn)
        if not runner.call(engine.sessions.close, engine, body.session_id):
            raise BadRequest(f"session id {body.session_id} does not exist", 404)
        return PlainTextResponse("")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await parse_body(request, AbortIn)
        runner.call(engine.abort, body.rid)
        return PlainTextResponse("")

    # ------------------------------------------------------------ generation
    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateIn)
        alive()
        if body.stream:
            raise BadRequest("stream=true is not supported by the reference server")
        if (body.text is None) == (body.input_ids is None):
            raise BadRequest("give exactly one of text or input_ids")
        batched = isinstance(body.text, list) or (bool(body.input_ids) and isinstance(body.input_ids[0], list))
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            prompts = [model.tokenizer.encode(t) for t in texts]
        else:
            prompts = body.input_ids if batched else [body.input_ids]
        n = len(prompts)
        if n == 0:
            raise BadRequest("empty batch")
        if body.session_params is not None and n != 1:
            raise BadRequest("session_params needs a single request")
        try:
            sps = per_item(body.sampling_params or SamplingParamsIn(), n, "sampling_params")
            lps = per_item(body.return_logprob, n, "return_logprob")
            starts = per_item(body.logprob_start_len, n, "logprob_start_len")
            tops = per_item(body.top_logprobs_num, n, "top_logprobs_num")
            rids = per_item(body.rid, n, "rid")
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        reqs = []
        for ids, sp, lp, st, top, rid in zip(prompts, sps, lps, starts, tops, rids):
            if body.session_params is not None:
                req = make_req(ids or [0], sp, rid=rid, return_logprob=lp, start=st, top=top)
                req.input_ids = list(ids)
                try:
                    runner.call(engine.sessions.prepare, req, body.session_params.model_dump())
                except KitError as exc:
                    raise BadRequest(str(exc)) from None
                if not req.input_ids:
                    raise BadRequest("empty input: give a non-empty text or input_ids")
            else:
                req = make_req(ids, sp, rid=rid, return_logprob=lp, start=st, top=top)
            reqs.append(req)
        done = await run(reqs)
        for r in done:
            if r.error:
                raise BadRequest(f"request {r.rid} aborted: {r.error}", 400)
        out = [result_dict(r, model.tokenizer.decode) for r in done]
        return out if batched else out[0]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionIn)
        alive()
        if body.stream:
            raise BadRequest("stream=true is not supported by the reference server")
        p = body.prompt
        if isinstance(p, str):
            prompts = [model.tokenizer.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [model.tokenizer.encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = p
        else:
            prompts = [p]
        sp = SamplingParamsIn(max_new_tokens=body.max_tokens, temperature=body.temperature, stop=body.stop,
                              sampling_seed=body.seed)
        want_lp = body.logprobs is not None
        reqs = [make_req(ids, sp, rid=None, return_logprob=want_lp, start=0 if body.echo and want_lp else -1,
                         top=body.logprobs or 0) for ids in prompts]
        done = await run(reqs)
        choices = [_choice(i, r, body, model) for i, r in enumerate(done)]
        ptoks = sum(len(r.input_ids) for r in done)
        ctoks = sum(len(r.output_ids) for r in done)
        return {"id": f"cmpl-{done[0].rid}", "object": "text_completion", "created": int(time.time()),
                "model": args.model, "choices": choices,
                "usage": {"prompt_tokens": ptoks, "completion_tokens": ctoks, "total_tokens": ptoks + ctoks}}

    return app


def _choice(index: int, req: Req, body: CompletionIn, model) -> dict:
    res = result_dict(req, model.tokenizer.decode)
    text = res["text"]
    if body.echo:
        text = model.tokenizer.decode(req.input_ids) + text
    logprobs = None
    if body.logprobs is not None:
        meta = res["meta_info"]
        entries = (meta.get("input_token_logprobs", []) if body.echo else []) + meta["output_token_logprobs"]
        tops = ((meta.get("input_top_logprobs", []) if body.echo else []) + meta.get("output_top_logprobs", [])
                if body.logprobs else [None] * len(entries))
        tokens = [model.tokenizer.decode([tok], skip_special_tokens=False) for _lp, tok, _ in entries]
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _tok, _ in entries],
            "top_logprobs": [None if t is None else {model.tokenizer.decode([tok], skip_special_tokens=False): lp
                                                     for lp, tok, _ in t} for t in tops],
            "text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
        }
    reason = (req.finish_reason or {}).get("type")
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": "length" if reason == "length" else "stop"}

