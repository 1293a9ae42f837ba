"""Prometheus text for the reference server's ``/metrics``, with SGLang's metric names.

``sglang:mamba_used_tokens`` is ``total - available - evictable`` mamba slots (held by
running requests, streaming sessions, or leaked), so a leak keeps it above 0 at idle after
``/flush_cache``; ``sglang:kv_used_tokens`` is the same for KV tokens.
"""

from __future__ import annotations

from conformance.sglang_contract.metric_names import (
    CACHED_TOKENS_TOTAL, GENERATION_TOKENS_TOTAL, KIT_EVICTIONS_TOTAL, KIT_KV_PROTECTED, KIT_KV_SESSION_HELD,
    KIT_KV_TOTAL, KIT_MAMBA_PROTECTED, KIT_MAMBA_SESSION_HELD, KIT_MAMBA_TOTAL, KIT_PREFILL_CUTS_TOTAL,
    KV_AVAILABLE_TOKENS, KV_EVICTABLE_TOKENS, KV_USED_TOKENS, MAMBA_AVAILABLE_TOKENS, MAMBA_EVICTABLE_TOKENS,
    MAMBA_PINGPONG_PEAK_SLOTS, MAMBA_PINGPONG_RESIDENT_SLOTS, MAMBA_PROTECTED_TOKENS, MAMBA_TOTAL_TOKENS,
    MAMBA_USAGE, MAMBA_USED_TOKENS, MAX_TOTAL_NUM_TOKENS, NUM_QUEUE_REQS, NUM_REQUESTS_TOTAL, NUM_RUNNING_REQS,
    NUM_SESSIONS, PROMPT_TOKENS_TOTAL,
)

# (metric, kind, help, stats key)
_METRICS = (
    (MAMBA_USAGE, "gauge", "Fraction of mamba slots in use (not free, not evictable)", "mamba_usage"),
    (MAMBA_USED_TOKENS, "gauge", "Mamba slots held by requests, sessions or leaks", "mamba_used"),
    (MAMBA_AVAILABLE_TOKENS, "gauge", "Free mamba slots", "mamba_available"),
    (MAMBA_EVICTABLE_TOKENS, "gauge", "Mamba slots held by unlocked radix cache entries", "mamba_evictable"),
    (MAMBA_PROTECTED_TOKENS, "gauge", "Mamba slots held by locked radix cache entries", "mamba_protected"),
    (MAMBA_TOTAL_TOKENS, "gauge", "Size of the mamba slot pool", "mamba_total"),
    (KV_USED_TOKENS, "gauge", "KV tokens held by requests, sessions or leaks", "kv_used"),
    (KV_AVAILABLE_TOKENS, "gauge", "Free KV tokens", "kv_available"),
    (KV_EVICTABLE_TOKENS, "gauge", "KV tokens held by unlocked radix cache entries", "kv_evictable"),
    (MAX_TOTAL_NUM_TOKENS, "gauge", "Size of the KV token pool", "kv_total"),
    (NUM_RUNNING_REQS, "gauge", "Running requests", "num_running_reqs"),
    (NUM_QUEUE_REQS, "gauge", "Waiting requests", "num_queue_reqs"),
    (MAMBA_PINGPONG_RESIDENT_SLOTS, "gauge", "Ping-pong track slots held now", "pingpong_resident"),
    (MAMBA_PINGPONG_PEAK_SLOTS, "gauge", "Most ping-pong track slots held at once", "pingpong_peak"),
    (NUM_SESSIONS, "gauge", "Open sessions", "session_count"),
    (CACHED_TOKENS_TOTAL, "counter", "Prompt tokens served from the radix cache", "counter_cache_hit_tokens"),
    (PROMPT_TOKENS_TOTAL, "counter", "Prompt tokens received", "counter_prompt_tokens"),
    (GENERATION_TOKENS_TOTAL, "counter", "Tokens generated", "counter_generation_tokens"),
    (NUM_REQUESTS_TOTAL, "counter", "Requests finished", "counter_requests_finished"),
    # The terms of SGLang's idle invariant that SGLang does not export; the kit's observe
    # plugin publishes the same names inside real SGLang (conformance/sglang_plugins/observe.py).
    (KIT_MAMBA_TOTAL, "gauge", "Mamba pool size", "mamba_total"),
    (KIT_MAMBA_PROTECTED, "gauge", "Mamba slots of locked radix entries", "mamba_protected"),
    (KIT_MAMBA_SESSION_HELD, "gauge", "Mamba slots held by sessions", "mamba_session_held"),
    (KIT_KV_TOTAL, "gauge", "KV pool size", "kv_total"),
    (KIT_KV_PROTECTED, "gauge", "KV tokens of locked radix entries", "kv_protected"),
    (KIT_KV_SESSION_HELD, "gauge", "KV tokens held by sessions", "kv_session_held"),
    # The oracle's evidence counters (conformance/programs/evidence.py): the reference
    # server never cuts a prefill (it reports no chunked_prefill_size), so 0 is its truth.
    (KIT_EVICTIONS_TOTAL, "counter", "Radix cache evictions under pressure (not flushes)", "evictions"),
    (KIT_PREFILL_CUTS_TOTAL, "counter", "Prefill batches that cut a request (chunked prefill)", "prefill_cuts"),
)


def render_metrics(stats: dict, model_name: str) -> str:
    lines = []
    label = f'{{model_name="{model_name}"}}'
    for name, kind, help_text, key in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(stats.get(key, 0))}"]
    return "\n".join(lines) + "\n"
