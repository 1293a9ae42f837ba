"""Torch stand-ins for the CPU kernels of Qwen3-Next's gated delta net (``sgl_kernel``).

SGLang 0.5.23 on CPU reaches six kernels of sgl-kernel's CPU extension, three of them
through the Python wrappers of ``sgl_kernel.mamba``:

* ``causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu`` (ops ``causal_conv1d_fwd_cpu``,
  ``causal_conv1d_update_cpu``): depthwise causal conv over the packed q|k|v channels,
  prefill (varlen, optional initial window) and decode, keeping the last ``width - 1``
  inputs of every request in its conv slot ``[slot, dim, width - 1]``, in place;
* ``chunk_gated_delta_rule_cpu``: prefill of the gated delta rule, varlen, reading and
  writing each request's state in the pool in place (``initial_state_indices``);
* ``fused_gdn_gating_cpu``: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``;
* ``fused_sigmoid_gating_delta_rule_update_cpu``: decode (gating + one recurrent step);
* ``fused_rmsnorm_gated_cpu``: ``rmsnorm(x) * weight * silu(gate)``.

The recurrence, per value head, with ``S`` the ``[V, K]`` state (the pool's layout,
``[slots, HV, V, K]``, as SGLang declares it and as its Triton kernels use it)::

    S <- exp(g_t) * S;   u_t = beta_t * (v_t - S k_t);   S <- S + u_t k_t^T;   o_t = S q_t / sqrt(K)

(q and k L2-normalised first when asked).  Query/key heads are shared by
``HV // HK`` consecutive value heads.  The prefill is computed in chunks of 64 tokens
(WY form: one triangular solve per chunk, batched over requests, chunks and heads; one
short Python loop over chunk positions carries the state).  Unlike the real CPU kernel,
``chunk_gated_delta_rule_cpu`` also returns ``h``: the state before every 64-token chunk
of every request, ``[1, sum_i ceil(len_i / 64), HV, V, K]`` in float32, which SGLang's
``extra_buffer`` tracking copies into track slots for prefixes that end inside a chunk.

Slot index ``-1`` (the pad slot) means: start from a zero state, write nothing back.
Everything is computed in float64 and cast back to the caller's dtype (states to the pool's).
The kernels compute in float32, but the stand-ins are the kit's reference: a cumulative decay
over a 64-token chunk cancels in float32 under strong gating, and a 712-token cold prefill of
the Qwen3-Next twin landed 7.5e-4 off in log-prob (above the exact-mode limit of 2e-4) where
float64 agrees with the cached path to 1e-6.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from conformance.sglang_plugins.cpu.spec import WORK_DTYPE, Binding, TorchOp

CHUNK = 64  # SGLang's FLA chunk size for the gated delta net (fixed, no config key)
PAD_SLOT_ID = -1


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _is_silu(activation) -> bool:
    if isinstance(activation, bool):
        return activation
    return activation in ("silu", "swish")


# ---------------------------------------------------------------------------------------
# gated delta rule, varlen and chunked (shared by the prefill and the decode ops)
# ---------------------------------------------------------------------------------------


def gated_delta_rule(
    q: torch.Tensor,  # [T, HK, K]
    k: torch.Tensor,  # [T, HK, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV], log decay (<= 0)
    beta: torch.Tensor,  # [T, HV]
    cu_seqlens: torch.Tensor,  # [N + 1]
    state_pool: Optional[torch.Tensor],  # [slots, HV, V, K], updated in place
    state_indices: Optional[torch.Tensor],  # [N]; None: request i uses slot i
    *,
    use_qk_l2norm: bool,
    eps: float = 1e-6,
    chunk_size: int = CHUNK,
    want_h: bool = False,
):
    """Run N requests through the recurrence; returns ``(o [T, HV, V], final [N, HV, V, K], h)``.

    ``h`` (when ``want_h``) is ``[sum_i ceil(len_i / chunk_size), HV, V, K]``: for request i,
    chunk c, the state after its first ``c * chunk_size`` tokens, requests in order.
    """
    wd = WORK_DTYPE
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # what the kernels return states in
    T, HK, DK = q.shape
    HV, DV = v.shape[1], v.shape[2]
    if HV % HK:
        raise ValueError(f"value heads {HV} not a multiple of key heads {HK}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    N = len(cu) - 1
    lens = [cu[i + 1] - cu[i] for i in range(N)]
    L = chunk_size
    nch = [(n + L - 1) // L for n in lens]
    C = max(nch, default=0)
    o = torch.zeros(T, HV, DV, dtype=wd)

    # initial states, as [N, HV, K, V] ("M", the transpose of the pool's [V, K])
    if state_indices is None:
        slots = torch.arange(N, dtype=torch.long)
    else:
        slots = state_indices.to(torch.long).reshape(-1)
        if slots.numel() != N:
            raise ValueError(f"{slots.numel()} state indices for {N} sequences")
    valid = slots >= 0
    M = torch.zeros(N, HV, DK, DV, dtype=wd)
    if state_pool is not None and bool(valid.any()):
        M[valid] = state_pool[slots[valid]].to(wd).transpose(-1, -2)

    hs = []
    if C > 0:
        qf, kf, vf, gf, bf = (x.to(wd) for x in (q, k, v, g, beta))
        if use_qk_l2norm:
            qf, kf = _l2norm(qf, eps), _l2norm(kf, eps)
        qf = qf * (DK**-0.5)
        rep = HV // HK
        qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)

        # gather into padded chunks [N, C, L, ...]; padding has k = v = q = 0, g = beta = 0,
        # so it adds nothing to the state and does not decay it
        pos = torch.arange(C * L)
        starts = torch.tensor(cu[:-1], dtype=torch.long)
        mask = pos[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]  # [N, C*L]
        idx = (starts[:, None] + pos[None, :]).clamp(max=max(T - 1, 0))

        def chunks(x: torch.Tensor) -> torch.Tensor:
            y = x[idx] * mask.reshape(N, C * L, *([1] * (x.dim() - 1)))
            y = y.reshape(N, C, L, *x.shape[1:])
            return y.movedim(3, 2)  # heads before the chunk axis: [N, C, HV, L, ...]

        qc, kc, vc = chunks(qf), chunks(kf), chunks(vf)
        gc, bc = chunks(gf), chunks(bf)  # [N, C, HV, L]
        G = gc.cumsum(-1)  # decay from the chunk start to (and including) token i
        lower = torch.ones(L, L, dtype=torch.bool).tril()
        decay = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
        # (I + A) U = beta * (v - exp(G) k M0),  A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)
        A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = torch.cat([bc[..., None] * vc, (bc * G.exp())[..., None] * kc], dim=-1)
        sol = torch.linalg.solve_triangular(
            A + torch.eye(L, dtype=wd), rhs, upper=False, unitriangular=True
        )
        u0, w = sol[..., :DV], sol[..., DV:]  # U = u0 - w @ M0
        qk = (qc @ kc.transpose(-1, -2)) * decay  # causal, diagonal included
        q_dec = qc * G.exp()[..., None]
        G_last = G[..., -1]
        k_dec = kc * torch.exp(G_last[..., None] - G)[..., None]

        oc = torch.empty(N, C, HV, L, DV, dtype=wd)
        for c in range(C):
            if want_h:
                hs.append(M)
            U = u0[:, c] - w[:, c] @ M
            oc[:, c] = q_dec[:, c] @ M + qk[:, c] @ U
            M = G_last[:, c].exp()[..., None, None] * M + k_dec[:, c].transpose(-1, -2) @ U
        oc = oc.movedim(2, 3).reshape(N, C * L, HV, DV)
        o[idx[mask]] = oc[mask]

    h = None
    if want_h:
        if hs:
            chunk_mask = torch.arange(C)[None, :] < torch.tensor(nch)[:, None]  # [N, C]
            h = torch.stack(hs, dim=1)[chunk_mask].transpose(-1, -2).contiguous()
        else:
            h = torch.zeros(0, HV, DV, DK, dtype=wd)
        h = h.to(state_dtype)
    final = M.transpose(-1, -2).contiguous().to(state_dtype)  # [N, HV, V, K]
    if state_pool is not None and bool(valid.any()):
        state_pool[slots[valid]] = final[valid].to(state_pool.dtype)
    return o, final, h


# ---------------------------------------------------------------------------------------
# ops (torch.ops.sgl_kernel.*), argument names and order as in sgl-kernel's CPU extension
# ---------------------------------------------------------------------------------------


def chunk_gated_delta_rule_op(
    query, key, value, g, beta, initial_state, output_final_state, cu_seqlens,
    head_first, use_qk_l2norm_in_kernel, initial_state_indices, eps=1e-6,
):
    """query/key [1, T, HK, K], value [1, T, HV, V], g/beta [1, T, HV]; the state of request
    i is ``initial_state[initial_state_indices[i]]`` ([HV, V, K]), overwritten in place with
    its final state.  Returns ``(o [1, T, HV, V], final states [N, HV, V, K] float32)``."""
    o, final, _ = _chunk_prefill(
        query, key, value, g, beta, initial_state, cu_seqlens, head_first,
        use_qk_l2norm_in_kernel, initial_state_indices, eps, want_h=False,
    )
    return o, final


def _chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_l2, indices, eps, want_h):
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first=True is not supported")
    if q.shape[0] != 1:
        raise ValueError(f"chunk_gated_delta_rule_cpu expects a flattened batch [1, T, ...], got {tuple(q.shape)}")
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[1]])
    o, final, h = gated_delta_rule(
        q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state, indices,
        use_qk_l2norm=use_l2, eps=eps, want_h=want_h,
    )
    return o.to(q.dtype).unsqueeze(0), final, (h.unsqueeze(0) if h is not None else None)


def _gating(A_log, a, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    x = a.float() + dt_bias.float()
    return -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)


def fused_gdn_gating_op(A_log, a, b, dt_bias):
    """a, b [B, HV] -> (g [1, B, HV] float32, beta [1, B, HV] in b's dtype)."""
    g = _gating(A_log, a, dt_bias)
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


def fused_sigmoid_gating_delta_rule_update_op(
    A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, cu_seqlens,
    use_qk_l2norm_in_kernel, softplus_beta=1.0, softplus_threshold=20.0,
):
    """Decode: q/k [1, T, HK, K], v [1, T, HV, V], a/b [T, HV] (raw gates), requests delimited
    by ``cu_seqlens`` (one token each in SGLang's decode); states updated in place at
    ``initial_state_indices``.  Returns ``[T, 1, HV, V]`` (the CPU kernel's layout)."""
    if q.shape[0] != 1:
        raise ValueError(f"expected q of shape [1, tokens, heads, dim], got {tuple(q.shape)}")
    g = _gating(A_log, a, dt_bias, softplus_beta, softplus_threshold)
    beta = torch.sigmoid(b.float())
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    chunk = max(1, min(CHUNK, max(lens, default=1)))
    o, _, _ = gated_delta_rule(
        q[0], k[0], v[0], g, beta, cu_seqlens, initial_state_source, initial_state_indices,
        use_qk_l2norm=use_qk_l2norm_in_kernel, eps=1e-6, chunk_size=chunk,
    )
    return o.to(q.dtype).unsqueeze(1)


def fused_rmsnorm_gated_op(input, weight, gate, eps):
    """``x / rms(x) * weight * silu(gate)`` over the last dim, in float32."""
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(input.dtype)


def _conv_apply(window: torch.Tensor, weight: torch.Tensor, bias, silu: bool, n_out: int) -> torch.Tensor:
    """window [..., dim, W - 1 + n] -> outputs of its last n positions, [..., dim, n]."""
    W = weight.shape[-1]
    start = window.shape[-1] - n_out - (W - 1)
    out = sum(weight[:, j : j + 1] * window[..., start + j : start + j + n_out] for j in range(W))
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    return F.silu(out) if silu else out


def causal_conv1d_fwd_op(
    x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
    silu_activation, pad_slot_id, is_vnni,
):
    """x [dim, T] (requests delimited by ``query_start_loc``) or [B, dim, L]; weight [dim, W]
    (plain layout: ``is_vnni`` is accepted and ignored).  Request i starts from
    ``conv_states[cache_indices[i]]`` ([dim, >= W-1]) when ``has_initial_state[i]``, else
    zeros, and leaves its last inputs there.  Returns the conv output, x's shape."""
    wd = WORK_DTYPE
    w = weight.to(wd)
    xs = x.unsqueeze(0) if x.dim() == 2 else x
    out = torch.zeros(xs.shape, dtype=x.dtype)
    if x.dim() == 2:
        qsl = query_start_loc.tolist() if query_start_loc is not None else [0, x.shape[-1]]
        spans = [(0, qsl[i], qsl[i + 1]) for i in range(len(qsl) - 1)]
    else:
        spans = [(i, 0, x.shape[-1]) for i in range(x.shape[0])]
    W = w.shape[-1]
    for seq, (row, s, e) in enumerate(spans):
        slot = int(cache_indices[seq]) if cache_indices is not None else seq
        if slot == pad_slot_id:
            continue
        have_state = conv_states is not None
        width = conv_states.shape[-1] if have_state else W - 1
        init = torch.zeros(xs.shape[1], width, dtype=wd)
        if have_state and has_initial_state is not None and bool(has_initial_state[seq]):
            init = conv_states[slot].to(wd)
        window = torch.cat([init, xs[row, :, s:e].to(wd)], dim=-1)
        out[row, :, s:e] = _conv_apply(window, w, bias, silu_activation, e - s).to(x.dtype)
        if have_state:
            conv_states[slot] = window[:, window.shape[-1] - width :].to(conv_states.dtype)
    return out[0] if x.dim() == 2 else out


def causal_conv1d_update_op(
    x, conv_states, weight, bias, silu_activation, cache_seqlens, conv_state_indices,
    pad_slot_id, is_vnni,
):
    """x [B, dim] (one token per request) or [B, dim, L]; request i's window is
    ``conv_states[conv_state_indices[i]]`` ([dim, >= W-1]), shifted in place.  Returns
    the conv output, x's shape."""
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: circular buffers (cache_seqlens) are not supported")
    wd = WORK_DTYPE
    xs = x.unsqueeze(-1) if x.dim() == 2 else x
    B, n = xs.shape[0], xs.shape[-1]
    slots = (
        conv_state_indices.to(torch.long).reshape(-1)
        if conv_state_indices is not None
        else torch.arange(B, dtype=torch.long)
    )
    keep = slots != pad_slot_id
    out = torch.zeros(xs.shape, dtype=x.dtype)
    if bool(keep.any()):
        window = torch.cat([conv_states[slots[keep]].to(wd), xs[keep].to(wd)], dim=-1)
        out[keep] = _conv_apply(window, weight.to(wd), bias, silu_activation, n).to(x.dtype)
        width = conv_states.shape[-1]
        conv_states[slots[keep]] = window[..., window.shape[-1] - width :].to(conv_states.dtype)
    return out[..., 0] if x.dim() == 2 else out


# ---------------------------------------------------------------------------------------
# sgl_kernel.mamba Python wrappers (what SGLang 0.5.23 imports), same signatures
# ---------------------------------------------------------------------------------------


def causal_conv1d_fn_cpu(
    mixed_qkv_transposed, conv_weights, bias, activation, conv_states, has_initial_state,
    cache_indices, query_start_loc, seq_lens_cpu=None, **_cuda_only,
):
    return causal_conv1d_fwd_op(
        mixed_qkv_transposed, conv_weights, bias, conv_states, query_start_loc, cache_indices,
        has_initial_state, _is_silu(activation), PAD_SLOT_ID, True,
    )


def causal_conv1d_update_cpu(
    mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices,
    intermediate_conv_window=None, intermediate_state_indices=None,
    retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
):
    if intermediate_conv_window is not None:
        raise NotImplementedError(
            "hybrid-conformance sglang-cpu: speculative target-verify conv "
            "(intermediate_conv_window) has no CPU stand-in"
        )
    return causal_conv1d_update_op(
        mixed_qkv, conv_states, conv_weights, bias, _is_silu(activation), None,
        conv_state_indices, PAD_SLOT_ID, True,
    )


def chunk_gated_delta_rule_cpu(
    q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
    initial_state_indices=None,
):
    """Returns ``(o, final_states, h)``; h = state before each 64-token chunk (see module doc).
    Without ``initial_state_indices`` (SGLang 0.5.13 and older on CPU pass the gathered
    ``ssm_states[cache_indices]`` and write the final states back themselves) request i's
    state is ``initial_state[i]``."""
    return _chunk_prefill(
        q, k, v, g, beta, initial_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
        initial_state_indices, 1e-6, want_h=True,
    )


TORCH_OPS = (
    TorchOp(
        "causal_conv1d_fwd_cpu",
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, "
        "bool silu_activation, int pad_slot_id, bool is_vnni) -> Tensor",
        causal_conv1d_fwd_op,
    ),
    TorchOp(
        "causal_conv1d_update_cpu",
        "causal_conv1d_update_cpu(Tensor x, Tensor conv_states, Tensor weight, Tensor? bias, "
        "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, "
        "int pad_slot_id, bool is_vnni) -> Tensor",
        causal_conv1d_update_op,
    ),
    TorchOp(
        "chunk_gated_delta_rule_cpu",
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
        "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
        "bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-6) -> (Tensor, Tensor)",
        chunk_gated_delta_rule_op,
    ),
    TorchOp(
        "fused_gdn_gating_cpu",
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
        fused_gdn_gating_op,
    ),
    TorchOp(
        "fused_sigmoid_gating_delta_rule_update_cpu",
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, "
        "Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, "
        "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, "
        "float softplus_threshold=20.0) -> Tensor",
        fused_sigmoid_gating_delta_rule_update_op,
    ),
    TorchOp(
        "fused_rmsnorm_gated_cpu",
        "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
        fused_rmsnorm_gated_op,
    ),
)

BINDINGS = (
    Binding(
        "sgl_kernel.mamba.causal_conv1d_fn_cpu",
        causal_conv1d_fn_cpu,
        "standin",
        "GDN prefill conv (gdn_backend, CPU branch)",
    ),
    Binding(
        "sgl_kernel.mamba.causal_conv1d_update_cpu",
        causal_conv1d_update_cpu,
        "standin",
        "GDN/KDA decode conv (gdn_backend, kda_backend, CPU branch)",
    ),
    Binding(
        "sgl_kernel.mamba.chunk_gated_delta_rule_cpu",
        chunk_gated_delta_rule_cpu,
        "standin",
        "GDN prefill; returns per-chunk states h for extra_buffer tracking (upstream returns None)",
    ),
)
