"""``session_pingpong_leak``: closing a streaming session leaves its mamba state allocated
(SGLang PR 26941: extra_buffer + overlap + streaming sessions leaked 3 slots per session).

Hooks SGLang's ``StreamingSession._free_slot_mamba`` (REPLACE): the session slot's stale
ping-pong reference is taken as "already released", so the working slot and the
ping-pong track slots are dropped without being freed.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "session_pingpong_leak"
TARGET = "sglang.srt.session.streaming_session.StreamingSession._free_slot_mamba"


def free_slot_mamba(session, slot):
    kv = slot.kv
    held = int(kv.mamba_pool_idx is not None)
    if kv.mamba_ping_pong_track_buffer is not None:
        held += sum(1 for e in kv.mamba_ping_pong_empty if not e)
    if held:
        fired(NAME, slots=held)
    kv.mamba_pool_idx = None
    kv.mamba_ping_pong_track_buffer = None
    kv.mamba_ping_pong_empty = None


FAULT = sglang_fault(
    NAME,
    "When a streaming session closes, its slot's stale ping-pong reference makes the release "
    "skip the session's mamba state: the working slot and its ping-pong track slots stay "
    "allocated (3 slots per session under extra_buffer).",
    "SGLang PR 26941 (extra_buffer + overlap + streaming sessions: stale "
    "mamba_ping_pong_track_buffer references leaked 3 slots per session; the idle check then killed the server)",
    f"{MAMBA_USED_TOKENS} > 0 at idle after the sessions scenario; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "replace", free_slot_mamba),),
    suites=("leaks",),
)
