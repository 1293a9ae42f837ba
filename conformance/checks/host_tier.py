"""The ``hicache`` check: prefixes reloaded from SGLang's host tier answer as cold.

Fails when
* no served request reports host-tier tokens (the pressure evicted nothing to reload, or
  SGLang lost the host copies): the check refuses to pass on device hits alone;
* a served request reuses fewer tokens than its warmed prompt stored (the prefix oracle's
  hit with nothing evicted): the host tier holds more than the workload puts in it, so
  nothing evicted that prefix (a stored prefix lost);
* the answers on those hits are not the cold answers (``checks.kl.kl_verdict``, exact on
  float32 CPU twins);
* the host pools are not empty after ``/flush_cache`` at idle (a host slot leaked: the
  observe plugin's ``hybrid_conformance:host_{kv,mamba}_used``), or no host gauge was
  published at all (nothing to judge).
"""

from __future__ import annotations

from typing import Mapping

from conformance.records import Verdict
from conformance.recordings import HostReloadRecording
from conformance.sglang_contract.metric_names import KIT_HOST_KV_USED, KIT_HOST_MAMBA_USED

CHECK = "hicache"
#: The observe plugin's host-tier gauges (conformance.sglang_plugins.observe).
HOST_USED = (KIT_HOST_KV_USED, KIT_HOST_MAMBA_USED)


def host_reload_verdict(rec: HostReloadRecording, kl: Verdict, idle: Mapping[str, float], after_flush: Mapping[str, float]) -> Verdict:
    """``idle``/``after_flush``: the idle probe's gauges before and after its flush."""
    host_total, device_total = sum(rec.host), sum(rec.device)
    lost = [(i, d + h, s) for i, (s, d, h) in enumerate(zip(rec.stored, rec.device, rec.host)) if d + h < s]
    if not any(rec.stored):
        return Verdict(CHECK, "fail", {"requests": len(rec.stored)}, "the warmed prompts store no prefix (prefix oracle): nothing could be reloaded")
    metrics = {
        "requests": len(rec.stored),
        "host_hit_requests": sum(1 for h in rec.host if h > 0),
        "host_tokens": host_total,
        "device_tokens": device_total,
        "pressure_requests": rec.pressure[0],
        "pressure_tokens_each": rec.pressure[1],
        **{f"idle_{g.split(':')[1]}": idle.get(g) for g in HOST_USED},
        **{f"after_flush_{g.split(':')[1]}": after_flush.get(g) for g in HOST_USED},
        **{f"kl_{k}": v for k, v in kl.metrics.items() if isinstance(v, (int, float)) or v is None},
    }
    details = {
        "per_request": [{"stored": s, "device": d, "host": h} for s, d, h in zip(rec.stored, rec.device, rec.host)],
        "kl": {"status": kl.status, "reason": kl.reason},
    }
    problems = []
    if host_total == 0:
        problems.append(
            f"no request was served from the host tier (cached_tokens_details.host = 0 for all {len(rec.stored)}; "
            f"device {device_total} tokens): nothing reloaded was compared"
        )
    if lost:
        i, got, stored = lost[0]
        problems.append(
            f"{len(lost)}/{len(rec.stored)} stored prefixes not reused although the host tier had room for them "
            f"(request {i}: {got} of {stored} stored tokens)"
        )
    missing = [g for g in HOST_USED if after_flush.get(g) is None]
    if missing:
        problems.append(f"no host-tier gauge after /flush_cache ({', '.join(missing)}): the host pools were not judged")
    held = [f"{g} = {after_flush[g]:g}" for g in HOST_USED if after_flush.get(g)]
    if held:
        problems.append(f"host pool not empty after /flush_cache at idle: {', '.join(held)}")
    if kl.status == "fail":
        problems.append(f"answers on host-tier hits differ from cold: {kl.reason}")
    if problems:
        return Verdict(CHECK, "fail", metrics, "; ".join(problems), details)
    if kl.status == "skip":
        return Verdict(CHECK, "skip", metrics, f"kl: {kl.reason}", details)
    return Verdict(CHECK, "pass", metrics, "", details)
