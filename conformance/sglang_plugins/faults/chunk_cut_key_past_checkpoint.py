"""``chunk_cut_key_past_checkpoint``: a prefill that chunked prefill cut off the checkpoint
grid is published under the cut's key while the state it donates is the chunk's last
checkpoint (on the grid, before the cut).

Between chunks SGLang 0.5.23 publishes the request's prefix so far
(``Scheduler.stash_chunked_request`` -> ``checkpoint_kv_cache`` -> ``UnifiedRadixCache.checkpoint``
up to ``extend_end``); ``MambaComponent.prepare_for_caching_req`` returns the tracked
length (``mamba_last_track_seqlen``: the chunk's last grid point) and the insert is cut
to it.  This fault hooks that method (AROUND) and, only for such a cut (the published
length is short of the prompt: the prefill is unfinished), returns the cut's length
instead: the state of the grid point is stored under a key up to the cut.  It fires only
where a prefill is cut off the grid: ``--chunked-prefill-size`` smaller than a prompt and
not a multiple of the grid (the ``off-grid`` cell); with SGLang's default size the kit's
prompts are never cut.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "chunk_cut_key_past_checkpoint"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.prepare_for_caching_req"


def key_at_the_cut(original, component, req, *args, **kwargs):
    cache_len = original(component, req, *args, **kwargs)
    if plan_arg(args, kwargs, 2, "is_finished") or not component.cache.enable_mamba_extra_buffer or not cache_len:
        return cache_len
    published = plan_arg(args, kwargs, 1, "token_ids_len")
    if cache_len < published < len(req.full_untruncated_fill_ids):  # a cut prefill, its checkpoint short of the cut
        fired(NAME, cache_len=cache_len, cut=published)
        return published
    return cache_len


FAULT = sglang_fault(
    NAME,
    "A prefill cut by chunked prefill off the checkpoint grid is published under the cut's key while "
    "the state it donates is the chunk's last grid checkpoint: a later hit up to the cut continues "
    "from a state that misses the tokens between the grid point and the cut.",
    "the key/state pairing of a chunked-prefill hand-off (UnifiedRadixCache.checkpoint cuts the insert "
    "to mamba_last_track_seqlen; SGLang warns that small chunks can skip checkpoints)",
    "a hit on a prefix of a cut prompt reports the cut length and continues from the grid state "
    "(prefix_branching: cached_tokens above the oracle, outputs vs cold; KL); with SGLang's default "
    "chunked prefill size the kit's prompts are never cut and the hook never fires",
    (Hook(TARGET, "around", key_at_the_cut),),
    options=("chunked_prefill=off-grid",),
    suites=("prefix_branching", "kl"),
    group="option",
)
