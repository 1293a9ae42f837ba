"""``logprob_start_ignored``: the prefix match ignores a requested ``logprob_start_len``.

Hooks SGLang's ``Req._compute_max_prefix_len`` (AROUND): for a request that asks for input
logprobs from ``logprob_start_len``, the match limit is the input length - 1 instead of
that start, so a cache hit can cover positions whose logprobs were asked for; SGLang then
computes them only from the hit on (``compute_extend_logprob_start_len``).
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "logprob_start_ignored"
TARGET = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"


def limit_ignoring_logprob_start(original, req, input_len, *args, **kwargs):
    limit = original(req, input_len, *args, **kwargs)
    if req.return_logprob and req.logprob_start_len is not None and req.logprob_start_len >= 0:
        wider = max(input_len - 1, 0)
        if wider > limit:
            fired(NAME, start=req.logprob_start_len, limit=wider)
            return wider
    return limit


FAULT = sglang_fault(
    NAME,
    "The prefix match ignores a requested logprob_start_len: a hit can cover positions whose "
    "input logprobs were asked for, and those are then missing or misplaced in the answer.",
    "the match limit of Req._compute_max_prefix_len (logprob_start_len must cap it)",
    "input_token_logprobs start at the hit instead of logprob_start_len: they differ from a cold prefill",
    (Hook(TARGET, "around", limit_ignoring_logprob_start),),
    suites=("kl", "prefix_branching"),
    group="programs",
)
