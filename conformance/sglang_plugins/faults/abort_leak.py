"""``abort_leak``: an aborted request does not give back its mamba slots.

Hooks SGLang's ``release_kv_cache`` (AROUND, in ``sglang.srt.mem_cache.common``; the hook
registry also rebinds every module that imported it): for a request finished with
``FINISH_ABORT`` the mamba allocator's ``free`` is switched off for the release, so its
working and ping-pong slots are dropped, not freed.  Requests that finish normally are
untouched.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.sglang_plugins.faults.spec import Hook, losing_release_frees, sglang_fault

NAME = "abort_leak"
TARGET = "sglang.srt.mem_cache.common.release_kv_cache"


def _aborted(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(req.finished_reason, FINISH_ABORT)


release_forgetting_aborts = losing_release_frees(NAME, _aborted)


FAULT = sglang_fault(
    NAME,
    "An aborted request (client abort while decoding, or an abort before it ran) does not "
    "return its mamba slots: its release runs with the mamba frees lost.",
    "abort paths that skip the mamba part of release_kv_cache",
    f"{MAMBA_USED_TOKENS} > 0 at idle after the aborted session turn; SGLang's strict idle check logs 'memory leak detected'",
    (Hook(TARGET, "around", release_forgetting_aborts),),
    suites=("leaks",),
)
