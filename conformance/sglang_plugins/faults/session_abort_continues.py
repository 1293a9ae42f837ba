"""``session_abort_continues``: a streaming session continues an aborted turn.

Hooks SGLang's ``StreamingSession.try_cache_finished_req`` and
``Scheduler._release_aborted_request`` (AROUND): after SGLang released an aborted streaming
turn, the turn is confirmed as the session's rollback point (``Session.finish_req``), as
if it had finished; the next turn then continues its partial tokens instead of the last
finished turn (``_share_token_arrays`` trims back to the committed lengths).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "session_abort_continues"
CACHE_TARGET = "sglang.srt.session.streaming_session.StreamingSession.try_cache_finished_req"
RELEASE_TARGET = "sglang.srt.managers.scheduler.Scheduler._release_aborted_request"


def _confirm_aborted(session, req) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if session is not None and session.streaming and isinstance(req.finished_reason, FINISH_ABORT) and req.output_ids:
        session.finish_req(req)
        fired(NAME, rid=str(req.rid))


def cache_then_confirm(original, store, req, *args, **kwargs):
    session = req.session
    out = original(store, req, *args, **kwargs)
    _confirm_aborted(session, req)
    return out


def release_then_confirm(original, scheduler, req, *args, **kwargs):
    session = req.session
    out = original(scheduler, req, *args, **kwargs)
    _confirm_aborted(session, req)
    return out


FAULT = sglang_fault(
    NAME,
    "Streaming session: after a turn is aborted, the next turn continues the aborted turn's "
    "partial tokens instead of the last finished turn.",
    "the streaming-session rollback point (Session.finish_req / abort_req; _share_token_arrays heals aborted turns)",
    "the next turn's prompt_tokens and outputs differ from what SGLang builds after an abort",
    (Hook(CACHE_TARGET, "around", cache_then_confirm), Hook(RELEASE_TARGET, "around", release_then_confirm)),
    suites=("leaks",),  # the leak session scripts abort a streaming turn and continue
    group="programs",
)
