"""``older_pingpong_inserted``: extra_buffer inserts, at finish, the older of its two
ping-pong checkpoints under the newer one's length.

Hooks SGLang's ``MambaComponent._select_finished_checkpoint`` (AROUND): when both
ping-pong slots hold a tracked state (the request crossed two decode track boundaries:
``mamba_prev_track_seqlen`` is set) and SGLang picks the latest, the other slot's index is
returned with the latest length.  Accounting stays consistent; the cached state is one
track interval stale.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, sglang_fault

NAME = "older_pingpong_inserted"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent._select_finished_checkpoint"


def select_older(original, component, req, token_ids_len, *args, **kwargs):
    picked = original(component, req, token_ids_len, *args, **kwargs)
    pool = component.cache.req_to_token_pool
    if picked is None or pool.mamba_ping_pong_track_buffer_size != 2 or req.kv.mamba_prev_track_seqlen is None:
        return picked
    cache_len, keep_idx = picked
    if keep_idx != pool.get_mamba_ping_pong_keep_idx(req):
        return picked  # SGLang already fell back to the older slot (overshoot)
    fired(NAME, cache_len=cache_len, prev=req.kv.mamba_prev_track_seqlen)
    return cache_len, pool.get_mamba_ping_pong_other_idx(keep_idx)


FAULT = sglang_fault(
    NAME,
    "extra_buffer: at finish, the older of the two ping-pong checkpoints is inserted under the "
    "newer one's length (after a decode that crossed two track boundaries).",
    "the ping-pong index choice at finish (_select_finished_checkpoint / prepare_for_caching_req)",
    "a follow-up hitting the last decode track continues from a state one track interval old: outputs differ from cold",
    (Hook(TARGET, "around", select_older),),
    suites=("kl", "prefix_branching"),
    group="programs",
)
