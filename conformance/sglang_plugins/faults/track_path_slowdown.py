"""``track_path_slowdown``: the mamba track path gets slower -- a sleep where SGLang plans
which state to track, in prefill (per request) and in decode (per step) -- while every
output, hit and slot stays exactly as it was.

Models a performance regression of the track path such as the device-to-host copy SGLang
PR 20522 removed (its author measured TTFT +6% by hand).  Only the ``extra_buffer`` and
``extra_buffer_lazy`` strategies run the track path, so the model's ``no_buffer`` cell in
the same run is untouched: the ``perf`` ratios against it (``ttft_vs_no_buffer``,
``decode_vs_no_buffer``) and the hit-vs-cold ratio move, which ``compare`` flags against a
clean run.  No correctness check can see it.

Hooks (BEFORE, arguments unchanged): ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``
(one call per request of a prefill batch) and the module function
``set_mamba_track_indices_from_reqs`` (one call per decode step of the batch).
"""

from __future__ import annotations

import time

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "track_path_slowdown"
PREFILL_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend"
DECODE_TARGET = "sglang.srt.managers.schedule_batch.set_mamba_track_indices_from_reqs"
#: Seconds slept per prefill track entry (one request of an extend batch) and per decode step.
PREFILL_SLEEP_S = 0.25
DECODE_SLEEP_S = 0.02


def slow_prefill_track(*args, **kwargs):
    time.sleep(PREFILL_SLEEP_S)
    fired(NAME, where="prefill", sleep_s=PREFILL_SLEEP_S)


def slow_decode_track(*args, **kwargs):
    time.sleep(DECODE_SLEEP_S)
    fired(NAME, where="decode", sleep_s=DECODE_SLEEP_S)


FAULT = sglang_fault(
    NAME,
    f"The mamba track path is slower: {PREFILL_SLEEP_S:g} s more per request of a prefill batch "
    f"while SGLang plans its track entry, {DECODE_SLEEP_S:g} s more per decode step while it "
    "gathers the track indices; outputs, hits and slots are unchanged.",
    "a performance regression in the track path (class of SGLang PR 20522, whose device-to-host "
    "copy of mamba_track_mask cost TTFT +6%)",
    "perf ratios of extra_buffer cells against the model's no_buffer cell and hit vs cold TTFT "
    "get worse; compare flags them against a clean run",
    (Hook(PREFILL_TARGET, "before", slow_prefill_track), Hook(DECODE_TARGET, "before", slow_decode_track)),
    suites=("perf",),
)
