"""Fresh idle gauges and SGLang's whole idle invariant on ``/metrics`` (general plugin
``hybrid_conformance_observe``, scheduler process only).

SGLang publishes its pool gauges at idle only when its running-request gauge is stale
or every 30 s, so a reader can see the last batch's numbers long after the server went
idle.  This plugin wraps the scheduler's idle publisher (an AROUND hook through SGLang's
hook registry) so that, at most every :data:`MIN_INTERVAL_S`, an idle scheduler
publishes, and then exports, next to SGLang's own ``sglang:*`` gauges, the terms of the
invariant SGLang checks at idle but does not export:

``hybrid_conformance:{mamba,kv}_{total,protected,session_held}`` and
``hybrid_conformance:idle_publish_seq`` (incremented after each idle publish, so a scrape
that shows a newer sequence number holds gauges refreshed while idle).

Nothing here changes what SGLang schedules, allocates, caches or checks.
"""

from __future__ import annotations

import time
from typing import Any, Callable

TARGET = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter._maybe_log_idle_metrics"
MIN_INTERVAL_S = 0.2
PREFIX = "hybrid_conformance:"

#: name -> reader of the scheduler; a reader that fails (a release without that
#: attribute) leaves the gauge unpublished rather than guessing.
READERS: dict[str, Callable[[Any], float]] = {
    "mamba_total": lambda s: s.req_to_token_pool.mamba_pool.size,
    "mamba_protected": lambda s: s.tree_cache.mamba_protected_size(),
    "mamba_session_held": lambda s: s.pool_stats_observer.session_held_mamba_slots(),
    "kv_total": lambda s: s.req_to_token_pool.schedulable_token_capacity(s.token_to_kv_pool_allocator.size),
    "kv_protected": lambda s: s.tree_cache.full_protected_size(),
    "kv_session_held": lambda s: s.pool_stats_observer.session_held_tokens(),
    "running_reqs": lambda s: len(s.running_batch.reqs),
    "waiting_reqs": lambda s: len(s.waiting_queue),
}


class _Exporter:
    def __init__(self) -> None:
        self.gauges: dict[str, Any] = {}
        self.seq = 0
        self.last = 0.0

    def gauge(self, name: str) -> Any:
        if name not in self.gauges:
            from prometheus_client import Gauge  # after SGLang set PROMETHEUS_MULTIPROC_DIR

            self.gauges[name] = Gauge(PREFIX + name, f"hybrid-conformance observe: {name}", multiprocess_mode="mostrecent")
        return self.gauges[name]

    def publish(self, scheduler: Any) -> None:
        for name, read in READERS.items():
            try:
                value = float(read(scheduler))
            except Exception:
                continue
            self.gauge(name).set(value)
        self.seq += 1
        self.gauge("idle_publish_seq").set(self.seq)


_EXPORTER = _Exporter()


def idle_publish(original: Callable, reporter: Any, *args: Any, **kwargs: Any) -> Any:
    now = time.monotonic()
    due = now - _EXPORTER.last >= MIN_INTERVAL_S
    collector = getattr(reporter, "metrics_collector", None)
    if due and collector is not None and hasattr(collector, "last_log_time"):
        collector.last_log_time = float("-inf")  # SGLang's own publish runs now, not in 30 s
    result = original(reporter, *args, **kwargs)
    if due and collector is not None and getattr(reporter, "current_scheduler_metrics_enabled", False):
        _EXPORTER.last = now
        _EXPORTER.publish(reporter.scheduler)
    return result


def install(role: str) -> dict[str, Any]:
    if role != "scheduler":
        return {}
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, idle_publish, HookType.AROUND)
    HookRegistry.apply_hooks()
    return {"around": [TARGET], "gauges": sorted(PREFIX + n for n in READERS) + [PREFIX + "idle_publish_seq"]}
