"""One generation request inside the reference engine: inputs, sampling, the slots and
track bookkeeping it holds, and its SGLang-shaped result (``text``, ``output_ids``,
``meta_info``)."""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from conformance.reference.radix import Node, Snapshot


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    session_id: str | None = None
    on_done: Callable[["Req"], None] | None = None
    on_token: Callable[["Req"], None] | None = None  # streaming: called after each new output token

    # set by the engine
    output_ids: list[int] = field(default_factory=list)
    output_rows: list[torch.Tensor] = field(default_factory=list)
    input_entries: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    state: Any = None
    last_row: torch.Tensor | None = None
    prefix_len: int = 0
    kv_hit_len: int = 0
    branching_seqlen: int | None = None
    lock_node: Node | None = None
    working_slot: int | None = None
    pingpong: list[int | None] = field(default_factory=lambda: [None, None])
    track: dict[int, Snapshot] = field(default_factory=dict)
    next_track_idx: int = 0
    last_track_idx: int | None = None
    last_track_seqlen: int | None = None
    prev_track_seqlen: int | None = None
    lazy_pending: int | None = None
    kv_reserved: int = 0
    holds_row: bool = False
    finish_reason: dict | None = None
    error: str | None = None
    reported_cached_tokens: int = 0

    @property
    def start(self) -> int:
        """SGLang's resolved logprob_start_len: -1 means output tokens only."""
        return len(self.input_ids) if self.logprob_start_len < 0 else self.logprob_start_len

    def max_prefix_len(self) -> int:
        limit = len(self.input_ids) - 1
        if self.return_logprob and self.logprob_start_len >= 0:
            limit = min(limit, self.logprob_start_len)
        return max(limit, 0)

    def all_tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def pingpong_slots(self) -> list[int]:
        return [s for s in self.pingpong if s is not None]

    def held_slots(self) -> int:
        return (self.working_slot is not None) + len(self.pingpong_slots())


def new_rid() -> str:
    """A fresh request id (a uuid4 hex, as SGLang's server makes one)."""
    return uuid.uuid4().hex


def sample(row: torch.Tensor, params: SamplingParams, rid: str, step: int) -> int:
    """Greedy at temperature 0, else a draw seeded by (seed or rid, step)."""
    if params.temperature <= 0:
        return int(torch.argmax(row))
    seed = params.seed if params.seed is not None else zlib.crc32(rid.encode())
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    probs = torch.softmax(row / params.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def check_finish(req: Req, eos_token_id: int, decode: Callable[[list[int]], str]) -> None:
    """Set ``req.finish_reason`` after a new output token, SGLang style."""
    if not req.output_ids:
        if req.sampling.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        return
    last = req.output_ids[-1]
    if not req.sampling.ignore_eos and (last == eos_token_id or last in req.sampling.stop_token_ids):
        req.finish_reason = {"type": "stop", "matched": last}
        return
    if req.sampling.stop:
        text = decode(req.output_ids)
        for s in req.sampling.stop:
            if s and s in text:
                req.finish_reason = {"type": "stop", "matched": s}
                return
    if len(req.output_ids) >= req.sampling.max_new_tokens:
        req.finish_reason = {"type": "length", "length": req.sampling.max_new_tokens}


def top_entries(row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    vals, idx = torch.topk(row, min(k, row.shape[-1]))
    return [(float(v), int(i)) for v, i in zip(vals, idx)]


def result_dict(req: Req, decode: Callable[[list[int]], str]) -> dict:
    """The /generate response for one finished request."""
    text = decode(req.output_ids)
    if req.finish_reason and isinstance(req.finish_reason.get("matched"), str):
        text = text[: text.find(req.finish_reason["matched"])]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.reported_cached_tokens,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in req.input_entries]
        meta["output_token_logprobs"] = [
            [float(row[tok]), tok, None] for row, tok in zip(req.output_rows, req.output_ids)
        ]
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if t is None else [[lp, tok, None] for lp, tok in t] for t in req.input_top
            ]
            meta["output_top_logprobs"] = [
                [[lp, tok, None] for lp, tok in top_entries(row, req.top_logprobs_num)] for row in req.output_rows
            ]
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
