"""Recording for the PD suite: one workload through the PD router and through the same
cell's non-PD server, as the frozen records the KL / GSM8K / leak checks judge."""

from __future__ import annotations

from typing import Any, Sequence

from conformance.recordings import KLRecording
from conformance.client import SGLangClient
from conformance.workloads.prompts import extension
from conformance.session.suite_support import idle_probe
from conformance.workloads.runners import cache_enabled, generate_tokens, judge_against_cold
from conformance.sglang_contract.metric_names import KV_USED_TOKENS, MAMBA_USED_TOKENS

SCENARIO = "pd_prefill_hit"


def record_pd_logprobs(
    pd: SGLangClient,
    baseline: SGLangClient,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int,
    top_k: int,
    vocab_size: int,
    ext_len: int = 8,
    timeout: float | None = None,
) -> KLRecording:
    """PD-served logprobs against the NON-PD server's cold re-prefill of the same tokens.

    Served: through the PD router on a prefill-side cache hit (each prompt warmed through
    the router, then prompt + ``ext_len`` new tokens generated), so the decode server
    continues from a shipped state that the prefill server partly took from its cache.
    Reference, noise floor and free-running cold tokens: ``judge_against_cold`` on the
    non-PD server.
    """
    enabled = cache_enabled(pd)
    pd.flush_cache()
    generate_tokens(pd, prompts, 0, timeout=timeout)
    inputs = [tuple(p) + extension(ext_len, vocab_size=vocab_size, seed=f"pd:{i}") for i, p in enumerate(prompts)]
    served = generate_tokens(pd, inputs, new_tokens, top_k=top_k, timeout=timeout)
    pd.flush_cache()
    return judge_against_cold(
        served, inputs, baseline, scenario=SCENARIO, enabled=enabled, new_tokens=new_tokens,
        top_k=top_k, timeout=timeout,
    )


def probe_both(pd: Any, scenario: str, *, requests: int, gauges: Sequence[str]) -> list:
    """Flush each PD server and wait for its idle gauges; the probes are kept on ``pd.extra``."""
    extra = tuple(g for g in gauges if g not in (MAMBA_USED_TOKENS, KV_USED_TOKENS))
    probes = [idle_probe(client, f"{role} {scenario}", requests=requests, zero_gauges=extra) for role, client in (("prefill", pd.prefill), ("decode", pd.decode))]
    pd.extra.setdefault("idle_probes", []).extend(probes)
    return probes
