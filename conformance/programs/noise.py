"""The noise a non-exact cell's programs are judged against, measured at the start of the run.

Outside exact mode (real SGLang in bfloat16, any GPU) a served answer and its cold
computation differ by rounding that depends on the batch and on prefill vs decode.  That
noise is measured on the **cache-off twin against itself**, never on the server under test
(a fault that changed its answers on a miss would otherwise widen the limits that are to
catch it): a batch of fresh prompts generated on the twin (prefill, then decode steps) and
the twin's teacher-forced prefill of the same tokens in another batch, compared exactly as
the oracle compares a request.  The tolerance is
:func:`~conformance.checks.differential.tolerance_from_noise` of that: ``NOISE_FACTOR`` x
the largest noise, under the fixed ceilings ``KL_CEILING`` / ``TIE_CEILING``
(docs/kl-noise.md).  The twin's radix cache is off, so nothing is flushed.
"""

from __future__ import annotations

from typing import Any, Sequence

from conformance.checks.differential import (
    KL_CEILING, TIE_CEILING, Tolerance, cold_from_meta, noise_samples, served_logprobs, tolerance_from_noise,
)
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.workloads.prompts import token_prompts

#: Prompt lengths of the calibration batch (on and off the chunk and checkpoint grids, and as
#: short as the programs' shortest prompts), and its decode: as deep as the programs' ordinary
#: decodes (``strategies._MAX_NEW``, up to 48 tokens).  The noise grows with decode depth and is
#: largest on short prompts: calibrated on 16 tokens of prompts of 64 and more, a clean 0.5.23
#: bfloat16 run failed a 3-token prompt answered with no hit at its 17th output token.
LENGTHS = (3, 8, 64, 97, 150, 200, 257, 300, 333, 120)
NEW_TOKENS = 48
TOP_K = 5
TIMEOUT_S = 300.0

#: One calibration request: (prompt, generated output ids, the generate's meta_info, the prefill's meta_info).
Measured = tuple[list[int], list[int], dict[str, Any], dict[str, Any]]


def measure(twin: SGLangClient, prompts: Sequence[Sequence[int]]) -> list[Measured]:
    """``prompts`` generated in one batch on the cache-off twin, and the twin's
    teacher-forced prefill of prompt + output in a second batch."""
    prompts = [list(p) for p in prompts]
    try:
        generated = twin.generate({
            "input_ids": prompts,
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True} for _ in prompts],
            "return_logprob": True, "top_logprobs_num": TOP_K, "return_text_in_logprobs": False,
        }, timeout=TIMEOUT_S)
        outputs = [list(r.get("output_ids") or []) for r in generated]
        prefilled = twin.generate({
            "input_ids": [p + o for p, o in zip(prompts, outputs)],
            "sampling_params": [{"temperature": 0.0, "max_new_tokens": 0} for _ in prompts],
            "return_logprob": True, "logprob_start_len": [len(p) - 1 for p in prompts], "top_logprobs_num": TOP_K,
            "return_text_in_logprobs": False,
        }, timeout=TIMEOUT_S)
    except KitError as e:
        raise KitError(f"noise calibration of the programs' tolerance on the cache-off twin failed: {e}") from None
    return [(p, o, g.get("meta_info", {}), c.get("meta_info", {})) for p, o, g, c in zip(prompts, outputs, generated, prefilled)]


def samples(measured: Sequence[Measured]) -> tuple[list[float], list[float]]:
    """Per-token top-k KLs and flip margins (greedy gap, twice the top-k deviation) of measured requests."""
    kls: list[float] = []
    gaps: list[float] = []
    for p, o, generated, prefilled in measured:
        k, g = noise_samples(p, o, served_logprobs(generated, None), cold_from_meta(prefilled, len(p) - 1))
        kls += k
        gaps += g
    return kls, gaps


def tolerance(measured: Sequence[Measured]) -> tuple[Tolerance, dict[str, Any]]:
    """The tolerance from measured requests, and what was measured (verdict metrics)."""
    kls, gaps = samples(measured)
    tol = tolerance_from_noise(kls, gaps)
    return tol, {"tokens": len(kls), "kl_max": max(kls), "kl_mean": sum(kls) / len(kls),
                 "gap_max": max(gaps, default=0.0), "kl_cap": tol.kl_cap, "tie_eps": tol.tie_eps,
                 "kl_ceiling": KL_CEILING, "tie_ceiling": TIE_CEILING}


def calibrate(twin: SGLangClient, *, vocab_size: int, seed: str = "programs:noise") -> tuple[Tolerance, dict[str, Any]]:
    """The cache-off twin's measured noise and the tolerance from it."""
    return tolerance(measure(twin, token_prompts(LENGTHS, vocab_size=vocab_size, seed=seed)))
