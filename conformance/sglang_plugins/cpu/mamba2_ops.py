"""Torch stand-ins for the Mamba2 layer kernels of SGLang's ``MambaMixer2`` on CPU.

Nemotron-H, Granite-4.0-H (GraniteMoeHybrid) and FalconH1 run their Mamba2 mixer
through four kernels that SGLang 0.5.23 only has for CUDA/Triton:

* ``causal_conv1d_fn`` (prefill, varlen, per-sequence conv state read and advanced in
  place at ``cache_indices``) and ``causal_conv1d_update`` (decode), each in the
  signature of SGLang's CUDA wrapper and of its Triton module;
* ``mamba_chunk_scan_combined``: the SSD chunked scan over a packed varlen batch, with
  per-sequence initial states, the states at the flat chunk grid (``h``, used for prefix
  tracking), the final state of every sequence and the recomputed states at arbitrary
  track positions;
* ``selective_state_update``: one (or ``T``) decode steps of the recurrence, state
  updated in place at ``state_batch_indices``.

The recurrence, per head ``h`` and sequence, with ``dt' = clamp(softplus(dt + dt_bias))``::

    state_t = exp(dt'_t * A_h) * state_{t-1} + dt'_t * x_t (outer) B_t
    y_t     = state_t . C_t + D_h * x_t          (then * silu(z_t) when z is given)

The scan is exact chunked arithmetic (a Python loop over chunks, everything inside a
chunk vectorised), computed in float64 and cast back, as the gated delta rule's stand-ins
are (``gdn_ops``: a cumulative decay cancels in float32 under strong gating).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from conformance.sglang_plugins.cpu.spec import WORK_DTYPE, Binding

TORCH_OPS = ()

PAD_SLOT_ID = -1

_MAMBA = "sglang.srt.layers.attention.mamba.mamba"
_MAMBA_PKG = "sglang.srt.layers.attention.mamba"  # before the kernels moved to sglang.kernels (0.5.13 and older)
_MAMBA_OPS = f"{_MAMBA_PKG}.ops"
_PREFIX = "hybrid-conformance sglang-cpu mamba2"


# ----------------------------------------------------------------------------- helpers


def _activate(v: torch.Tensor, activation) -> torch.Tensor:  # noqa: ANN001
    if activation is None or activation is False:
        return v
    if activation is True or activation in ("silu", "swish"):
        return F.silu(v)
    raise NotImplementedError(f"{_PREFIX}: conv activation {activation!r}")


def _unsupported(**kwargs) -> None:  # noqa: ANN003
    given = [k for k, v in kwargs.items() if v is not None]
    if given:
        raise NotImplementedError(f"{_PREFIX}: {', '.join(given)} (speculative / circular-buffer paths) not supported on CPU")


def _as_list(t) -> list:  # noqa: ANN001
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in t]


# ------------------------------------------------------------------------ causal conv1d


def _conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: Optional[torch.Tensor],
    starts: Sequence[int],
    lens: Sequence[int],
    cache_indices: Optional[list],
    has_initial_state: Optional[list],
    activation,  # noqa: ANN001
    pad_slot_id: Optional[int],
) -> torch.Tensor:
    """Depthwise causal conv over packed sequences of ``x`` (dim, tokens); returns (dim, tokens).

    Each sequence sees its own ``width - 1`` prior columns: the slot's conv state when
    ``has_initial_state`` says so, zeros otherwise; afterwards the slot holds the last
    ``width - 1`` columns of [prior, sequence] (the kernel's state layout: oldest first).
    """
    dim, total = x.shape
    width = weight.shape[1]
    sl = width - 1
    cdt = WORK_DTYPE
    xs = x.to(cdt)
    pieces, out_index, writes = [], [], []
    offset = 0
    for i, (s, n) in enumerate(zip(starts, lens)):
        slot = cache_indices[i] if cache_indices is not None else i
        use_slot = conv_states is not None and not (pad_slot_id is not None and slot == pad_slot_id)
        if use_slot and has_initial_state is not None and has_initial_state[i]:
            # read as x's dtype first, like the kernel
            prior = conv_states[slot, :, :sl].to(x.dtype).to(cdt)
        else:
            prior = xs.new_zeros(dim, sl)
        seg = torch.cat([prior, xs[:, s : s + n]], dim=1)
        pieces.append(seg)
        out_index.append(torch.arange(offset, offset + n) if n > 0 else torch.zeros(0, dtype=torch.long))
        offset += sl + n
        if use_slot and n > 0:
            writes.append((slot, seg[:, -sl:] if sl > 0 else seg[:, :0]))
    out_tm = torch.zeros(total, dim, dtype=x.dtype, device=x.device)  # token-major; returned transposed
    if pieces:
        ext = torch.cat(pieces, dim=1).unsqueeze(0)
        w = weight.to(cdt).unsqueeze(1)
        b = bias.to(cdt) if bias is not None else None
        y = _activate(F.conv1d(ext, w, b, groups=dim)[0], activation)  # (dim, offset - sl)
        tok = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(x.device)
        out_tm[tok] = y[:, torch.cat(out_index).to(x.device)].t().to(x.dtype)
    for slot, cols in writes:  # after every read: slots are written once all priors are taken
        conv_states[slot, :, :sl] = cols.to(conv_states.dtype)
    return out_tm.t()


def _conv_prefill_any(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, pad_slot_id):  # noqa: ANN001, ANN202
    cache = _as_list(cache_indices)
    init = None if has_initial_state is None else [bool(v) for v in has_initial_state.reshape(-1).tolist()]
    if x.dim() == 3:  # (batch, dim, seqlen): one sequence per row
        outs = []
        for b in range(x.shape[0]):
            outs.append(
                _conv_prefill(
                    x[b], weight, bias, conv_states, [0], [x.shape[2]],
                    [cache[b] if cache is not None else b], None if init is None else [init[b]],
                    activation, pad_slot_id,
                )
            )
        return torch.stack(outs)
    if query_start_loc is None:
        starts, lens = [0], [x.shape[1]]
    else:
        q = _as_list(query_start_loc)
        starts, lens = q[:-1], [e - s for s, e in zip(q[:-1], q[1:])]
    return _conv_prefill(x, weight, bias, conv_states, starts, lens, cache, init, activation, pad_slot_id)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    conv_states: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """SGLang's ``srt.layers.attention.mamba.causal_conv1d.causal_conv1d_fn`` signature.

    ``x``: (dim, total_tokens) packed by ``query_start_loc``, or (batch, dim, seqlen).
    Returns a new tensor shaped like ``x`` (``x`` is not modified); ``conv_states``
    (slots, dim, >= width - 1) advanced in place at ``cache_indices``.
    ``seq_lens_cpu`` and other kernel-tuning kwargs are accepted and ignored.
    """
    kwargs.pop("seq_lens_cpu", None)
    kwargs.pop("validate_data", None)
    _unsupported(block_table=kwargs.pop("block_table", None))
    return _conv_prefill_any(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, pad_slot_id)


def causal_conv1d_fn_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: Optional[list] = None,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    validate_data: bool = False,
    block_table: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """``sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn`` signature (same math).

    ``seq_lens_cpu`` / ``validate_data`` are launch hints (ignored: lengths come from
    ``query_start_loc``); ``block_table`` (CUDA-graph launch) is not supported.
    """
    _unsupported(block_table=block_table)
    return _conv_prefill_any(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, pad_slot_id)


def _conv_update(x, conv_state, weight, bias, activation, conv_state_indices, pad_slot_id):  # noqa: ANN001, ANN202
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x  # (batch, dim, T)
    batch, dim, _ = x3.shape
    width = weight.shape[1]
    sl = width - 1
    cdt = WORK_DTYPE
    if conv_state_indices is None:
        slots = torch.arange(batch, device=x.device)
    else:
        slots = conv_state_indices.reshape(-1).to(torch.long)
    valid = slots != pad_slot_id if pad_slot_id is not None else torch.ones_like(slots, dtype=torch.bool)
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    prior = conv_state[safe][:, :, :sl].to(x.dtype).to(cdt)
    prior = prior * valid.to(cdt)[:, None, None]
    win = torch.cat([prior, x3.to(cdt)], dim=2)  # (batch, dim, sl + T)
    windows = win.unfold(2, width, 1)  # (batch, dim, T, width)
    y = (windows * weight.to(cdt)[None, :, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.to(cdt)[None, :, None]
    y = _activate(y, activation).to(x.dtype)
    if bool(valid.any()) and sl > 0:
        conv_state[slots[valid], :, :sl] = win[valid][:, :, -sl:].to(conv_state.dtype)
    return y.squeeze(-1) if squeeze else y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """SGLang's ``srt.layers.attention.mamba.causal_conv1d.causal_conv1d_update`` signature.

    ``x``: (batch, dim) or (batch, dim, T); returns a new tensor shaped like ``x``; the
    conv state rows ``conv_state_indices`` are shifted in place (pad rows untouched).
    ``cache_seqlens`` (circular-buffer state) is not supported.
    """
    _unsupported(cache_seqlens=cache_seqlens)
    return _conv_update(x, conv_state, weight, bias, activation, conv_state_indices, pad_slot_id)


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation=None,  # noqa: ANN001
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    num_accept_tokens: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    retrieve_next_token: Optional[torch.Tensor] = None,
    retrieve_next_sibling: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata=None,  # noqa: ANN001
    validate_data: bool = False,
) -> torch.Tensor:
    """``sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update`` signature.

    ``metadata`` / ``validate_data`` are ignored; the speculative-decoding arguments
    (accepted-token counts, intermediate windows, EAGLE tree links) and
    ``cache_seqlens`` raise ``NotImplementedError``.
    """
    _unsupported(
        cache_seqlens=cache_seqlens,
        num_accept_tokens=num_accept_tokens,
        intermediate_conv_window=intermediate_conv_window,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        retrieve_parent_token=retrieve_parent_token,
    )
    return _conv_update(x, conv_state, weight, bias, activation, conv_state_indices, pad_slot_id)


# ------------------------------------------------------------------ SSD chunked scan


def _dt_processed(dt, dt_bias, dt_softplus, dt_limit, cdt):  # noqa: ANN001, ANN202
    v = dt.to(cdt)
    if dt_bias is not None:
        v = v + dt_bias.to(cdt)
    if dt_softplus:
        v = F.softplus(v)  # identity above 20, like the kernels
    lo, hi = dt_limit
    return v.clamp(min=float(lo), max=float(hi))


def _scan_row(
    x: torch.Tensor,  # (L, H, P)
    dt: torch.Tensor,  # (L, H), processed
    A: torch.Tensor,  # (H,)
    Bh: torch.Tensor,  # (L, H, N)
    Ch: torch.Tensor,  # (L, H, N)
    sid: list,  # sequence id of every token (non-decreasing)
    init_of: Callable[[int], torch.Tensor],
    chunk_size: int,
    track: dict,  # chunk -> list of (key, local position)
):
    """One packed row. Returns (y (L,H,P) without D/z, h (nchunks,H,P,N), finals {seq: state},
    tracked {key: state}, last running state)."""
    L, H, P = x.shape
    N = Bh.shape[-1]
    cdt = x.dtype
    nchunks = math.ceil(L / chunk_size)
    y = torch.empty(L, H, P, dtype=cdt)
    h = torch.empty(nchunks, H, P, N, dtype=cdt)
    finals, tracked = {}, {}
    run, run_sid = None, None
    for c in range(nchunks):
        lo, hi = c * chunk_size, min(L, (c + 1) * chunk_size)
        T = hi - lo
        # segments: maximal runs of one sequence inside the chunk
        seg_sids, counts = [], []
        for s in sid[lo:hi]:
            if seg_sids and seg_sids[-1] == s:
                counts[-1] += 1
            else:
                seg_sids.append(s)
                counts.append(1)
        K = len(seg_sids)
        seg_starts = [0]
        for n in counts[:-1]:
            seg_starts.append(seg_starts[-1] + n)
        S0 = torch.stack(
            [run if (k == 0 and run is not None and run_sid == s) else init_of(s).to(cdt) for k, s in enumerate(seg_sids)]
        )  # (K, H, P, N): state each segment starts from
        if c == 0:
            h[0] = S0[0]
        seg_of = torch.repeat_interleave(torch.arange(K), torch.tensor(counts))
        xc, dtc, Bc, Cc = x[lo:hi], dt[lo:hi], Bh[lo:hi], Ch[lo:hi]
        cum = (dtc * A).cumsum(0)  # (T, H)
        cum0 = torch.cat([cum.new_zeros(1, H), cum])  # cum0[i] = sum of dA before local token i
        base = cum0[torch.tensor(seg_starts)[seg_of]]  # (T, H): before the token's segment start
        pos = torch.arange(T)
        allowed = (seg_of[:, None] == seg_of[None, :]) & (pos[None, :] <= pos[:, None])  # (t, s)
        decay = torch.exp((cum[:, None, :] - cum[None, :, :]).masked_fill(~allowed[..., None], float("-inf")))
        # intra-chunk (diagonal block): y_t += sum_s (C_t.B_s) exp(cum_t - cum_s) dt_s x_s
        W = torch.einsum("thn,shn->tsh", Cc, Bc) * decay * dtc[None, :, :]
        yc = torch.einsum("tsh,shp->thp", W, xc)
        # carried-in state of each segment, decayed to token t
        carry = torch.exp(cum - base)  # (T, H)
        for k in range(K):
            r = slice(seg_starts[k], seg_starts[k] + counts[k])
            yc[r] += carry[r][:, :, None] * torch.einsum("thn,hpn->thp", Cc[r], S0[k])
        y[lo:hi] = yc
        # states after chosen local positions: every segment end, then tracked positions
        extra = track.get(c, [])
        qpos = torch.tensor([seg_starts[k] + counts[k] - 1 for k in range(K)] + [p for _, p in extra])
        qseg = seg_of[qpos]
        qallowed = (seg_of[None, :] == qseg[:, None]) & (pos[None, :] <= qpos[:, None])  # (q, s)
        qw = torch.exp((cum[qpos][:, None, :] - cum[None, :, :]).masked_fill(~qallowed[..., None], float("-inf")))
        qw = qw * dtc[None, :, :]
        Sq = torch.einsum("qsh,shn,shp->qhpn", qw, Bc, xc)
        Sq = Sq + torch.exp(cum[qpos] - base[qpos])[:, :, None, None] * S0[qseg]
        for k in range(K):
            end = lo + seg_starts[k] + counts[k]  # global exclusive end of the segment
            if end == L or sid[end] != seg_sids[k]:
                finals[seg_sids[k]] = Sq[k]
        for j, (key, _) in enumerate(extra):
            tracked[key] = Sq[K + j]
        run, run_sid = Sq[K - 1], seg_sids[K - 1]
        if c + 1 < nchunks:
            h[c + 1] = run  # state at the chunk boundary, of the sequence that reached it
    return y, h, finals, tracked, run


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    chunk_indices=None,
    chunk_offsets=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    out=None,
    return_final_states=False,
    return_varlen_states=False,
    return_intermediate_states=False,
    state_dtype=None,
    return_track_states=False,
    track_seq_idx=None,
    track_end_locs=None,
):  # noqa: ANN001, ANN201
    """SSD chunked scan; SGLang's ``triton_ops.mamba_chunk_scan_combined`` contract.

    x (batch, L, H, P); dt (batch, L, H); A (H,); B, C (batch, L, G, N); D (H,) or (H, P);
    z like x; initial_states (num_seqs, H, P, N) with ``cu_seqlens`` (varlen, batch 1), else
    (batch, H, P, N) for the first sequence of each row.  ``out`` (like x) receives y in
    place.  ``chunk_indices`` / ``chunk_offsets`` (Triton's logical-chunk launch plan) are
    accepted and not needed: sequence boundaries come from ``seq_idx`` / ``cu_seqlens``.

    Returned, as SGLang does: with ``return_track_states`` -> (h, varlen_states,
    track_states); h (batch, nchunks, H, P, N): h[c] the state at flat position
    c * chunk_size of the sequence that reached it (h[0]: first sequence's initial
    state); varlen_states (num_seqs, H, P, N) every sequence's final state;
    track_states (1, len(track_seq_idx), H, P, N): the state of sequence
    track_seq_idx[i] after the flat tokens [cu_seqlens[i], track_end_locs[i]), or None.
    """
    if not return_varlen_states:
        cu_seqlens = None
    elif cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    if return_track_states and not return_varlen_states:
        raise ValueError("return_track_states requires return_varlen_states (cu_seqlens mode)")
    batch, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if H % G:
        raise ValueError(f"{_PREFIX}: nheads {H} not divisible by ngroups {G}")
    cdt = WORK_DTYPE
    dev = x.device
    heads_group = torch.arange(H, device=dev) // (H // G)
    xs = x.to(cdt)
    dts = _dt_processed(dt, dt_bias, dt_softplus, dt_limit, cdt)
    As = A.to(cdt)
    Bh = B.to(cdt).index_select(2, heads_group)
    Ch = C.to(cdt).index_select(2, heads_group)
    out_state_dtype = state_dtype if state_dtype is not None else C.dtype
    if out is None:
        out = torch.empty_like(x)
    varlen = cu_seqlens is not None
    if varlen and batch != 1:
        raise ValueError("passing cu_seqlens to get the varlen states is only supported if batch dimension is 1")
    cu = _as_list(cu_seqlens) if varlen else None
    zero = torch.zeros(H, P, N, dtype=cdt, device=dev)

    tracks = []
    if return_track_states and track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel() > 0:
        tracks = list(zip(_as_list(track_seq_idx), _as_list(track_end_locs)))

    hs, finals_all, final_states = [], None, torch.empty(batch, H, P, N, dtype=torch.float32, device=dev)
    track_states = [None] * len(tracks)
    for b in range(batch):
        if seq_idx is not None:
            sid = _as_list(seq_idx[b])
        elif varlen:
            sid = [i for i in range(len(cu) - 1) for _ in range(cu[i + 1] - cu[i])]
        else:
            sid = [0] * L
        if len(sid) != L:
            raise ValueError(f"{_PREFIX}: seq_idx / cu_seqlens cover {len(sid)} tokens, x has {L}")

        def init_of(s: int, b=b, first=sid[0] if sid else 0) -> torch.Tensor:  # noqa: ANN001
            if initial_states is None:
                return zero
            if varlen:
                return initial_states[s].to(cdt)
            return initial_states[b].to(cdt) if s == first else zero

        track_by_chunk: dict = {}
        if varlen:
            for i, (s, e) in enumerate(tracks):
                if not (cu[s] <= e <= cu[s + 1]):
                    raise ValueError(f"{_PREFIX}: track end {e} outside sequence {s} [{cu[s]}, {cu[s + 1]})")
                if e == cu[s]:
                    track_states[i] = init_of(s)
                else:
                    track_by_chunk.setdefault((e - 1) // chunk_size, []).append((i, (e - 1) % chunk_size))
        if L == 0:
            hs.append(torch.empty(0, H, P, N, dtype=cdt, device=dev))
            finals_all = {}
            final_states[b] = zero.float()
            continue
        y, h, finals, tracked, last = _scan_row(xs[b], dts[b], As, Bh[b], Ch[b], sid, init_of, chunk_size, track_by_chunk)
        if D is not None:
            Dv = D.to(cdt)
            y = y + xs[b] * (Dv[:, None] if Dv.dim() == 1 else Dv)
        if z is not None:
            y = y * F.silu(z[b].to(cdt))
        out[b].copy_(y.to(out.dtype))
        hs.append(h)
        finals_all = finals
        final_states[b] = last.float()
        for i, st in tracked.items():
            track_states[i] = st

    states = torch.stack(hs).to(out_state_dtype)
    varlen_states = None
    if varlen:
        varlen_states = torch.stack(
            [finals_all.get(s, init_of(s)) for s in range(len(cu) - 1)]
        ).to(out_state_dtype) if len(cu) > 1 else torch.empty(0, H, P, N, dtype=out_state_dtype, device=dev)
    if return_track_states:
        ts = torch.stack(track_states).unsqueeze(0).to(out_state_dtype) if tracks else None
        return states, varlen_states, ts
    if return_intermediate_states:
        if return_varlen_states:
            return (states, final_states, varlen_states) if return_final_states else (states, varlen_states)
        return (states, final_states) if return_final_states else states
    if not return_varlen_states:
        return final_states if return_final_states else None
    return (final_states, varlen_states) if return_final_states else varlen_states


# ------------------------------------------------------------- selective state update


def _ssu_dims(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Normalise like the kernel: unsqueeze dim 1 until the tensor has 4 dims (batch, T, heads, ...)."""
    if t is None:
        return None
    while t.dim() < 4:
        t = t.unsqueeze(1)
    return t


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    state_batch_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: Optional[torch.Tensor] = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    cache_steps: Optional[int] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    enable_stochastic_rounding: bool = False,
    cache_philox_rounds: int = 0,
) -> Optional[torch.Tensor]:
    """Decode step(s); SGLang's ``triton_ops.selective_state_update`` (dispatcher) contract.

    state (slots, H, P, N); x (batch, H, P) or (batch, T, H, P); dt like x; A (H, P, N);
    B, C (batch, G, N) or (batch, T, G, N); D, dt_bias (H, P); z like x or None; out like x,
    written in place.  The state rows ``state_batch_indices`` are updated in place unless
    ``disable_state_update``; rows equal to ``pad_slot_id`` start from zero and are never
    written.  With ``intermediate_states_buffer`` the state after every step is stored at
    [cache row, step] (cache row: ``intermediate_state_indices`` or the state slot);
    ``retrieve_parent_token`` restarts step t from its parent step's stored state (EAGLE
    trees).  ``enable_stochastic_rounding`` / ``cache_philox_rounds`` (fp16 cache rounding
    on GPU) are accepted and ignored: states are rounded to nearest.
    """
    st4 = state.unsqueeze(1) if state.dim() == 3 else state
    _, H, P, N = st4.shape
    x4 = _ssu_dims(x)
    dt4 = _ssu_dims(dt)
    B4, C4, z4 = _ssu_dims(B), _ssu_dims(C), _ssu_dims(z)
    A3 = A.unsqueeze(0) if A.dim() == 2 else A
    D2 = D.unsqueeze(0) if D is not None and D.dim() == 1 else D
    bias2 = dt_bias.unsqueeze(0) if dt_bias is not None and dt_bias.dim() == 1 else dt_bias
    if out is None:
        out = torch.empty_like(x)
    out4 = _ssu_dims(out)
    batch, T = x4.shape[0], x4.shape[1]
    G = B4.shape[2]
    if H % G:
        raise ValueError(f"{_PREFIX}: nheads {H} not divisible by ngroups {G}")
    cdt = WORK_DTYPE
    dev = x.device
    heads_group = torch.arange(H, device=dev) // (H // G)
    if state_batch_indices is not None:
        slots = state_batch_indices.reshape(-1).to(torch.long)
        valid = slots != pad_slot_id
    else:
        slots = torch.arange(batch, device=dev)
        valid = torch.ones(batch, dtype=torch.bool, device=dev)
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    s = st4[safe].to(cdt) * valid.to(cdt)[:, None, None, None]  # (batch, H, P, N)
    Af = A3.to(cdt)
    buf = None
    if intermediate_states_buffer is not None:
        steps = cache_steps if cache_steps else T
        buf = intermediate_states_buffer.view(-1, steps, H, P, N)
        if intermediate_state_indices is not None:
            cache_rows = intermediate_state_indices.reshape(-1).to(torch.long)
        elif state_batch_indices is not None:
            cache_rows = slots
        else:
            cache_rows = torch.arange(batch, device=dev)
    elif retrieve_parent_token is not None:
        raise ValueError(f"{_PREFIX}: retrieve_parent_token needs intermediate_states_buffer")
    for t in range(T):
        if retrieve_parent_token is not None and t > 0:
            parent = retrieve_parent_token[:, t].to(torch.long)
            use = (parent >= 0) & (parent < T) & (cache_rows >= 0)
            if bool(use.any()):
                prev = buf[cache_rows.clamp(min=0), parent.clamp(0, T - 1)].to(cdt)
                s = torch.where(use[:, None, None, None], prev, s)
        d = dt4[:, t].to(cdt)
        if bias2 is not None:
            d = d + bias2.to(cdt)
        if dt_softplus:
            d = F.softplus(d)
        xt = x4[:, t].to(cdt)
        Bt = B4[:, t].to(cdt).index_select(1, heads_group)  # (batch, H, N)
        Ct = C4[:, t].to(cdt).index_select(1, heads_group)
        s = s * torch.exp(Af[None] * d[..., None]) + (d * xt)[..., None] * Bt[:, :, None, :]
        if buf is not None and state_batch_indices is not None and bool(valid.any()):
            buf[cache_rows[valid], t] = s[valid].to(buf.dtype)
        yt = (s * Ct[:, :, None, :]).sum(-1)
        if D2 is not None:
            yt = yt + xt * D2.to(cdt)
        if z4 is not None:
            yt = yt * F.silu(z4[:, t].to(cdt))
        out4[:, t] = yt.to(out4.dtype)
    if not disable_state_update and bool(valid.any()):
        st4[slots[valid]] = s[valid].to(st4.dtype)
    return out


# -------------------------------------------------------------------------- bindings

BINDINGS = (
    Binding(
        "sglang.kernels.ops.mamba.triton_ops.mamba_chunk_scan_combined",
        mamba_chunk_scan_combined,
        "replace",
        "Mamba2 prefill SSD scan (varlen, initial/final/chunk-grid/track states) is Triton-only; "
        "the hook registry propagates it to mamba.py's imported name",
        alternates=(f"{_MAMBA_OPS}.ssd_combined.mamba_chunk_scan_combined",),
    ),
    Binding(
        "sglang.kernels.ops.mamba.triton_ops.selective_state_update",
        selective_state_update,
        "replace",
        "Mamba2 decode step: the dispatcher only knows Triton / FlashInfer backends",
        alternates=(f"{_MAMBA_OPS}.mamba_ssm.selective_state_update",),
    ),
    Binding(
        f"{_MAMBA}.causal_conv1d_fn",
        causal_conv1d_fn,
        "bind",
        "prefill conv (FalconH1 path, use_triton_causal_conv=False); bound in mamba.py only under is_cuda()",
    ),
    Binding(
        f"{_MAMBA}.causal_conv1d_fn_triton",
        causal_conv1d_fn_triton,
        "bind",
        "prefill conv (Nemotron-H, Granite-4.0-H: use_triton_causal_conv=True); NameError on CPU otherwise",
    ),
    Binding(
        f"{_MAMBA}.causal_conv1d_update",
        causal_conv1d_update,
        "bind",
        "decode conv (FalconH1 path); bound in mamba.py only under is_cuda()",
    ),
    Binding(
        f"{_MAMBA}.causal_conv1d_update_triton",
        causal_conv1d_update_triton,
        "bind",
        "decode conv (Nemotron-H, Granite-4.0-H); bound in mamba.py only under is_cuda()",
    ),
    Binding(
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn",
        causal_conv1d_fn_triton,
        "replace",
        "the Triton conv module itself, for callers that reach it directly or through "
        "srt.layers.attention.mamba.causal_conv1d's non-CUDA fallback",
        alternates=(f"{_MAMBA_PKG}.causal_conv1d_triton.causal_conv1d_fn",),
    ),
    Binding(
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update",
        causal_conv1d_update_triton,
        "replace",
        "the Triton conv update itself, for callers that reach it directly or through "
        "srt.layers.attention.mamba.causal_conv1d's non-CUDA fallback",
        alternates=(f"{_MAMBA_PKG}.causal_conv1d_triton.causal_conv1d_update",),
    ),
)
