"""Turn a program's symbolic steps into concrete ``/generate`` payloads at play time.

* a follow-up ``After(rid, cut)`` cuts the finished request's prompt + output at the
  last track or checkpoint boundary (or one token either side of it), at its prompt, its
  half, or not at all;
* ``logprob_start`` names are resolved against the input length; a stop condition takes
  a token (or two characters of text) from a finished request's output;
* ``overflow`` sets ``max_new_tokens`` one past what the context can hold;
* session turns get the full input SGLang builds for them (``session_controller``): a
  non-streaming turn continues ``parent``'s input + output (``drop_output``: its input
  only; ``offset``: cut there), a streaming turn continues the session's last turn that
  finished (an aborted turn is not continued).

Every request -- sends, burst members and session turns, in exact mode too -- asks for
output logprobs and a top-5: the oracle compares the served distribution, not only the
greedy token (a logprob error of 7.6e-2 once kept the token).  That changes no prefix matching: SGLang resolves
``logprob_start_len=-1`` with ``return_logprob`` to the input length
(``Scheduler.handle_generate_request``), past its match limit.  Except on a mixed-chunk
server: SGLang mixes a prefill into the running decodes only when neither returns logprobs,
so there burst members ask none (their answers are judged by their tokens against the cold
argmax) and their checkpoints are stored from mixed batches for the follow-ups to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.checks.hit_bounds import StrategyGrid
from conformance.checks.prefix_oracle import floor_to
from conformance.checks.strip_thinking import REASONING_FIELD
from conformance.programs.oracle import Limits, Served
from conformance.programs.program import LAND_MAX_NEW, After, Burst, SendOptions, Program, Root, Send, Turn

Key = tuple[int, ...]


def cut_position(cut: str, full: int, prompt: int, grid: StrategyGrid) -> int:
    """Where ``cut`` falls in a sequence of ``full`` tokens whose prompt had ``prompt``."""
    track = floor_to(full, grid.track_grid)
    chunk = floor_to(full, grid.checkpoint_grid)
    pos = {
        "all": full, "prompt": prompt, "half": full // 2,
        "track": track, "track-1": track - 1, "track+1": track + 1,
        "chunk": chunk, "chunk+1": chunk + 1,
    }[cut]
    if pos <= 0 or pos > full:
        pos = full
    return pos


@dataclass
class _Session:
    streaming: bool
    last_ok: str | None = None  # streaming: the last turn that finished normally
    in_flight: str | None = None
    turns_ok_len: int = 0  # longest sequence a turn of this session finished with


class Resolver:
    def __init__(self, program: Program, grid: StrategyGrid, limits: Limits, *, exact: bool, tag: str, mixed: bool = False) -> None:
        self.p, self.grid, self.limits, self.exact, self.tag = program, grid, limits, exact, tag
        self.mixed = mixed  # a mixed-chunk server: bursts ask no logprobs, so SGLang may mix their prefills into decodes
        self.sessions: dict[str, _Session] = {}

    def server_rid(self, rid: str) -> str:
        return f"{self.tag}-{rid}"

    # ------------------------------------------------------------ sources
    def root(self, base: Root) -> Key:
        tokens = self.p.forest[base.root % len(self.p.forest)]
        return tokens[: max(1, min(base.length, len(tokens)))]

    def base_tokens(self, base: Root | After, served: dict[str, Served]) -> Key:
        if isinstance(base, Root):
            return self.root(base)
        prev = served.get(base.rid)
        if prev is None:  # the program never sent it (a shrunk program): fall back to root 0
            return self.root(Root(0, len(self.p.forest[0])))
        full = prev.input_ids + (prev.output_ids if prev.answered else ())
        return full[: cut_position(base.cut, len(full), len(prev.input_ids), self.grid)]

    # ------------------------------------------------------------ payloads
    def _sampling(self, max_new: int, opts: SendOptions, served: dict[str, Served]) -> dict[str, Any]:
        sp: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": opts.ignore_eos}
        stop = opts.stop
        src = served.get(stop.rid) if stop else None
        if stop and src is not None and src.output_ids:
            if stop.kind == "token":
                sp["stop_token_ids"] = [src.output_ids[stop.at % len(src.output_ids)]]
            else:
                text = str((src.response or {}).get("text") or "")
                if len(text.strip()) >= 2:
                    i = stop.at % (len(text) - 1)
                    if text[i : i + 2].strip():
                        sp["stop"] = [text[i : i + 2]]
        return sp

    def _logprob_fields(self, opts: SendOptions, n_input: int) -> dict[str, Any]:
        out: dict[str, Any] = {"return_logprob": True, "return_text_in_logprobs": False, "top_logprobs_num": max(opts.top_logprobs_num, 5)}
        start = {"none": None, "zero": 0, "half": n_input // 2, "last": n_input - 1}[opts.logprob_start]
        if opts.return_logprob and start is not None:
            out["logprob_start_len"] = max(0, start)
        return out

    def send(self, step: Send, served: dict[str, Served]) -> tuple[Key, int, dict[str, Any], dict[str, Any]]:
        ids = self.base_tokens(step.base, served) + tuple(step.suffix)
        max_new = step.max_new
        if step.land:  # committed = len + max_new - 1 lands on (boundary + delta)
            delta = {"boundary": 0, "boundary-1": -1, "boundary+1": 1}[step.land]
            boundary = (len(ids) // self.grid.track_grid + 1) * self.grid.track_grid
            want = boundary + delta - len(ids) + 1
            if 1 <= want <= LAND_MAX_NEW:
                max_new = want
        if step.overflow:
            max_new = self.limits.context_len - len(ids) + 1
        payload: dict[str, Any] = {
            "input_ids": list(ids), "rid": self.server_rid(step.rid),
            "sampling_params": self._sampling(max_new, step.options, served),
            **self._logprob_fields(step.options, len(ids)),
        }
        opts = {k: payload.get(k) for k in ("return_logprob", "logprob_start_len", "top_logprobs_num")}
        if step.options.reasoning:  # on a strip-thinking server only its prompt is kept (conformance.checks.strip_thinking)
            payload[REASONING_FIELD] = opts[REASONING_FIELD] = True
        return ids, max_new, payload, opts

    def burst(self, step: Burst) -> tuple[list[Key], dict[str, Any]]:
        head = self.root(step.base)
        prompts = [head + tuple(s) for s in step.suffixes]
        payload: dict[str, Any] = {
            "input_ids": [list(p) for p in prompts],
            "rid": [self.server_rid(r) for r in step.rids()],
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": step.max_new, "ignore_eos": True} for _ in prompts],
        }
        if not self.mixed:  # SGLang never mixes a batch that returns logprobs: a burst's answer is then judged by its tokens
            payload.update({"return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": False})
        return prompts, payload

    # ------------------------------------------------------------ sessions
    def open(self, sid: str, streaming: bool) -> None:
        self.sessions[sid] = _Session(streaming)

    def close(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def session_in_flight(self, sid: str) -> str | None:
        s = self.sessions.get(sid)
        return s.in_flight if s else None

    def turn(self, step: Turn, server_sid: str, served: dict[str, Served]) -> tuple[Key, dict[str, Any], dict[str, Any]]:
        s = self.sessions[step.sid]
        params: dict[str, Any] = {"id": server_sid}
        meta: dict[str, Any] = {"in_streaming_session": s.streaming}
        if s.streaming:
            prev = served.get(s.last_ok) if s.last_ok else None
            history = prev.input_ids + prev.output_ids[: prev.max_new] if prev is not None else ()
            if prev is not None:
                meta["streaming_turn"] = True
                meta["prev_committed"] = len(history) - 1
        else:
            parent = served.get(step.parent) if step.parent else None
            if parent is None:
                history = ()
            else:
                params["rid"] = self.server_rid(step.parent)
                history = parent.input_ids if step.drop_output else parent.input_ids + parent.output_ids[: parent.max_new]
                if step.drop_output:
                    params["drop_previous_output"] = True
                if step.offset:
                    pos = cut_position(step.offset, len(history), len(parent.input_ids), self.grid)
                    if 0 < pos < len(history):
                        params["offset"] = pos
                        history = history[:pos]
                if step.replace:
                    params["replace"] = True
        ids = tuple(history) + tuple(step.suffix)
        payload = {
            "input_ids": list(step.suffix), "rid": self.server_rid(step.rid), "session_params": params,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": step.max_new, "ignore_eos": True},
            **self._logprob_fields(SendOptions(), len(ids)),
        }
        s.in_flight = step.rid
        return ids, payload, meta

    def session_locks(self) -> dict[str, float]:
        """What open streaming sessions may keep locked in the tree at idle (bounds): the KV
        of each one's held sequence, and one state per checkpoint-grid step of it."""
        kv = mamba = 0.0
        for s in self.sessions.values():
            held = s.turns_ok_len if s.streaming else 0
            kv += held
            mamba += held // self.grid.checkpoint_grid + 2 if held else 0
        return {"kv": kv, "mamba": mamba}

    def finished(self, r: Served) -> None:
        """A turn's answer: a streaming session continues only a normally finished turn."""
        for s in self.sessions.values():
            if s.in_flight == r.rid:
                s.in_flight = None
                if r.answered and r.finish_type in ("length", "stop"):  # an abort that came too late changes nothing
                    s.last_ok = r.rid
                    s.turns_ok_len = max(s.turns_ok_len, len(r.input_ids) + len(r.output_ids))
