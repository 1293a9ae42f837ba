"""The metric names on SGLang's ``/metrics``: SGLang's own, the ones only the kit's
reference engine publishes in SGLang's namespace, and the kit's ``hybrid_conformance:``
names (its observe plugin inside real SGLang, and the reference engine).

This is the only module that spells them (``tests/test_metric_names.py``).  "0.5.12+":
present in every SGLang release the kit checked, 0.5.12 to 0.5.23
(``sglang.srt.observability.metrics_collector``).
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------- SGLang's own names
NUM_RUNNING_REQS = "sglang:num_running_reqs"  # gauge: requests in the running batch; 0.5.12+
NUM_QUEUE_REQS = "sglang:num_queue_reqs"  # gauge: requests in the waiting queue; 0.5.12+
MAMBA_USAGE = "sglang:mamba_usage"  # gauge: fraction of mamba state slots in use; the only mamba pool term 0.5.11 exports
MAMBA_USED_TOKENS = "sglang:mamba_used_tokens"  # gauge: mamba state slots in use (PoolStats.mamba_num_used); 0.5.12+
MAMBA_AVAILABLE_TOKENS = "sglang:mamba_available_tokens"  # gauge: free mamba state slots; 0.5.12+
MAMBA_EVICTABLE_TOKENS = "sglang:mamba_evictable_tokens"  # gauge: mamba slots held by unlocked radix entries; 0.5.12+
KV_USED_TOKENS = "sglang:kv_used_tokens"  # gauge: KV token slots in use; 0.5.12+
KV_AVAILABLE_TOKENS = "sglang:kv_available_tokens"  # gauge: free KV token slots; 0.5.12+
KV_EVICTABLE_TOKENS = "sglang:kv_evictable_tokens"  # gauge: KV token slots held by unlocked radix entries; 0.5.12+
MAX_TOTAL_NUM_TOKENS = "sglang:max_total_num_tokens"  # gauge: size of the KV token pool; 0.5.12+
CACHED_TOKENS_TOTAL = "sglang:cached_tokens_total"  # counter: prompt tokens served from the radix cache (by cache_source in 0.5.23); 0.5.12+
PROMPT_TOKENS_TOTAL = "sglang:prompt_tokens_total"  # counter: prefill tokens processed; 0.5.12+
GENERATION_TOKENS_TOTAL = "sglang:generation_tokens_total"  # counter: tokens generated; 0.5.12+
NUM_REQUESTS_TOTAL = "sglang:num_requests_total"  # counter: requests processed; 0.5.12+

# ------------------------------- in SGLang's namespace, published only by the reference engine
# (no SGLang release the kit checked, 0.5.12-0.5.23, publishes these)
MAMBA_PROTECTED_TOKENS = "sglang:mamba_protected_tokens"  # gauge: mamba slots held by locked radix entries
MAMBA_TOTAL_TOKENS = "sglang:mamba_total_tokens"  # gauge: size of the mamba slot pool
MAMBA_PINGPONG_RESIDENT_SLOTS = "sglang:mamba_pingpong_resident_slots"  # gauge: ping-pong track slots held now
MAMBA_PINGPONG_PEAK_SLOTS = "sglang:mamba_pingpong_peak_slots"  # gauge: most ping-pong track slots held at once
NUM_SESSIONS = "sglang:num_sessions"  # gauge: open streaming sessions
PD_PENDING_TRANSFERS = "sglang:pd_pending_transfers"  # gauge: PD states awaiting shipment (prefill) or unclaimed (decode)
REFERENCE_ONLY = (MAMBA_PROTECTED_TOKENS, MAMBA_TOTAL_TOKENS, MAMBA_PINGPONG_RESIDENT_SLOTS, MAMBA_PINGPONG_PEAK_SLOTS,
                  NUM_SESSIONS, PD_PENDING_TRANSFERS)

# ---------------------------------------------------------------- the kit's names
# The observe plugin (conformance/sglang_plugins/observe.py) publishes KIT_PREFIX + its term
# names inside real SGLang; the reference engine publishes the idle-invariant terms and the
# evidence counters under the same names.
KIT_PREFIX = "hybrid_conformance:"
# SGLang's idle-invariant terms it checks at idle but does not export
KIT_MAMBA_TOTAL = KIT_PREFIX + "mamba_total"  # mamba pool size
KIT_MAMBA_PROTECTED = KIT_PREFIX + "mamba_protected"  # mamba slots of locked radix entries
KIT_MAMBA_SESSION_HELD = KIT_PREFIX + "mamba_session_held"  # mamba slots held by streaming sessions
KIT_KV_TOTAL = KIT_PREFIX + "kv_total"  # KV pool size (its schedulable capacity where the release has one)
KIT_KV_PROTECTED = KIT_PREFIX + "kv_protected"  # KV tokens of locked radix entries
KIT_KV_SESSION_HELD = KIT_PREFIX + "kv_session_held"  # KV tokens held by streaming sessions
# SGLang's PoolStats mamba terms, stand-ins where SGLang exports only MAMBA_USAGE (0.5.11)
KIT_MAMBA_USED = KIT_PREFIX + "mamba_used"
KIT_MAMBA_AVAILABLE = KIT_PREFIX + "mamba_available"
KIT_MAMBA_EVICTABLE = KIT_PREFIX + "mamba_evictable"
# the scheduler's own queues, read at the idle publish
KIT_RUNNING_REQS = KIT_PREFIX + "running_reqs"
KIT_WAITING_REQS = KIT_PREFIX + "waiting_reqs"
# HiCache host tier (servers with --enable-hierarchical-cache)
KIT_HOST_KV_USED = KIT_PREFIX + "host_kv_used"
KIT_HOST_MAMBA_USED = KIT_PREFIX + "host_mamba_used"
# incremented after each idle publish: a newer value means gauges refreshed while idle
KIT_IDLE_PUBLISH_SEQ = KIT_PREFIX + "idle_publish_seq"
# busy-window peaks of the pools' used terms, read before every batch (SGLang samples its own
# gauges only at its log intervals: a short load can miss them)
KIT_MAMBA_USED_PEAK = KIT_PREFIX + "mamba_used_peak"
KIT_KV_USED_PEAK = KIT_PREFIX + "kv_used_peak"
# ping-pong track slots over decode steps (cumulative sums and window peaks)
KIT_DECODE_REQ_STEPS = KIT_PREFIX + "decode_req_steps"
KIT_TRACK_SLOT_REQ_STEPS = KIT_PREFIX + "track_slot_req_steps"
KIT_TRACK_SLOTS_REQ_PEAK = KIT_PREFIX + "track_slots_req_peak"
KIT_TRACK_SLOTS_STEP_PEAK = KIT_PREFIX + "track_slots_step_peak"
KIT_DECODE_RUNNING_PEAK = KIT_PREFIX + "decode_running_peak"
KIT_BUSY_PERIODS = KIT_PREFIX + "busy_periods"
# the programs' oracle evidence counters (conformance/programs/evidence.py)
KIT_EVICTIONS_TOTAL = KIT_PREFIX + "evictions_total"  # radix-cache eviction walks that evicted anything
KIT_PREFILL_CUTS_TOTAL = KIT_PREFIX + "prefill_cuts_total"  # prefills SGLang cut at its chunk budget
# the tree audit (conformance/sglang_plugins/tree_audit.py): audits run, and their cost
KIT_TREE_AUDITS_TOTAL = KIT_PREFIX + "tree_audits_total"  # audits of SGLang's radix tree (before each batch, at idle publishes)
KIT_TREE_AUDIT_SECONDS_TOTAL = KIT_PREFIX + "tree_audit_seconds_total"  # seconds those audits took (cumulative)


@dataclass(frozen=True)
class IdleTerms:
    """One pool's terms of SGLang's idle invariant ``available + evictable + protected +
    session_held == total``, by gauge name (``used`` is what the pool counts as held)."""

    used: str
    available: str
    evictable: str
    protected: str
    session_held: str
    total: str


#: pool -> its idle-invariant gauges (SGLang's own where it exports them, else the kit's).
IDLE_TERMS = {
    "mamba": IdleTerms(MAMBA_USED_TOKENS, MAMBA_AVAILABLE_TOKENS, MAMBA_EVICTABLE_TOKENS,
                       KIT_MAMBA_PROTECTED, KIT_MAMBA_SESSION_HELD, KIT_MAMBA_TOTAL),
    "kv": IdleTerms(KV_USED_TOKENS, KV_AVAILABLE_TOKENS, KV_EVICTABLE_TOKENS,
                    KIT_KV_PROTECTED, KIT_KV_SESSION_HELD, KIT_KV_TOTAL),
}
