"""``stop_finish_key_short``: no_buffer inserts a request finished by a stop condition under
a key one token shorter than the state it donates.

Hooks SGLang's ``MambaComponent.prepare_for_caching_req`` (AROUND): at the finish of a
request whose finish reason is a matched stop token (EOS included) or stop string, the
cache length returned is one less; the donated state (the request's own slot) still
covers every committed token.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "stop_finish_key_short"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.prepare_for_caching_req"


def prepare_short_on_stop(original, component, req, *args, **kwargs):
    cache_len = original(component, req, *args, **kwargs)
    if not plan_arg(args, kwargs, 2, "is_finished") or component.cache.enable_mamba_extra_buffer or not cache_len:
        return cache_len
    from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN

    if isinstance(req.finished_reason, (FINISH_MATCHED_TOKEN, FINISH_MATCHED_STR)):
        fired(NAME, cache_len=cache_len)
        return cache_len - 1
    return cache_len


FAULT = sglang_fault(
    NAME,
    "no_buffer: a request finished by a stop condition (a stop token, EOS, a stop string) is "
    "inserted under a key one token shorter than the state it donates.",
    "the committed length at a stop finish (kv_committed_len trimmed for the matched stop)",
    "a follow-up of the stopped request's prompt + output hits one token short of the state: outputs differ from cold",
    (Hook(TARGET, "around", prepare_short_on_stop),),
    strategies=("no_buffer",),
    suites=("kl", "prefix_branching"),
    group="programs",
)
