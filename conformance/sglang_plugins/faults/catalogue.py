"""The seeded faults of real SGLang, one module each (``FAULT_MODULES``), by name.

Selected per server by ``HYBRID_CONFORMANCE_SGLANG_FAULT=<name>`` (set by the kit's
launcher, loaded by the ``hybrid_conformance_faults`` general plugin); scored by
``hybrid-conformance mutants --target sglang-cpu`` and listed in ``docs/faults.md``.
Importing this module imports no SGLang code.
"""

from __future__ import annotations

import functools
import importlib

from conformance.errors import KitError
from conformance.matrix.faults import GROUPS, SGLANG_FAULT_ENV, SeededFault

_PKG = "conformance.sglang_plugins.faults."
#: In docs order: SGLang's known regressions first, then the bug classes.
FAULT_MODULES = (
    "session_pingpong_leak",          # PR 26941
    "pingpong_leak_on_finish",        # PR 26941 class
    "mamba2_track_index_global",      # PR 15829
    "lazy_alloc_fail_still_inserts",  # PR 27118
    "decode_track_mask_empty",        # PR 20522
    "lazy_slot_not_returned",
    "cow_skipped",
    "track_seqlen_minus_one",
    "force_track_h_dropped",
    "gdn_h_offset_floor",
    "evict_locked_node",
    "double_free",
    "abort_leak",
    "cached_tokens_overreport",
    "state_drift",
    "track_path_slowdown",            # performance: caught by compare on the perf ratios
    "step_slowdown",                  # performance, graded (+5/10/20% of a step): the paired A/B test
    # group "programs" (conformance.matrix.faults.GROUPS): written for the request programs
    "dup_insert_leak",
    "older_pingpong_inserted",
    "logprob_start_ignored",
    "lazy_finish_at_boundary_leak",
    "stop_finish_key_short",
    "cut_batch_checkpoint_dropped",   # the oracle's per-request cut evidence (issue 26)
    "stored_state_not_reused",        # the hit SGLang owed from its tree's per-node records (issue 43)
    "session_abort_continues",
    "child_under_wrong_key",          # the tree audit (issue 44): a child filed under the wrong first page
    "retract_leaks_mamba_slot",       # retraction (issue 44): SGLang's forced retraction, the idle invariant
    "refused_retry_drops_match",      # refused admission and retry (issue 44): the pool-sized refuse shape
    "first_decode_boundary_unseen",   # a lost decode-track state (overlap-first-decode-boundary-track-lost), typed by kl
    # group "option": one per server-option axis (conformance.matrix.axes), shows only with its option on
    "mixed_chunk_track_dropped",
    "chunk_cut_key_past_checkpoint",
    "overlap_track_slot_reused",
    "pressure_evict_slot_still_cached",
    "mamba_cap_reclaims_cached_slot",
    "kv_evict_frees_cached_mamba_slot",
    "sub_chunk_handoff_donates_untracked",
    "strip_thinking_state_past_key",
    "evict_priority_inverted",
    "path_cap_frees_tail_slot",
    # group "pd": PD disaggregation (prefill + decode on real SGLang, Mooncake over TCP), the disagg suite
    "pd_state_index_off",             # PR 15829
    "pd_last_layer_state_unsent",
    "pd_prefill_slot_kept",
    "pd_decode_failed_transfer_slot_kept",  # needs SGLang's transfer-failure switch (disagg_transfer_fail)
    # group "hicache": SGLang's host tier on CPU (the hicache cache variant), the hicache suite
    "hicache_mamba_state_not_loaded",  # PR 27256 class
    "hicache_mamba_backup_slot_off",
)



@functools.lru_cache(maxsize=1)
def faults() -> dict[str, SeededFault]:
    out: dict[str, SeededFault] = {}
    for module in FAULT_MODULES:
        fault = importlib.import_module(_PKG + module).FAULT
        if fault.name != module or fault.name in out:
            raise KitError(f"fault module {module}: FAULT is named {fault.name!r} (must be the module's name, once)")
        out[fault.name] = fault
    return out


def in_group(group: str) -> tuple[str, ...]:
    """The names of the real-SGLang faults of one group (``SeededFault.group``, one of
    ``conformance.matrix.faults.GROUPS``), in docs order."""
    if group not in GROUPS:
        raise KitError(f"fault group {group!r}: unknown (known: {', '.join(GROUPS)})")
    return tuple(name for name, fault in faults().items() if fault.group == group)


def get_fault(name: str) -> SeededFault:
    known = faults()
    if name not in known:
        raise KitError(f"{SGLANG_FAULT_ENV}={name!r}: unknown SGLang fault (known: {', '.join(known)})")
    return known[name]
