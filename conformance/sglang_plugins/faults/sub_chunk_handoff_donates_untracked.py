"""``sub_chunk_handoff_donates_untracked``: a prefill cut into chunks smaller than the mamba
chunk donates its track slot at every hand-off although no chunk tracked a state.

With ``--chunked-prefill-size`` below the checkpoint grid SGLang 0.5.23 never tracks a
state in a cut prefill (``mask = req.extend_len >= checkpoint_grid`` is false for every
chunk), ``mamba_last_track_seqlen`` stays None and ``MambaComponent.prepare_for_caching_req``
stores nothing at the hand-offs -- SGLang warns that such chunks "skip Mamba state
checkpoints".  This fault hooks that method (AROUND) and, only at such a hand-off (an
unfinished prefill published short of its prompt with no tracked length), claims the
published length as tracked: the request's track slot, which no forward wrote, is stored
under the cut's key.  It needs chunks that cut prompts and never track: the ``sub-chunk``
cell (size 32, grid 64); with chunks of a grid or more every cut tracks, with SGLang's
default size the kit's prompts are never cut.
"""

from __future__ import annotations

from conformance.sglang_plugins.faults.spec import Hook, fired, plan_arg, sglang_fault

NAME = "sub_chunk_handoff_donates_untracked"
TARGET = "sglang.srt.mem_cache.unified_cache.components.mamba.MambaComponent.prepare_for_caching_req"


def claim_the_cut_tracked(original, component, req, *args, **kwargs):
    published = plan_arg(args, kwargs, 1, "token_ids_len")
    untracked_cut = (
        not plan_arg(args, kwargs, 2, "is_finished") and component.cache.enable_mamba_extra_buffer
        and req.kv.mamba_last_track_seqlen is None and 0 < published < len(req.full_untruncated_fill_ids)
    )
    if untracked_cut:
        req.kv.mamba_last_track_seqlen = published
        fired(NAME, cut=published)
    return original(component, req, *args, **kwargs)


FAULT = sglang_fault(
    NAME,
    "A prefill cut into chunks smaller than the mamba chunk (which never track a state) donates its "
    "track slot at every hand-off as if the cut had been tracked: a state nothing wrote is stored "
    "under the cut's key.",
    "the chunked-prefill hand-off of a request that tracked nothing (SGLang warns that chunks below "
    "mamba_cache_chunk_size skip Mamba state checkpoints; the hand-off must then store none)",
    "hits land on the cuts of a prompt prefilled in sub-chunk pieces (cached_tokens above the oracle's 0) "
    "and continue from an unwritten state (outputs vs cold); with chunks of a grid or more every cut "
    "tracks and the hook never fires",
    (Hook(TARGET, "around", claim_the_cut_tracked),),
    options=("chunked_prefill=sub-chunk",),
    suites=("prefix_branching", "kl"),
    group="option",
)
