"""Seeded faults of the reference engine: the ONE place that reads HYBRID_CONFORMANCE_FAULT.

Each fault models a real SGLang bug (or a plausible mutant of one) and is injected at one
named hook in the engine (``engine.py``, ``slots.py``, ``radix.py``, ``sessions.py``); the hooks ask
``active(name)`` of the :class:`FaultSwitch` the engine was built with.  The records are
:class:`conformance.matrix.faults.SeededFault` (layer ``reference``), with those of ``program_faults.py``.  The kit's checks
must catch every fault over HTTP; ``docs/faults.md`` is generated from :data:`FAULTS`.
"""

from __future__ import annotations

import os

from conformance.errors import KitError
from conformance.matrix.faults import FAULT_ENV, LAZY_ALLOC_FAIL_ENV, SeededFault, registry
from conformance.reference.program_faults import PROGRAM_FAULTS
from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS

FAULTS: dict[str, SeededFault] = registry(
    SeededFault(
        "pingpong_leak_on_finish",
        "reference",
        "When a request finishes (or a streaming session hands its state on and later closes), "
        "its ping-pong track slots are not returned to the mamba pool: the stale buffer "
        "reference makes the free step skip them.",
        "SGLang PR 26941 (extra_buffer + overlap + streaming sessions leaked 3 slots per session)",
        "slots.SlotKeeper._free_finished_slots and sessions.SessionStore.resume",
        f"mamba slots leak: {MAMBA_USED_TOKENS} > 0 at idle after /flush_cache; idle check fires",
    ),
    SeededFault(
        "lazy_slot_not_returned",
        "reference",
        "extra_buffer_lazy: after a decode track boundary the old keep slot is not freed when "
        "the temporary second slot becomes the keep slot.",
        "the mamba_lazy_post_decode_at_boundary path of SGLang PR 27118",
        "slots.SlotKeeper.after_boundary",
        "one mamba slot leaked per decode boundary crossed",
        strategies=("extra_buffer_lazy",),
    ),
    SeededFault(
        "lazy_fail_still_inserts",
        "reference",
        "extra_buffer_lazy: when the boundary allocation of the second ping-pong slot fails, "
        "0.5.23 tracks the boundary in place in the keep slot; with this fault that write is lost: "
        "the tracked length advances but the keep slot still holds the previous recurrent state, "
        "and that state is inserted at finish.  Fires only when the allocation fails "
        "(SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1 or a full mamba pool).",
        "SGLang PR 27118 alloc-fail path (tracking must degrade in place or skip the insert)",
        "slots.SlotKeeper.after_boundary (alloc-failed branch)",
        "stale state under a valid prefix: a later hit diverges from a cold run (KL)",
        strategies=("extra_buffer_lazy",), cell_fault="lazy_alloc_fail",
    ),
    SeededFault(
        "track_boundary_early",
        "reference",
        "The tracked snapshot is taken one token before the position it is keyed at.",
        "off-by-one in the track seqlen (the `_force_track_h` +1 logic of SGLang's "
        "_mamba_radix_cache_v2_req_prepare_for_extend)",
        "engine.Engine._snapshot_at (prefill) and engine.Engine._decode (decode tracks)",
        "hits continue from a state one token short: logprobs differ from cold",
    ),
    SeededFault(
        "track_boundary_late",
        "reference",
        "The tracked snapshot is taken one token after the position it is keyed at.",
        "off-by-one in the track seqlen (see track_boundary_early)",
        "engine.Engine._snapshot_at (prefill checkpoints)",
        "hits continue from a state one token too far: logprobs differ from cold",
    ),
    SeededFault(
        "mamba2_index_misalignment",
        "reference",
        "In a prefill batch of several requests, every request but the first stores the "
        "snapshot of the previous request in the batch (source index computed globally, not "
        "per sequence).",
        "SGLang issue 31833 / PR 37836 / PR 15829 (Mamba2 track index misalignment)",
        "engine.Engine._prefill_batch",
        "hits on prefixes first cached by a non-first request of a batch diverge (KL)",
        families=("nemotron-h",),
    ),
    SeededFault(
        "cow_skipped_zero_state",
        "reference",
        "On a cache hit the matched snapshot is not copied into the request's slot: the "
        "request continues from a zeroed recurrent state.",
        "SGLang PR 26877 (copy-on-write of the matched mamba state skipped)",
        "engine.Engine._cow_from_cache",
        "every hit diverges from a cold run",
    ),
    SeededFault(
        "evict_running_slot",
        "reference",
        "Eviction frees the mamba slot of a cache node still locked by a running request "
        "(lock refs ignored) while the node keeps referencing it, so the slot is counted twice "
        "and freed again when the node goes.",
        "lock_ref handling of the mamba eviction path",
        "radix.RadixCache.evict_mamba",
        "pool accounting breaks: available exceeds its share; idle check fires",
    ),
    SeededFault(
        "double_free",
        "reference",
        "A finished request's working mamba slot is freed twice.",
        "double release in release_kv_cache / free_mamba_cache",
        "slots.SlotKeeper._free_finished_slots",
        "the pool's free list holds a slot twice; the idle check reports available > total",
    ),
    SeededFault(
        "abort_path_leak",
        "reference",
        "An aborted or rejected-after-admission request does not free its slots.",
        "abort paths that skip release_kv_cache",
        "engine.Engine._abort_release",
        "slots leak after requests that are aborted (e.g. too long for the remaining pool)",
    ),
    SeededFault(
        "sched_fail_leak",
        "reference",
        "When scheduling a matched request fails for lack of room, the copy-on-write slot "
        "already allocated for it is not freed.",
        "the mamba COW allocation in match_prefix before admission can fail",
        "slots.SlotKeeper.alloc_for",
        "mamba slots leak under pool pressure",
    ),
    SeededFault(
        "idle_check_disabled_with_leak",
        "reference",
        "Every finished request leaks its working slot AND the server's own idle leak check "
        "is switched off, so only an external check (/metrics) can see it.",
        "a leak in a build where SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE is off",
        "slots.SlotKeeper._free_finished_slots and engine.Engine.idle_check",
        f"{MAMBA_USED_TOKENS} > 0 at idle after flush while /health stays 200",
    ),
    SeededFault(
        "cached_tokens_overreport",
        "reference",
        "meta_info.cached_tokens reports the KV prefix match instead of the mamba-floored hit.",
        "reporting the full-KV hit of a hybrid cache",
        "engine.Engine._reported_cached_tokens",
        "cached_tokens disagrees with the prefix oracle (too high)",
    ),
    SeededFault(
        "cached_tokens_underreport",
        "reference",
        "meta_info.cached_tokens reports 0 for every hit.",
        "a lost prefix_len in the response path",
        "engine.Engine._reported_cached_tokens",
        "cached_tokens disagrees with the prefix oracle (too low)",
    ),
    SeededFault(
        "state_scaled_1pct",
        "reference",
        "On a cache hit the first recurrent layer of the copied state is scaled by 0.99.",
        "a subtle precision bug in a state copy (e.g. a dtype round trip)",
        "engine.Engine._cow_from_cache",
        "small logprob drift on hits only: caught by KL, not by greedy token equality",
    ),
    *PROGRAM_FAULTS.values(),
)


class FaultSwitch:
    """Which seeded fault is on, and whether SGLang's lazy alloc-fail test switch is on."""

    def __init__(self, name: str | None = None, lazy_alloc_fail: bool = False) -> None:
        if name and name not in FAULTS:
            raise KitError(f"unknown fault {name!r} in {FAULT_ENV}; known: {', '.join(FAULTS)}")
        self.name = name or None
        self.lazy_alloc_fail = lazy_alloc_fail

    @classmethod
    def from_env(cls, environ=None) -> "FaultSwitch":
        env = os.environ if environ is None else environ
        flag = env.get(LAZY_ALLOC_FAIL_ENV, "").strip().lower() in ("1", "true", "yes")
        return cls(env.get(FAULT_ENV, "").strip() or None, flag)

    def active(self, name: str) -> bool:
        assert name in FAULTS, name
        return self.name == name

    def __repr__(self) -> str:
        return f"FaultSwitch({self.name!r}, lazy_alloc_fail={self.lazy_alloc_fail})"
