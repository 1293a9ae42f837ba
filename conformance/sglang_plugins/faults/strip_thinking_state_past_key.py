"""``strip_thinking_state_past_key``: with ``--strip-thinking-cache``, a finished request that
reasoned donates its newest Mamba state under its prompt-only key.

SGLang 0.5.23 (#22373): ``Req.owned_kv_len`` reports only the prompt of a request whose
output was thinking (``reasoning_tokens > 0`` with ``--strip-thinking-cache``), so the finish
inserts ``up_to = len(prompt)``.  An extra_buffer request whose decode tracked a state past
its prompt (a track boundary crossed while thinking) then "overshoots" the key;
``MambaComponent._select_finished_checkpoint`` falls back to the other ping-pong slot's
older state (``mamba_prev_track_seqlen``, at or below the key) or donates nothing.  This
fault drops that guard (AROUND): on an overshoot it donates the newest slot under the key
anyway, capped to the key's length -- a state that has read the thinking tokens, named by a
prompt that never contained them.  A later request sharing the prompt continues from it.
Only a key cut below what the request ran reaches the guard: strip-thinking (a non-spec
server's finish otherwise keys every committed token).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "strip_thinking_state_past_key"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._select_finished_checkpoint"


def donate_newest_past_key(original, component, req, *args, **kwargs):
    result = original(component, req, *args, **kwargs)
    key_len = int(plan_arg(args, kwargs, 0, "token_ids_len"))
    newest = req.kv.mamba_last_track_seqlen or 0
    if newest > key_len > 0:
        keep_idx = component.cache.req_to_token_pool.get_mamba_ping_pong_keep_idx(req)
        fired(NAME, key=key_len, state=newest, guarded=None if result is None else int(result[0]))
        return key_len, keep_idx
    return result


FAULT = sglang_fault(
    NAME,
    "--strip-thinking-cache: a finished request that reasoned donates its newest Mamba state (tracked "
    "past its prompt, while thinking) under its prompt-only key instead of an older state at or below it.",
    "the finish checkpoint of a strip-thinking request (#22373: only the prompt is cached) skipping "
    "_select_finished_checkpoint's overshoot guard",
    "a follow-up sharing the reasoning request's prompt hits the whole prompt and continues from a state that "
    "read the thinking tokens: outputs differ from cold (KL decode_hit on the strip-thinking cell, whose turn one "
    "asks for reasoning); the tree audit's insert-time rule state_position names the finish's donation itself (state "
    "tracked at 256, keyed at the 249-token prompt)",
    (Hook(TARGET, "around", donate_newest_past_key),),
    options=("reasoning=strip-thinking",),
    suites=("kl",),
    group="option",
)
