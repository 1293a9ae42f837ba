"""Sessions of the reference engine, shaped like SGLang's (``/open_session``,
``/close_session``, ``session_params`` on ``/generate``).

A non-streaming session keeps each turn's tokens; a new turn's prompt is its parent turn's
tokens (cut at ``offset``, without the output if ``drop_previous_output``) plus the new
input, and reuse goes through the radix cache.  A streaming session keeps the finished
turn itself: its state, working and ping-pong slots, KV and request row move to the session
(``session_held`` in the idle invariant) and on to the next turn, and are released (and the
sequence inserted into the cache) at close or timeout — the ownership hand-over on which
SGLang leaked ping-pong slots (PR 26941).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from conformance.errors import KitError
from conformance.reference.request import Req


@dataclass
class Session:
    session_id: str
    capacity_of_str_len: int
    streaming: bool
    timeout: float | None
    last_active: float = field(default_factory=time.monotonic)
    turns: dict[str, list[int]] = field(default_factory=dict)  # rid -> all tokens of the turn
    turn_inputs: dict[str, list[int]] = field(default_factory=dict)
    last_rid: str | None = None
    held: Req | None = None
    in_flight: str | None = None


class SessionStore:
    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}

    # ------------------------------------------------------------ open / close
    def open(self, session_id: str | None, capacity_of_str_len: int, streaming: bool, timeout: float | None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise KitError(f"session id {sid} already exists")
        self.sessions[sid] = Session(sid, capacity_of_str_len, streaming, timeout)
        return sid

    def close(self, engine, session_id: str) -> bool:
        s = self.sessions.get(session_id)
        if s is None:
            return False
        if s.in_flight is not None:
            engine.abort(s.in_flight)
        self.sessions.pop(session_id)
        if s.held is not None:
            held, s.held = s.held, None
            engine.slots.release(held, insert=True, to_session=False)
        engine.request_idle_check()
        return True

    def expire(self, engine) -> None:
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if s.timeout and s.in_flight is None and now - s.last_active > s.timeout:
                self.close(engine, s.session_id)

    def held(self) -> list[Req]:
        return [s.held for s in self.sessions.values() if s.held is not None]

    # ------------------------------------------------------------ turns
    def prepare(self, req: Req, params: dict) -> None:
        """Turn ``req.input_ids`` (the new input) into the full prompt of this session turn."""
        sid = params.get("id")
        s = self.sessions.get(sid)
        if s is None:
            raise KitError(f"session id {sid} does not exist")
        if s.in_flight is not None:
            raise KitError(f"session {sid} already has a request in flight ({s.in_flight})")
        # SGLang's Session.create_req: a streaming turn continues the last finished turn; a
        # non-streaming turn continues only the turn it names (no rid: a fresh prompt).
        parent = (params.get("rid") or s.last_rid) if s.streaming else params.get("rid")
        if parent is not None and parent not in s.turns:
            raise KitError(f"session {sid} has no request {parent!r}")
        prev = [] if parent is None else (s.turn_inputs[parent] if params.get("drop_previous_output") else s.turns[parent])
        offset = params.get("offset")
        if offset is not None and not 0 <= offset <= len(prev):
            raise KitError(f"session offset {offset} outside [0, {len(prev)}]")
        if s.streaming and (params.get("drop_previous_output") or params.get("replace")
                            or (offset is not None and offset != len(prev)) or (parent not in (None, s.last_rid))):
            raise KitError("streaming sessions only append to their last turn (no offset, replace or drop_previous_output)")
        prev = prev if offset is None else prev[:offset]
        req.input_ids = list(prev) + list(req.input_ids)
        req.session_id = sid
        s.in_flight = req.rid
        s.last_active = time.monotonic()

    def continues(self, req: Req) -> bool:
        s = self.sessions.get(req.session_id) if req.session_id else None
        return s is not None and s.held is not None

    def resume(self, engine, req: Req) -> bool:
        """Move the held turn's resources to ``req``; False when KV must wait."""
        s = self.sessions[req.session_id]
        held = s.held
        more_kv = len(req.input_ids) - held.state.seq_len + req.sampling.max_new_tokens
        if not engine.kv_pool.alloc(more_kv):
            engine.cache.evict_tokens(more_kv - engine.kv_pool.available())
            if not engine.kv_pool.alloc(more_kv):
                return False
        s.held = None
        for name in ("state", "last_row", "lock_node", "working_slot", "pingpong", "track", "next_track_idx",
                     "last_track_idx", "last_track_seqlen", "prev_track_seqlen", "holds_row"):
            setattr(req, name, getattr(held, name))
        req.kv_reserved = held.kv_reserved + more_kv
        req.prefix_len = req.kv_hit_len = held.state.seq_len
        if engine.faults.active("pingpong_leak_on_finish") and req.pingpong_slots():
            fresh = engine.mamba_pool.alloc(len(req.pingpong_slots())) or []
            req.pingpong = (fresh + [None, None])[:2]  # stale references: the old slots are lost
            req.track = {}
            req.last_track_idx = req.last_track_seqlen = None
        req.reported_cached_tokens = engine._reported_cached_tokens(req)
        engine.counters["cache_hit_tokens"] += req.prefix_len
        engine.counters["prompt_tokens"] += len(req.input_ids)
        return True

    def hold(self, engine, req: Req) -> bool:
        """At a turn's finish: record it; a streaming session keeps its resources."""
        s = self.sessions.get(req.session_id) if req.session_id else None
        if s is None:
            return False
        s.in_flight = None
        s.last_active = time.monotonic()
        s.turns[req.rid] = req.all_tokens()
        s.turn_inputs[req.rid] = list(req.input_ids)
        s.last_rid = req.rid
        if not s.streaming or req.finish_reason.get("type") == "abort":
            return False
        used = req.state.seq_len - (req.lock_node.depth if req.lock_node is not None else 0)
        engine.kv_pool.free(req.kv_reserved - used)
        req.kv_reserved = used
        s.held = req
        return True

    def forget_in_flight(self, req: Req, faults=None) -> None:
        s = self.sessions.get(req.session_id) if req.session_id else None
        if s is not None and s.in_flight == req.rid:
            s.in_flight = None
            aborted = (req.finish_reason or {}).get("type") == "abort"
            if faults is not None and faults.active("session_abort_continues") and s.streaming and aborted and req.output_ids:
                s.turns[req.rid] = req.all_tokens()  # the fault: the aborted turn becomes the rollback point
                s.turn_inputs[req.rid] = list(req.input_ids)
                s.last_rid = req.rid
