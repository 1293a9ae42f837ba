"""OpenAI-compatible routes of the reference server, shaped like SGLang's: ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (the twin's chat template), each with
``n`` samples per prompt and ``stream=true`` (``data: {chunk}`` events, then
``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from conformance.reference.api_models import ChatCompletionIn, CompletionIn, SamplingParamsIn
from conformance.reference.http_common import BadRequest, Serving, parse_body, sse
from conformance.reference.request import Req, result_dict


def _finish(req: Req) -> str | None:
    reason = (req.finish_reason or {}).get("type")
    return None if reason is None else ("length" if reason == "length" else "abort" if reason == "abort" else "stop")


def _usage(reqs: list[Req], prompts: list[list[int]]) -> dict[str, int]:
    ptoks = sum(len(p) for p in prompts)
    ctoks = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": ptoks, "completion_tokens": ctoks, "total_tokens": ptoks + ctoks}


def _text(serving: Serving, req: Req) -> str:
    return result_dict(req, serving.model.tokenizer.decode)["text"]


def add_openai_routes(app: FastAPI, serving: Serving) -> None:
    args, model = serving.args, serving.model

    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": args.model, "object": "model", "owned_by": "reference",
                                                                "max_model_len": model.max_context}]})

    def expand(prompts: list[list[int]], sp: SamplingParamsIn, n: int, *, logprobs: int | None = None, echo=False) -> list[Req]:
        want = logprobs is not None
        return [serving.make_req(ids, sp, rid=None, return_logprob=want, start=0 if echo and want else -1, top=logprobs or 0)
                for ids in prompts for _ in range(n)]

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionIn)
        serving.alive()
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
        reqs = expand(prompts, sp, body.n, logprobs=body.logprobs, echo=body.echo)
        head = {"id": f"cmpl-{reqs[0].rid}", "object": "text_completion", "created": int(time.time()), "model": args.model}
        if body.stream:
            if body.echo or body.logprobs is not None:
                raise BadRequest("stream=true with echo or logprobs is not supported by the reference server")
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(serving, reqs, prompts, head, usage, _completion_delta), media_type="text/event-stream")
        done = await serving.run(reqs)
        choices = [_completion_choice(i, r, body, serving) for i, r in enumerate(done)]
        return {**head, "choices": choices, "usage": _usage(done, [r.input_ids for r in done])}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionIn)
        serving.alive()
        text = model.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                   add_generation_prompt=True)
        prompts = [model.tokenizer.encode(text)]
        sp = SamplingParamsIn(max_new_tokens=body.new_tokens(), temperature=body.temperature, stop=body.stop,
                              sampling_seed=body.seed)
        top = body.top_logprobs if body.logprobs else None
        reqs = expand(prompts, sp, body.n, logprobs=(top or 0) if body.logprobs else None)
        head = {"id": f"chatcmpl-{reqs[0].rid}", "object": "chat.completion", "created": int(time.time()), "model": args.model}
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(serving, reqs, prompts, {**head, "object": "chat.completion.chunk"}, usage,
                                             _chat_delta), media_type="text/event-stream")
        done = await serving.run(reqs)
        choices = [{"index": i, "message": {"role": "assistant", "content": _text(serving, r)},
                    "logprobs": _chat_logprobs(r, serving, top or 0) if body.logprobs else None,
                    "finish_reason": _finish(r)} for i, r in enumerate(done)]
        return {**head, "choices": choices, "usage": _usage(done, [r.input_ids for r in done])}


def _completion_delta(index: int, delta: str, first: bool, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": delta, "logprobs": None, "finish_reason": finish}


def _chat_delta(index: int, delta: str, first: bool, finish: str | None) -> dict[str, Any]:
    content: dict[str, Any] = {"role": "assistant", "content": delta} if first else {"content": delta}
    return {"index": index, "delta": content, "logprobs": None, "finish_reason": finish}


async def _stream(serving: Serving, reqs: list[Req], prompts: list[list[int]], head: dict, usage: bool, delta) -> AsyncIterator[str]:
    """One chunk per new text of each choice (choices run one after another), a usage chunk
    when asked, then ``[DONE]``; an error mid-stream is an ``error`` event."""
    try:
        for index, req in enumerate(reqs):
            sent, first = "", True
            async for r in serving.stream(req):
                text = _text(serving, r)
                finish = _finish(r)
                if text != sent or finish is not None or first:
                    yield sse({**head, "choices": [delta(index, text[len(sent):], first, finish)]})
                    sent, first = text, False
            if req.error:
                raise BadRequest(f"request {req.rid} aborted: {req.error}", 400)
        if usage:
            yield sse({**head, "choices": [], "usage": _usage(reqs, [r.input_ids for r in reqs])})
    except BadRequest as exc:
        yield sse({"error": {"message": str(exc), "code": exc.status}})
    yield sse("[DONE]")


def _completion_choice(index: int, req: Req, body: CompletionIn, serving: Serving) -> dict:
    tok = serving.model.tokenizer
    res = result_dict(req, tok.decode)
    text = res["text"]
    if body.echo:
        text = tok.decode(req.input_ids) + text
    logprobs = None
    if body.logprobs is not None:
        meta = res["meta_info"]
        entries = (meta.get("input_token_logprobs", []) if body.echo else []) + meta["output_token_logprobs"]
        tops = ((meta.get("input_top_logprobs", []) if body.echo else []) + meta.get("output_top_logprobs", [])
                if body.logprobs else [None] * len(entries))
        tokens = [tok.decode([t], skip_special_tokens=False) for _lp, t, _ in entries]
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _t, _ in entries],
            "top_logprobs": [None if t is None else {tok.decode([x], skip_special_tokens=False): lp for lp, x, _ in t}
                             for t in tops],
            "text_offset": [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))],
        }
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(req) or "stop"}


def _chat_logprobs(req: Req, serving: Serving, top: int) -> dict:
    tok = serving.model.tokenizer
    meta = result_dict(req, tok.decode)["meta_info"]
    tops = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]
    return {"content": [{"token": tok.decode([t], skip_special_tokens=False), "logprob": lp,
                         "top_logprobs": [{"token": tok.decode([x], skip_special_tokens=False), "logprob": v}
                                          for v, x, _ in row][:top]}
                        for (lp, t, _), row in zip(meta["output_token_logprobs"], tops)]}
