"""Measurements that say a twin is a useful test subject, and their record in twin.toml.

- entropy: mean next-token entropy (nats) on random prompts (uniform would be ln 512 = 6.24).
- floor: top-k KL between a cached run (prefix state, then the suffix) and a cold run
  of the whole prompt, i.e. what float32 path differences alone give.
- scaled: top-k KL when one recurrent layer's SSM state at the split is multiplied by
  1e-2 (the smallest over layers); reliance = scaled / floor must be >= 1,000.
- early: fraction of suffix positions (mean over prompts) whose greedy token changes when the recurrent
  states at the split are taken one token early (attention KV kept right).
- min_dt: the smallest Mamba2 step dt seen (must stay above time_step_min, see twin_init).
``record(name)`` writes these under ``[recorded]`` in fixtures/models/<name>/twin.toml.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from conformance.reference.model import Twin, load_twin
from conformance.reference.twin_init import min_step_dt
from conformance.reference.twins import RECORDED_TABLE, load_spec

TOP_K = 20
SCALE_FACTOR = 1e-2
FLOOR_MIN = 1e-12  # a floor of exactly 0 counts as this, so the ratio stays finite
PROMPT_LEN = 200
SPLIT = 137  # not aligned to any chunk size
N_PROMPTS = 5
FIRST_ORDINARY_ID = 4  # ids 0-3 are the special tokens


@dataclass(frozen=True)
class TwinMetrics:
    entropy_nats: float
    kl_floor: float
    kl_scaled_min: float
    reliance_ratio: float
    early_state_greedy_change: float
    cached_cold_max_abs: float
    min_dt: float


def random_prompt(twin: Twin, length: int, seed: int) -> list[int]:
    """A seeded prompt of ordinary (non-special) token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ORDINARY_ID, twin.vocab_size, (length,), generator=g).tolist()


def topk_kl(ref: torch.Tensor, test: torch.Tensor, k: int = TOP_K) -> float:
    """Mean over rows of KL(ref || test) restricted to ref's top-k tokens, both renormalized."""
    idx = ref.topk(k, dim=-1).indices
    p = torch.log_softmax(ref.double().gather(-1, idx), dim=-1)
    q = torch.log_softmax(test.double().gather(-1, idx), dim=-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def path_error(twin: Twin, ids: list[int], splits: list[int], decode_tokens: int = 8) -> float:
    """Max |log-prob| difference between one extend of ``ids`` and (a) two extends split at
    each of ``splits``, (b) ``decode_tokens`` one-token extends after each split."""
    cold, _ = twin.extend(twin.empty_state(), ids)
    worst = 0.0
    for split in splits:
        head, state = twin.extend(twin.empty_state(), ids[:split])
        tail, _ = twin.extend(state, ids[split:])
        worst = max(worst, float((torch.cat([head, tail]) - cold).abs().max()))
        for pos in range(split, min(split + decode_tokens, len(ids))):
            row, state = twin.extend(state, ids[pos : pos + 1])
            worst = max(worst, float((row[0] - cold[pos]).abs().max()))
    return worst


def _one_prompt(twin: Twin, ids: list[int]) -> dict[str, float]:
    cold, _ = twin.extend(twin.empty_state(), ids)
    suffix, cold_suffix = ids[SPLIT:], cold[SPLIT:]
    _, before = twin.extend(twin.empty_state(), ids[: SPLIT - 1])
    _, at_split = twin.extend(before, ids[SPLIT - 1 : SPLIT])
    cached, _ = twin.extend(at_split, suffix)
    scaled = [
        topk_kl(cold_suffix, twin.extend(at_split.scale_recurrent(layer, SCALE_FACTOR), suffix)[0])
        for layer in at_split.recurrent_layers()
    ]
    early, _ = twin.extend(at_split.with_recurrent_from(before), suffix)
    return {
        "entropy": float(-(cold.exp() * cold).sum(-1).mean()),
        "floor": topk_kl(cold_suffix, cached),
        "scaled": min(scaled),
        "early": float((early.argmax(-1) != cached.argmax(-1)).double().mean()),
        "max_abs": float((cached - cold_suffix).abs().max()),
        "min_dt": min_step_dt(twin.model, torch.tensor([ids])),
    }


def measure(twin: Twin, n_prompts: int = N_PROMPTS) -> TwinMetrics:
    """Every metric above, over ``n_prompts`` seeded prompts (worst case where it matters)."""
    runs = [_one_prompt(twin, random_prompt(twin, PROMPT_LEN, seed)) for seed in range(n_prompts)]
    floor = max(r["floor"] for r in runs)
    scaled = min(r["scaled"] for r in runs)
    return TwinMetrics(
        entropy_nats=sum(r["entropy"] for r in runs) / len(runs),
        kl_floor=floor,
        kl_scaled_min=scaled,
        reliance_ratio=scaled / max(floor, FLOOR_MIN),
        early_state_greedy_change=sum(r["early"] for r in runs) / len(runs),
        cached_cold_max_abs=max(r["max_abs"] for r in runs),
        min_dt=min(r["min_dt"] for r in runs),
    )


def _toml_value(value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def record(name: str) -> TwinMetrics:
    """Measure twin ``name`` and (re)write the ``[recorded]`` table of its twin.toml."""
    spec = load_spec(name)
    metrics = measure(load_twin(name))
    text = spec.source.read_text()
    head = text.split(f"\n{RECORDED_TABLE}", 1)[0].rstrip("\n")
    lines = [f"\n\n{RECORDED_TABLE}                       # measured by conformance.reference.twin_metrics.record",
             f'spec_hash = "{spec.spec_hash}"']
    lines += [f"{key} = {_toml_value(value)}" for key, value in asdict(metrics).items()]
    spec.source.write_text(head + "\n".join(lines) + "\n")
    return metrics


if __name__ == "__main__":  # python -m conformance.reference.twin_metrics [names...]
    import sys

    from conformance.reference.twins import known_twins

    torch.set_num_threads(1)
    for twin_name in sys.argv[1:] or known_twins():
        print(twin_name, record(twin_name))
