"""Torch paths for the Triton-only helpers SGLang's hybrid models reach on every platform.

Each is a REPLACE hook in SGLang's hook registry (the function keeps SGLang's signature):

* ``_launch_track_mamba_states``: copies the conv and SSM state rows of the requests whose
  ``mamba_track_mask`` is set from their working slot (``cache_indices``) to their track
  slot (``mamba_track_indices``), in every layer; the layouts are described by SGLang's
  (layer stride, row stride) pairs, with each (layer, slot) entry contiguous;
* ``fused_gate_sigmoid_mul_add``: the shared-expert gate of Qwen2-MoE style blocks,
  ``final += sigmoid(hidden @ w) * shared``;
* ``topk_softmax``: the MoE router's top-k (bound only on GPU platforms);
* ``layernorm_fn`` / ``rms_norm_gated``: (RMS or layer) norm with an output gate, the
  FLA helpers the gated delta net's output norm calls when AMX is absent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conformance.sglang_plugins.cpu.gdn_ops import CHUNK
from conformance.sglang_plugins.cpu.spec import Binding

TORCH_OPS = ()


def _rows_view(states: torch.Tensor, num_layers: int, strides: tuple, numel: int, rows: int) -> torch.Tensor:
    layer_stride, row_stride = int(strides[0]), int(strides[1])
    return states.as_strided((num_layers, rows, numel), (layer_stride, row_stride, 1), states.storage_offset())


def track_mamba_states_if_needed(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """The older (one layer, row-indexed) form of the same copy (hybrid_linear_attn_backend;
    0.5.16 adds ``check_freed_slots``: skip a request whose slots were freed, index < 0)."""
    src, dst = _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    for states in (conv_states, ssm_states):
        states[dst] = states[src].clone()


def track_mamba_states_all_layers(
    conv_states_pool: torch.Tensor,
    ssm_states_pool: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """The all-layer form of the same copy over ``[num_layers, pool_size, ...]`` pools
    (0.5.22 launches its own Triton kernel for it; 0.5.23 routes it through
    ``_launch_track_mamba_states``)."""
    src, dst = _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel() == 0:
        return
    for pool in (conv_states_pool, ssm_states_pool):
        pool[:, dst] = pool[:, src].clone()


def _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size: int, check_freed_slots: bool):  # noqa: ANN001
    """(source rows, track rows) of the requests whose track mask is set."""
    mask = mamba_track_mask[:batch_size].to(torch.bool)
    src = cache_indices[:batch_size][mask].to(torch.long)
    dst = mamba_track_indices[:batch_size][mask].to(torch.long)
    if check_freed_slots:
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    return src, dst


def launch_track_mamba_states(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    num_layers: int,
    conv_strides: tuple,
    ssm_strides: tuple,
    conv_state_numel_per_row: int,
    ssm_state_numel_per_row: int,
    check_freed_slots: bool,
) -> None:
    if batch_size == 0:
        return
    src, dst = _tracked_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    if src.numel() == 0:
        return
    rows = int(torch.maximum(src.max(), dst.max())) + 1
    for states, strides, numel in (
        (conv_states, conv_strides, conv_state_numel_per_row),
        (ssm_states, ssm_strides, ssm_state_numel_per_row),
    ):
        view = _rows_view(states, num_layers, strides, int(numel), rows)
        view[:, dst] = view[:, src].clone()


def fused_gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    final_hidden_states: torch.Tensor,
) -> None:
    gate = torch.sigmoid(hidden_states @ gate_weight.reshape(-1).to(hidden_states.dtype))
    final_hidden_states += gate.unsqueeze(-1).to(shared_output.dtype) * shared_output


def _gate(y: torch.Tensor, g: torch.Tensor | None, activation: str) -> torch.Tensor:
    if g is None:
        return y
    g = g.float()
    if activation in ("swish", "silu"):
        return y * F.silu(g)
    if activation == "sigmoid":
        return y * torch.sigmoid(g)
    raise NotImplementedError(f"hybrid-conformance sglang-cpu: gated norm activation {activation!r}")


def _norm(x: torch.Tensor, weight, bias, eps: float, is_rms_norm: bool, group_size: int | None) -> torch.Tensor:
    d = x.shape[-1]
    gs = group_size or d
    xg = x.reshape(*x.shape[:-1], d // gs, gs)
    if not is_rms_norm:
        xg = xg - xg.mean(dim=-1, keepdim=True)
    y = (xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)).reshape(x.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False, activation: str = "swish"):
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1]).float()
    z2 = z.reshape(-1, shape[-1]) if z is not None else None
    if z2 is not None and not norm_before_gate:
        x2 = _gate(x2, z2, activation)
        z2 = None
    y = _gate(_norm(x2, weight, bias, eps, is_rms_norm, group_size), z2, activation)
    return y.to(dtype).reshape(shape)


def rms_norm_gated(x, g, weight, bias, activation: str = "swish", residual=None, prenorm: bool = False, residual_in_fp32: bool = False, eps: float = 1e-6):
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    residual_out = None
    if residual is not None:
        x2 = x2.float() + residual.reshape(-1, shape[-1]).float()
        residual_out = x2.to(residual.dtype)
    elif prenorm:
        residual_out = x2.to(torch.float32 if residual_in_fp32 else dtype)
    y = _gate(_norm(x2.float(), weight, bias, eps, True, None), g.reshape(x2.shape), activation).to(dtype).reshape(shape)
    return y if not prenorm else (y, residual_out.reshape(shape))


def topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor, gating_output: torch.Tensor, renormalize: bool = False, *args, **kwargs) -> None:
    """MoE router: softmax over experts, top-k, optional renormalisation, written in place."""
    k = topk_weights.shape[-1]
    weights, ids = torch.topk(gating_output.float().softmax(dim=-1), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids.to(topk_ids.dtype))


BINDINGS = (
    Binding(
        "sglang.srt.layers.attention.hybrid_linear_attn_backend.FLA_CHUNK_SIZE",
        CHUNK,
        "constant",
        "the GDN chunk the extra_buffer prefill tracking divides by; 0.5.12 and older import it "
        "from the FLA kernels only off CPU (NameError on CPU); the kit's prefill h uses the same chunk",
        required=False,
    ),
    Binding(
        "sglang.srt.layers.moe.topk.topk_softmax",
        topk_softmax,
        "bind",
        "MoE router top-k, bound only on CUDA/HIP/XPU/MUSA (sgl_kernel or Triton)",
    ),
    Binding(
        "sglang.kernels.ops.mamba.mamba_state_scatter_triton._launch_track_mamba_states",
        launch_track_mamba_states,
        "replace",
        "Triton copy of conv/SSM rows into track slots (extra_buffer tracking)",
        alternates=(("sglang.srt.layers.attention.hybrid_linear_attn_backend.track_mamba_states_if_needed",
                     track_mamba_states_if_needed),
                    # 0.5.22: the decode path's all-layer copy is a Triton kernel of its own (imported by name)
                    ("sglang.kernels.ops.mamba.mamba_state_scatter_triton.track_mamba_states_all_layers",
                     track_mamba_states_all_layers),
                    ("sglang.srt.layers.attention.hybrid_linear_attn_backend.track_mamba_states_all_layers",
                     track_mamba_states_all_layers)),
    ),
    Binding(
        "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add",
        fused_gate_sigmoid_mul_add,
        "replace",
        "Triton shared-expert gate of the Qwen2-MoE block Qwen3-Next uses",
        alternates=("sglang.kernels.ops.layernorm.elementwise.fused_gate_sigmoid_mul_add",  # 0.5.16
                    "sglang.srt.layers.elementwise.fused_gate_sigmoid_mul_add"),  # 0.5.14 - 0.5.15
        required=False,  # 0.5.13 and older gate the shared expert in torch (a miss crashes in Triton, visibly)
    ),
    Binding(
        "sglang.kernels.ops.attention.fla.layernorm_gated.layernorm_fn",
        layernorm_fn,
        "replace",
        "Triton gated norm; the CPU op path is taken only with AMX",
        alternates=("sglang.srt.layers.attention.fla.layernorm_gated.layernorm_fn",),
    ),
    Binding(
        "sglang.kernels.ops.attention.fla.fused_norm_gate.rms_norm_gated",
        rms_norm_gated,
        "replace",
        "Triton fused gated RMSNorm; the CPU op path is taken only with AMX",
        alternates=("sglang.srt.layers.attention.fla.fused_norm_gate.rms_norm_gated",),
    ),
)
