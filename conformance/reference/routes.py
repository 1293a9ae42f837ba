"""Routes of the reference server: SGLang's native API (``/generate`` with ``stream=true`` in
SGLang's SSE form, sessions, ``/abort_request`` with ``abort_all``, health, info, metrics);
the OpenAI routes are in ``openai_routes.py``.

Errors are SGLang-shaped JSON (``{"error": {"message", "type", "code"}}``) with a 4xx
status for bad input; a dead scheduler (idle leak check in strict mode, or a crash) makes
``/health``, ``/server_info`` and generation 503, as SGLang's server does once its scheduler died.  A
request aborted by ``/abort_request`` answers 200 with ``finish_reason.type == "abort"``,
as SGLang's does.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse

from conformance.errors import KitError
from conformance.reference.api_models import AbortIn, CloseSessionIn, GenerateIn, OpenSessionIn, SamplingParamsIn, per_item
from conformance.reference.http_common import BadRequest, Serving, error_response, parse_body, sse
from conformance.reference.metrics import render_metrics
from conformance.reference.openai_routes import add_openai_routes
from conformance.reference.request import result_dict


def create_app(runner, args, faults) -> FastAPI:
    serving = Serving(runner, args)
    engine, model = serving.engine, serving.model
    alive, make_req, run = serving.alive, serving.make_req, serving.run
    app = FastAPI(title="hybrid-conformance reference server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(f"invalid request: {where}: {first.get('msg', 'bad value')}".replace(": :", ":"), 400)

    @app.exception_handler(BadRequest)
    async def _bad(_request, exc: BadRequest):
        return error_response(str(exc), exc.status)

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
        alive()  # SGLang answers from its scheduler's state: a dead scheduler leaves it unanswered
        return {
            "model_path": args.model, "served_model_name": args.model, "engine": "hybrid-conformance reference",
            "tokenizer_path": str(getattr(model, "path", "")) or None,
            "version": "0.5.23-reference", "mamba_radix_cache_strategy": args.strategy,
            "mamba_scheduler_strategy": args.strategy, "disable_radix_cache": args.disable_radix_cache,
            "page_size": args.page_size, "mamba_track_interval": args.track_interval,
            "mamba_cache_chunk_size": engine.chunk, "mamba_checkpoint_grid": engine.checkpoint_grid,
            "mamba_track_grid": engine.track_grid, "max_mamba_cache_size": args.max_mamba_slots,
            "max_running_requests": engine.req_pool.size, "max_total_num_tokens": args.kv_tokens,
            "context_length": model.max_context, "vocab_size": model.vocab_size,
            "disable_overlap_schedule": True, "chunked_prefill_size": None, "seeded_fault": faults.name,
            "lazy_alloc_fail": faults.lazy_alloc_fail,
        }

    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)
    app.get("/get_model_info")(lambda: {"model_path": args.model, "is_generation": True})

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(runner.stats, args.model),
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
        if body.abort_all:
            runner.call(engine.abort_all)
        elif body.rid:
            runner.call(engine.abort, body.rid)
        else:
            raise BadRequest("give a rid or abort_all=true")
        return PlainTextResponse("")

    # ------------------------------------------------------------ generation
    @app.post("/generate")
    async def generate(request: Request):
        body = await parse_body(request, GenerateIn)
        alive()
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
        if body.session_params is not None and (n != 1 or any(sp.n != 1 for sp in per_item(body.sampling_params or SamplingParamsIn(), 1, "sampling_params"))):
            raise BadRequest("session_params needs a single request (n=1)")
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
            reqs += [req] + [serving.make_req(req.input_ids, sp, rid=None, return_logprob=lp, start=st, top=top)
                             for _ in range(sp.n - 1)]  # n > 1: parallel samples of the same prompt
        batched = batched or len(reqs) > 1
        if body.stream:
            if len(reqs) != 1:
                raise BadRequest("stream=true takes a single request (n=1)")
            return StreamingResponse(_generate_events(serving, reqs[0]), media_type="text/event-stream")
        done = await run(reqs)
        out = [result_dict(r, model.tokenizer.decode) for r in done]
        return out if batched else out[0]

    add_openai_routes(app, serving)
    return app


async def _generate_events(serving: Serving, req):
    """SGLang's /generate stream: cumulative ``text``/``output_ids`` per event, then ``[DONE]``;
    an error after the stream started is an event with an ``error`` object."""
    try:
        async for r in serving.stream(req):
            out = result_dict(r, serving.model.tokenizer.decode)
            if r.finish_reason is None:
                out["meta_info"]["finish_reason"] = None
            yield sse(out)
    except BadRequest as exc:
        yield sse({"error": {"message": str(exc), "code": exc.status}})
    yield sse("[DONE]")
