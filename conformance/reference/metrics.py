"""Prometheus text for the reference server's ``/metrics``, with SGLang's metric names.

``sglang:mamba_used_tokens`` is ``total - available - evictable`` mamba slots (held by
running requests, streaming sessions, or leaked), so a leak keeps it above 0 at idle after
``/flush_cache``; ``sglang:kv_used_tokens`` is the same for KV tokens.
"""

from __future__ import annotations

# (metric, kind, help, stats key)
_METRICS = (
    ("sglang:mamba_usage", "gauge", "Fraction of mamba slots in use (not free, not evictable)", "mamba_usage"),
    ("sglang:mamba_used_tokens", "gauge", "Mamba slots held by requests, sessions or leaks", "mamba_used"),
    ("sglang:mamba_available_tokens", "gauge", "Free mamba slots", "mamba_available"),
    ("sglang:mamba_evictable_tokens", "gauge", "Mamba slots held by unlocked radix cache entries", "mamba_evictable"),
    ("sglang:mamba_protected_tokens", "gauge", "Mamba slots held by locked radix cache entries", "mamba_protected"),
    ("sglang:mamba_total_tokens", "gauge", "Size of the mamba slot pool", "mamba_total"),
    ("sglang:kv_used_tokens", "gauge", "KV tokens held by requests, sessions or leaks", "kv_used"),
    ("sglang:kv_available_tokens", "gauge", "Free KV tokens", "kv_available"),
    ("sglang:kv_evictable_tokens", "gauge", "KV tokens held by unlocked radix cache entries", "kv_evictable"),
    ("sglang:max_total_num_tokens", "gauge", "Size of the KV token pool", "kv_total"),
    ("sglang:num_running_reqs", "gauge", "Running requests", "num_running_reqs"),
    ("sglang:num_queue_reqs", "gauge", "Waiting requests", "num_queue_reqs"),
    ("sglang:mamba_pingpong_resident_slots", "gauge", "Ping-pong track slots held now", "pingpong_resident"),
    ("sglang:mamba_pingpong_peak_slots", "gauge", "Most ping-pong track slots held at once", "pingpong_peak"),
    ("sglang:num_sessions", "gauge", "Open sessions", "session_count"),
    ("sglang:cached_tokens_total", "counter", "Prompt tokens served from the radix cache", "counter_cache_hit_tokens"),
    ("sglang:prompt_tokens_total", "counter", "Prompt tokens received", "counter_prompt_tokens"),
    ("sglang:generation_tokens_total", "counter", "Tokens generated", "counter_generation_tokens"),
    ("sglang:num_requests_total", "counter", "Requests finished", "counter_requests_finished"),
    # The terms of SGLang's idle invariant that SGLang does not export; the kit's observe
    # plugin publishes the same names inside real SGLang (conformance/sglang_plugins/observe.py).
    ("hybrid_conformance:mamba_total", "gauge", "Mamba pool size", "mamba_total"),
    ("hybrid_conformance:mamba_protected", "gauge", "Mamba slots of locked radix entries", "mamba_protected"),
    ("hybrid_conformance:mamba_session_held", "gauge", "Mamba slots held by sessions", "mamba_session_held"),
    ("hybrid_conformance:kv_total", "gauge", "KV pool size", "kv_total"),
    ("hybrid_conformance:kv_protected", "gauge", "KV tokens of locked radix entries", "kv_protected"),
    ("hybrid_conformance:kv_session_held", "gauge", "KV tokens held by sessions", "kv_session_held"),
    # The oracle's evidence counters (conformance/programs/evidence.py): the reference
    # server never cuts a prefill (it reports no chunked_prefill_size), so 0 is its truth.
    ("hybrid_conformance:evictions_total", "counter", "Radix cache evictions under pressure (not flushes)", "evictions"),
    ("hybrid_conformance:prefill_cuts_total", "counter", "Prefill batches that cut a request (chunked prefill)", "prefill_cuts"),
)


def render_metrics(stats: dict, model_name: str) -> str:
    lines = []
    label = f'{{model_name="{model_name}"}}'
    for name, kind, help_text, key in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(stats.get(key, 0))}"]
    return "\n".join(lines) + "\n"
