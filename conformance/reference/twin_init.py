"""Init recipes that make a random-weight twin a useful test subject.

Default random init gives (a) near-uniform next-token distributions, so a KL check sees
nothing, and (b) recurrent layers whose state barely matters (Mamba2's readout C·h is
drowned by the D·x skip path; the gated delta-net forgets within a token or two), so a
state bug changes nothing.  ``apply_init_recipe`` fixes both, from the numbers in the
twin's ``[init]`` table:

- ``lm_head_scale``: multiply the LM head (sharper, lower-entropy distributions).
- ``decay_min``/``decay_max``: per-token state decay, spread linearly over the heads of
  every recurrent layer (gated delta-net: exp(-A·softplus(a + dt_bias)) at a = 0;
  Mamba2: exp(-A·dt)), so the state carries information over tens of tokens.
- ``dt`` (Mamba2): the step softplus(dt_bias).  Chosen far above Nemotron-H's
  ``time_step_min`` (0.001): the chunked prefill path clamps dt to that minimum but the
  one-token decode path does not, so if the clamp could bind, cached (decode) and cold
  (prefill) runs would compute different functions (a ~1e-4 log-prob floor).
  ``min_step_dt`` measures the smallest dt a prompt produces so a test can verify it.
- ``skip_d`` (Mamba2): the D skip weight (0: the output is the state readout only).
- ``in_proj_scale``, ``conv_scale`` (Mamba2): scale of the x, B, C projections and of
  the causal conv (default std 0.02 makes x, B, C ~0.02 and the readout C·h ~1e-6,
  under the gated RMSNorm's epsilon), so the readout is O(0.1).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _per_head_decays(n_heads: int, init: dict[str, Any]) -> torch.Tensor:
    return torch.linspace(float(init["decay_min"]), float(init["decay_max"]), n_heads)


def _inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


def is_gated_delta_net(module: nn.Module) -> bool:
    """A Qwen3-Next linear-attention (gated delta-net) mixer."""
    return hasattr(module, "in_proj_qkvz") and hasattr(module, "A_log")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A Mamba2 mixer (Nemotron-H, GraniteMoeHybrid, FalconH1)."""
    return all(hasattr(module, a) for a in ("in_proj", "A_log", "dt_bias", "D", "conv_dim"))


def _init_gated_delta_net(mixer: nn.Module, init: dict[str, Any]) -> None:
    decays = _per_head_decays(mixer.num_v_heads, init)
    mixer.dt_bias.zero_()
    # decay = exp(-A * softplus(0)) -> A = -ln(decay) / ln 2
    mixer.A_log.copy_(torch.log(-torch.log(decays) / math.log(2.0)))


def _init_mamba2(mixer: nn.Module, init: dict[str, Any]) -> None:
    dt = float(init["dt"])
    decays = _per_head_decays(mixer.num_heads, init)
    mixer.dt_bias.fill_(_inverse_softplus(dt))
    mixer.A_log.copy_(torch.log(-torch.log(decays) / dt))  # decay = exp(-A * dt)
    mixer.D.fill_(float(init["skip_d"]))
    start = mixer.intermediate_size  # in_proj rows: [gate | x, B, C | dt]
    mixer.in_proj.weight[start : start + mixer.conv_dim].mul_(float(init["in_proj_scale"]))
    mixer.conv1d.weight.mul_(float(init["conv_scale"]))


@torch.no_grad()
def apply_init_recipe(model: nn.Module, init: dict[str, Any]) -> None:
    """Sharpen the LM head and make every recurrent layer rely on its state (in place)."""
    model.get_output_embeddings().weight.mul_(float(init["lm_head_scale"]))
    for module in model.modules():
        if is_gated_delta_net(module):
            _init_gated_delta_net(module, init)
        elif is_mamba2_mixer(module):
            _init_mamba2(module, init)


@torch.no_grad()
def min_step_dt(model: nn.Module, input_ids: torch.Tensor) -> float:
    """Smallest Mamba2 step dt = softplus(dt_raw + dt_bias) over ``input_ids`` (inf if none).

    Used to verify that Nemotron-H's prefill-only clamp (dt >= time_step_min) never binds.
    """
    seen: list[float] = []
    hooks = []
    for module in model.modules():
        if is_mamba2_mixer(module):
            def hook(_linear, _args, output, mixer=module):
                dt_raw = output[..., -mixer.num_heads :]
                seen.append(float(nn.functional.softplus(dt_raw + mixer.dt_bias).min()))
            hooks.append(module.in_proj.register_forward_hook(hook))
    try:
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    finally:
        for h in hooks:
            h.remove()
    return min(seen, default=math.inf)
