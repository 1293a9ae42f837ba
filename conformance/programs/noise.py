"""The noise a non-exact cell's programs are judged against, measured at the start of the run.

Outside exact mode (real SGLang in bfloat16, any GPU) a served answer and its cold
computation differ by rounding that depends on the batch and on prefill vs decode.  The
programs' oracle used to cap the per-token top-k KL at the model's ``kl_abs_cap`` (5e-3),
below what a clean bfloat16 token reaches (docs/kl-noise.md), so a clean program could
fail.  Here the cell's own noise is measured first: a batch of fresh prompts (misses, so no
cache is involved) served by the cell's server, prefill then decode, against the cache-off
twin's cold computation of the same tokens, exactly as the oracle compares a request -- and
the tolerance is :func:`~conformance.checks.differential.tolerance_from_noise` of that.  The
cache is flushed afterwards, so the programs start from an empty one.
"""

from __future__ import annotations

from typing import Any, Sequence

from conformance.checks.differential import Tolerance, cold_from_meta, noise_samples, served_logprobs, tolerance_from_noise
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.workloads.prompts import token_prompts

#: Prompt lengths of the calibration batch (on and off the chunk and checkpoint grids).
LENGTHS = (64, 97, 150, 200, 257, 300, 333, 120)
NEW_TOKENS = 16
TOP_K = 5
TIMEOUT_S = 300.0

#: One calibration request: (prompt, served output ids, served meta_info, cold meta_info).
Measured = tuple[list[int], list[int], dict[str, Any], dict[str, Any]]


def measure(client: SGLangClient, cold: SGLangClient, prompts: Sequence[Sequence[int]]) -> list[Measured]:
    """``prompts`` served in one batch on a flushed cache, and their cold computations."""
    prompts = [list(p) for p in prompts]
    client.flush_cache()
    try:
        served = client.generate({
            "input_ids": prompts,
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True} for _ in prompts],
            "return_logprob": True, "top_logprobs_num": TOP_K, "return_text_in_logprobs": False,
        }, timeout=TIMEOUT_S)
        outputs = [list(r.get("output_ids") or []) for r in served]
        colds = cold.generate({
            "input_ids": [p + o for p, o in zip(prompts, outputs)],
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": 0} for _ in prompts],
            "return_logprob": True, "logprob_start_len": [len(p) - 1 for p in prompts], "top_logprobs_num": TOP_K,
            "return_text_in_logprobs": False,
        }, timeout=TIMEOUT_S)
    except KitError as e:
        raise KitError(f"noise calibration of the programs' tolerance failed: {e}") from None
    finally:
        client.flush_cache()
    return [(p, o, s.get("meta_info", {}), c.get("meta_info", {})) for p, o, s, c in zip(prompts, outputs, served, colds)]


def samples(measured: Sequence[Measured]) -> tuple[list[float], list[float]]:
    """Per-token top-k KLs and flip margins (greedy gap, twice the top-k deviation) of measured requests."""
    kls: list[float] = []
    gaps: list[float] = []
    for p, o, served, cold in measured:
        k, g = noise_samples(p, o, served_logprobs(served, None), cold_from_meta(cold, len(p) - 1))
        kls += k
        gaps += g
    return kls, gaps


def tolerance(measured: Sequence[Measured]) -> tuple[Tolerance, dict[str, Any]]:
    """The tolerance from measured requests, and what was measured (verdict metrics)."""
    kls, gaps = samples(measured)
    tol = tolerance_from_noise(kls, gaps)
    return tol, {"tokens": len(kls), "kl_max": max(kls), "kl_mean": sum(kls) / len(kls),
                 "gap_max": max(gaps, default=0.0), "kl_cap": tol.kl_cap, "tie_eps": tol.tie_eps}


def calibrate(client: SGLangClient, cold: SGLangClient, *, vocab_size: int, seed: str = "programs:noise") -> tuple[Tolerance, dict[str, Any]]:
    """The cell's measured noise and the tolerance from it."""
    return tolerance(measure(client, cold, token_prompts(LENGTHS, vocab_size=vocab_size, seed=seed)))
