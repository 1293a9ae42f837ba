"""Seeded faults of the reference engine in classes the first catalogue did not cover,
written for the request-program generator (``conformance/programs``) before it was tuned.

Each needs an interleaving or an option the scripted workloads rarely produce: two
requests inserting the same key, a radix edge split under a later hit, a hit past a
requested ``logprob_start_len``, one decode crossing two track boundaries, a request that
finishes on the very step it crosses a boundary, a finish by a stop condition followed by
a follow-up, or a streaming session continued after an aborted turn.  Registered into
``faults.FAULTS``; switched on like the others with ``HYBRID_CONFORMANCE_FAULT``.
"""

from __future__ import annotations

from conformance.matrix.faults import SeededFault, registry
from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS

PROGRAM_FAULTS: dict[str, SeededFault] = registry(
    SeededFault(
        "dup_insert_leak",
        "reference",
        "When a prefill checkpoint is inserted under a key the tree already holds (two "
        "requests with the same prefix checkpointed the same position), the duplicate "
        "snapshot's slot is not given back.",
        "the 'value already exists' branch of a radix insert (SGLang's _insert_helper frees "
        "the duplicate mamba value; a missed free leaks one slot per duplicate)",
        "slots.SlotKeeper.checkpoint_after_prefill",
        f"one mamba slot leaked per duplicate insert: {MAMBA_USED_TOKENS} > 0 at idle",
        group="programs",
    ),
    SeededFault(
        "split_moves_snapshot",
        "reference",
        "When an insert splits a radix edge, the new upper node takes the lower node's "
        "snapshot: the state of the longer prefix is keyed at the split point.",
        "value bookkeeping in a radix node split (SGLang's _split_node must leave the mamba "
        "value on the child)",
        "radix.RadixCache._split",
        "a hit at a split point reports a length no request stored and continues from a "
        "longer prefix's state: outputs differ from cold",
        group="programs",
    ),
    SeededFault(
        "logprob_start_ignored",
        "reference",
        "The prefix match ignores a requested logprob_start_len, so a hit can cover "
        "positions whose input logprobs were asked for; those are filled from the cached "
        "state's last row.",
        "the match limit of Req._compute_max_prefix_len (logprob_start_len must cap it)",
        "engine.Engine._try_admit",
        "input_token_logprobs inside the hit differ from a cold prefill",
        group="programs",
    ),
    SeededFault(
        "older_pingpong_inserted",
        "reference",
        "extra_buffer: at finish the older of the two ping-pong snapshots is inserted under "
        "the newer one's length (the request crossed two decode track boundaries).",
        "the ping-pong index choice at finish (SGLang's _select_finished_checkpoint / "
        "prepare_for_caching_req after two tracked boundaries)",
        "slots.SlotKeeper._finished_checkpoint",
        "a follow-up hitting the last decode track continues from the state one track "
        "interval earlier: outputs differ from cold",
        group="programs",
    ),
    SeededFault(
        "lazy_finish_at_boundary_leak",
        "reference",
        "extra_buffer_lazy: a request that finishes on the very decode step that crosses a "
        "track boundary does not give back its old keep slot.",
        "ordering of mamba_lazy_post_decode_at_boundary and the finish path (PR 27118 class)",
        "slots.SlotKeeper.after_boundary",
        f"one mamba slot leaked per such request: {MAMBA_USED_TOKENS} > 0 at idle",
        strategies=("extra_buffer_lazy",),
        group="programs",
    ),
    SeededFault(
        "stop_finish_key_short",
        "reference",
        "no_buffer: a request finished by a stop condition (a stop token, a stop string, "
        "EOS) is inserted under a key one token shorter than its state: the matched stop "
        "token is dropped from the key but the state has consumed the token before it.",
        "the committed length at a stop finish (kv_committed_len trimmed for the matched stop)",
        "slots.SlotKeeper._finished_checkpoint",
        "a follow-up of the stopped request's prompt + output hits one token short of the "
        "state: cached_tokens the oracle does not allow, outputs differ from cold",
        strategies=("no_buffer",),
        group="programs",
    ),
    SeededFault(
        "session_abort_continues",
        "reference",
        "Streaming session: after a turn is aborted, the next turn continues the aborted "
        "turn's partial tokens instead of the last finished turn.",
        "the streaming-session rollback point (SGLang's Session.finish_req / abort_req keep "
        "the last finished turn; _share_token_arrays trims an aborted turn's tokens)",
        "sessions.SessionStore.forget_in_flight",
        "the next turn's prompt_tokens and outputs differ from what SGLang builds",
        group="programs",
    ),
)
