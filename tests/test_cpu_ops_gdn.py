"""Proof that the gated-delta-net CPU stand-ins (``conformance.sglang_plugins.cpu.gdn_ops``)
compute what SGLang expects of sgl-kernel's CPU ops.

The references below are written here, independently: a float64 token-by-token recurrence
and a float64 causal conv written as an explicit sum.  Layout facts the tests pin down:
a state-pool slot holds ``S`` as ``[HV, V, K]`` (the reference's ``M = S^T`` is
``[HV, K, V]``); a conv slot holds the last ``width - 1`` inputs as ``[dim, width - 1]``.

Tolerances: the stand-ins compute in float64 and return float32, the references are float64;
outputs and states of O(1) magnitude are compared with ``rtol = atol = 1e-4`` (``EXACT``
where the stand-in's own rounding is the point).  Comparisons of two
float32 runs of the same arithmetic in a different grouping use ``1e-5``; slots that must
not be touched are compared bit for bit.
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.sglang_plugins.cpu import gdn_ops
from conformance.sglang_plugins.cpu.spec import Binding, TorchOp

HK, HV, DK, DV = 2, 4, 16, 16  # tiny-qwen3-next's linear-attention shape
W, DIM = 4, 24  # conv width, conv channels
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 stand-in vs float64 reference
SAME = dict(rtol=1e-5, atol=1e-5)  # float32 vs float32, different grouping
CHUNK = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add contention on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------- references (float64)


def ref_gdn(q, k, v, g, beta, M0, l2norm=True):
    """One sequence, token by token.  q, k [L, HK, DK]; v [L, HV, DV]; g, beta [L, HV];
    M0 [HV, DK, DV].  Returns outputs [L, HV, DV] and the states after 0..L tokens."""
    q, k, v, g, beta, M = (x.double() for x in (q, k, v, g, beta, M0))
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    group = v.shape[1] // q.shape[1]
    outs, states = [], [M.clone()]
    for t in range(q.shape[0]):
        kt = k[t].repeat_interleave(group, 0)  # [HV, DK]
        qt = q[t].repeat_interleave(group, 0) / DK**0.5
        M = M * torch.exp(g[t])[:, None, None]
        pred = torch.einsum("hk,hkv->hv", kt, M)
        u = beta[t][:, None] * (v[t] - pred)
        M = M + kt[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", qt, M))
        states.append(M.clone())
    empty = torch.zeros(0, v.shape[1], v.shape[2], dtype=torch.float64)
    return (torch.stack(outs) if outs else empty), states


def ref_conv(x, weight, bias, init, silu):
    """x [dim, L], init [dim, W-1] -> out [dim, L], last W-1 inputs [dim, W-1] (float64)."""
    full = torch.cat([init.double(), x.double()], dim=-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[-1]):
        for j in range(weight.shape[-1]):
            out[:, t] += weight[:, j].double() * full[:, t + j]
    if bias is not None:
        out += bias.double()[:, None]
    if silu:
        out = out * torch.sigmoid(out)
    return out, full[:, full.shape[-1] - (weight.shape[-1] - 1) :]


def pool_of(M):
    """Reference state [HV, DK, DV] -> pool slot layout [HV, DV, DK]."""
    return M.transpose(-1, -2)


def gdn_inputs(T, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, HK, DK, generator=gen)
    k = torch.randn(1, T, HK, DK, generator=gen)
    v = torch.randn(1, T, HV, DV, generator=gen)
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)) * 0.2  # decay in (0.6, 1]
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen))
    return q, k, v, g, beta


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# ----------------------------------------------------------------- chunked gated delta rule


@settings(max_examples=12)
@given(
    lens=st.lists(st.sampled_from([1, 5, 63, 64, 65, 100, 128, 129, 200]), min_size=1, max_size=3),
    with_init=st.lists(st.booleans(), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_chunked_prefill_matches_token_recurrence(lens, with_init, seed):
    """Varlen prefill == float64 recurrence per sequence: outputs, final states written in
    place at their slots, other slots bit-identical, and h == the state before every chunk."""
    N = len(lens)
    q, k, v, g, beta = gdn_inputs(sum(lens), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randn(2 * N + 2, HV, DV, DK, generator=gen) * 0.5
    slots = torch.randperm(2 * N + 2, generator=gen)[:N].to(torch.int32)
    for i in range(N):
        if not with_init[i]:
            pool[slots[i]] = 0.0  # SGLang hands a fresh request a zeroed slot
    before = pool.clone()
    cu = cu_of(lens)

    o, final, h = gdn_ops.chunk_gated_delta_rule_cpu(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
        head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=slots,
    )
    assert o.shape == (1, sum(lens), HV, DV) and o.dtype == q.dtype
    n_chunks = [(n + CHUNK - 1) // CHUNK for n in lens]
    assert h.shape == (1, sum(n_chunks), HV, DV, DK)

    offset = 0
    for i, n in enumerate(lens):
        s, e = int(cu[i]), int(cu[i + 1])
        M0 = before[slots[i]].transpose(-1, -2)
        out_ref, states = ref_gdn(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], M0)
        torch.testing.assert_close(o[0, s:e].double(), out_ref, **TOL)
        torch.testing.assert_close(pool[slots[i]].double(), pool_of(states[-1]), **TOL)
        torch.testing.assert_close(final[i].double(), pool_of(states[-1]), **TOL)
        for c in range(n_chunks[i]):
            torch.testing.assert_close(h[0, offset + c].double(), pool_of(states[c * CHUNK]), **TOL)
        offset += n_chunks[i]
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_a_long_prefill_under_strong_decay_stays_exact():
    """Strong gating (log decay down to -100 a token) makes the chunk's cumulative decay large,
    and ``G_i - G_j`` cancels: a float32 chunked prefill of 712 tokens is 2.6e-5 off the
    recurrence (relative), which the twin's layers amplified to a 7.5e-4 log-prob gap
    between a cached and a cold answer.  The stand-in computes in float64, so only the cast of
    its float32 output remains."""
    T = 712
    q, k, v, _, beta = gdn_inputs(T, seed=7)
    g = -torch.rand(1, T, HV, generator=torch.Generator().manual_seed(8)) * 100
    pool = torch.zeros(1, HV, DV, DK)
    o, final, h = gdn_ops.chunk_gated_delta_rule_cpu(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu_of([T]),
        head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=torch.tensor([0], dtype=torch.int32),
    )
    assert o.dtype == final.dtype == h.dtype == torch.float32  # computed in float64, returned as the kernel returns
    out_ref, states = ref_gdn(q[0], k[0], v[0], g[0], beta[0], torch.zeros(HV, DK, DV))
    scale = float(out_ref.abs().max())
    torch.testing.assert_close(o[0].double(), out_ref, rtol=1e-6, atol=1e-6 * scale)
    torch.testing.assert_close(pool[0].double(), pool_of(states[-1]), rtol=1e-6, atol=1e-6)


def test_h_feeds_sglang_tracking_of_prefixes_ending_inside_a_chunk():
    """Reproduces SGLang 0.5.23's extend tracking for unaligned prefixes
    (``build_prefill_track_plan`` + ``_track_mamba_state_extend``): source row
    ``sum_{j<i} ceil(len_j/64) + (track_len - prefix_len) // 64`` of ``h.squeeze(0)``
    must be the state after the last whole chunk of the tracked part."""
    prefix = [0, 70, 0]
    extend = [150, 100, 64 * 3 + 7]
    track_len = [prefix[0] + 130, prefix[1] + 100, prefix[2] + 64 * 3 + 7]  # none 64-aligned
    q, k, v, g, beta = gdn_inputs(sum(extend), 7)
    pool = torch.zeros(8, HV, DV, DK)
    pool[5] = torch.randn(HV, DV, DK) * 0.3  # request 1 resumes from a cached prefix
    slots = torch.tensor([2, 5, 6], dtype=torch.int32)
    start_state = pool.clone()
    cu = cu_of(extend)
    _, _, h = gdn_ops.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, pool, cu, False, True, slots
    )
    offsets = [0]
    for n in extend:
        offsets.append(offsets[-1] + (n + CHUNK - 1) // CHUNK)
    src = [offsets[i] + (track_len[i] - prefix[i]) // CHUNK for i in range(3)]
    track_dst = torch.tensor([1, 3, 7])
    pool[track_dst] = h.squeeze(0)[torch.tensor(src)].to(pool.dtype)  # SGLang's copy
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        _, states = ref_gdn(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e],
                            start_state[slots[i]].transpose(-1, -2))
        done = (track_len[i] - prefix[i]) // CHUNK * CHUNK
        torch.testing.assert_close(pool[track_dst[i]].double(), pool_of(states[done]), **TOL)


def test_varlen_batch_equals_one_sequence_at_a_time_and_resuming_equals_one_call():
    lens = [77, 3, 140]
    q, k, v, g, beta = gdn_inputs(sum(lens), 11)
    pool = torch.randn(6, HV, DV, DK) * 0.3
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    batch_pool = pool.clone()
    o_batch, _, h_batch = gdn_ops.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, batch_pool, cu_of(lens), False, True, slots
    )
    single_pool = pool.clone()
    outs, hs, s = [], [], 0
    for n, slot in zip(lens, slots.tolist()):
        o_i, _, h_i = gdn_ops.chunk_gated_delta_rule_cpu(
            q[:, s : s + n], k[:, s : s + n], v[:, s : s + n], g[:, s : s + n], beta[:, s : s + n],
            single_pool, cu_of([n]), False, True, torch.tensor([slot], dtype=torch.int32),
        )
        outs.append(o_i)
        hs.append(h_i)
        s += n
    torch.testing.assert_close(o_batch, torch.cat(outs, dim=1), **SAME)
    torch.testing.assert_close(h_batch, torch.cat(hs, dim=1), **SAME)
    torch.testing.assert_close(batch_pool, single_pool, **SAME)

    # a 140-token prefill split 100 + 40 (chunked prefill / cached prefix) == one call
    n, cut = 140, 100
    t0 = sum(lens[:2])
    whole_pool, split_pool = pool.clone(), pool.clone()
    one = torch.tensor([1], dtype=torch.int32)
    sl = slice(t0, t0 + n)
    o_whole, _, _ = gdn_ops.chunk_gated_delta_rule_cpu(
        q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], whole_pool, cu_of([n]), False, True, one
    )
    parts = []
    for a, b in ((t0, t0 + cut), (t0 + cut, t0 + n)):
        o_p, _, _ = gdn_ops.chunk_gated_delta_rule_cpu(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], split_pool, cu_of([b - a]), False, True, one
        )
        parts.append(o_p)
    torch.testing.assert_close(torch.cat(parts, dim=1), o_whole, **SAME)
    torch.testing.assert_close(split_pool[1], whole_pool[1], **SAME)


def test_pad_slot_starts_from_zero_and_writes_nothing():
    lens = [20, 20]
    q, k, v, g, beta = gdn_inputs(40, 3)
    pool = torch.randn(3, HV, DV, DK)
    before = pool.clone()
    slots = torch.tensor([-1, 2], dtype=torch.int32)
    o, _, _ = gdn_ops.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, cu_of(lens), False, True, slots)
    out_ref, _ = ref_gdn(q[0, :20], k[0, :20], v[0, :20], g[0, :20], beta[0, :20], torch.zeros(HV, DK, DV))
    torch.testing.assert_close(o[0, :20].double(), out_ref, **TOL)
    assert torch.equal(pool[:2], before[:2])
    assert not torch.equal(pool[2], before[2])


def test_prefill_of_1000_tokens_is_fast():
    """Chunked, not token by token: 1000 tokens, 4 heads of 16 in well under a second
    (about 0.03 s single-threaded when measured)."""
    q, k, v, g, beta = gdn_inputs(1000, 5)
    pool = torch.zeros(2, HV, DV, DK)
    one = torch.tensor([1], dtype=torch.int32)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        gdn_ops.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, cu_of([1000]), False, True, one)
        best = min(best, time.perf_counter() - t)
    assert best < 1.0, f"1000-token prefill took {best:.2f} s"


# ------------------------------------------------------------------------ decode and gating


def test_decode_steps_continue_the_prefill_recurrence_in_place():
    """Prefill 70 tokens of two requests, then 3 decode steps through the decode op with raw
    gates (a, b): every output and the slot state match the float64 recurrence of the whole
    sequence; the other slots are bit-identical."""
    gen = torch.Generator().manual_seed(21)
    A_log = torch.rand(HV, generator=gen).log()
    dt_bias = torch.randn(HV, generator=gen)
    steps, pre = 3, 70
    T = pre + steps
    q = torch.randn(2, T, HK, DK, generator=gen)
    k = torch.randn(2, T, HK, DK, generator=gen)
    v = torch.randn(2, T, HV, DV, generator=gen)
    a = torch.randn(2, T, HV, generator=gen) * 3
    a[0, pre] = 30.0  # softplus threshold region (linear)
    b = torch.randn(2, T, HV, generator=gen)
    pool = torch.randn(5, HV, DV, DK, generator=gen)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    pool[slots.long()] = 0.0
    before = pool.clone()

    def flat(x):  # the two requests' prefill tokens, packed as SGLang packs them
        return x[:, :pre].reshape(1, 2 * pre, *x.shape[2:])

    g, beta = gdn_ops.fused_gdn_gating_op(A_log, flat(a)[0], flat(b)[0], dt_bias)
    gdn_ops.chunk_gated_delta_rule_cpu(
        flat(q), flat(k), flat(v), g, beta, pool, cu_of([pre, pre]), False, True, slots
    )
    outs = []
    for t in range(pre, T):
        o = gdn_ops.fused_sigmoid_gating_delta_rule_update_op(
            A_log=A_log, dt_bias=dt_bias, q=q[:, t][None], k=k[:, t][None], v=v[:, t][None],
            a=a[:, t], b=b[:, t], initial_state_source=pool, initial_state_indices=slots,
            cu_seqlens=torch.arange(3, dtype=torch.int32), use_qk_l2norm_in_kernel=True,
            softplus_beta=1.0, softplus_threshold=20.0,
        )
        assert o.shape == (2, 1, HV, DV)
        outs.append(o[:, 0])
    for r in range(2):
        g_ref = -torch.exp(A_log.double()) * torch.where(
            a[r].double() + dt_bias.double() > 20, a[r].double() + dt_bias.double(),
            torch.log1p(torch.exp(a[r].double() + dt_bias.double())),
        )
        out_ref, states = ref_gdn(q[r], k[r], v[r], g_ref, torch.sigmoid(b[r].double()), torch.zeros(HV, DK, DV))
        for s in range(steps):
            torch.testing.assert_close(outs[s][r].double(), out_ref[pre + s], **TOL)
        torch.testing.assert_close(pool[slots[r]].double(), pool_of(states[-1]), **TOL)
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])


def test_gdn_gating_matches_formula():
    gen = torch.Generator().manual_seed(4)
    A_log = torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, generator=gen)
    a = torch.randn(9, HV, generator=gen) * 10  # spans both sides of the threshold (20)
    a[0] = 25.0
    b = torch.randn(9, HV, generator=gen) * 4
    g, beta = gdn_ops.fused_gdn_gating_op(A_log, a, b, dt_bias)
    x = a.double() + dt_bias.double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert g.shape == beta.shape == (1, 9, HV) and g.dtype == torch.float32
    torch.testing.assert_close(g[0].double(), -torch.exp(A_log.double()) * softplus, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta[0].double(), 1 / (1 + torch.exp(-b.double())), rtol=1e-6, atol=1e-6)
    bf = gdn_ops.fused_gdn_gating_op(A_log, a.bfloat16(), b.bfloat16(), dt_bias.bfloat16())
    assert bf[0].dtype == torch.float32 and bf[1].dtype == torch.bfloat16


def test_rmsnorm_gated_matches_formula():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, DV, generator=gen) * 3
    z = torch.randn(7, DV, generator=gen)
    w = torch.rand(DV, generator=gen) + 0.5
    out = gdn_ops.fused_rmsnorm_gated_op(x, w, z, 1e-6)
    xd = x.double()
    ref = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6) * w.double() * z.double() * torch.sigmoid(z.double())
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ causal conv


@settings(max_examples=10)
@given(
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    init=st.lists(st.booleans(), min_size=3, max_size=3),
    silu=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conv_prefill_matches_formula_and_token_by_token_update(lens, init, silu, with_bias, seed):
    """Prefill conv (x as SGLang passes it: ``mixed_qkv.transpose(0, 1)``) == float64 sum;
    conv slots end with the last W-1 inputs (old state kept when len < W-1); same outputs
    and states as feeding the tokens one at a time through the update op."""
    gen = torch.Generator().manual_seed(seed)
    N, T = len(lens), sum(lens)
    mixed = torch.randn(T, DIM, generator=gen)
    weight = torch.randn(DIM, W, generator=gen)
    bias = torch.randn(DIM, generator=gen) if with_bias else None
    states = torch.randn(2 * N + 1, DIM, W - 1, generator=gen)
    slots = torch.randperm(2 * N + 1, generator=gen)[:N].to(torch.int32)
    has_init = torch.tensor(init[:N])
    before = states.clone()
    cu = cu_of(lens)

    out = gdn_ops.causal_conv1d_fn_cpu(
        mixed.transpose(0, 1), weight, bias, activation="silu" if silu else None, conv_states=states,
        has_initial_state=has_init, cache_indices=slots, query_start_loc=cu, seq_lens_cpu=lens,
    ).transpose(0, 1)
    assert out.shape == mixed.shape

    stepped = before.clone()
    for i in range(N):
        s, e = int(cu[i]), int(cu[i + 1])
        start = before[slots[i]] if init[i] else torch.zeros(DIM, W - 1)
        ref_out, ref_state = ref_conv(mixed[s:e].T, weight, bias, start, silu)
        torch.testing.assert_close(out[s:e].double(), ref_out.T, **TOL)
        torch.testing.assert_close(states[slots[i]].double(), ref_state, **TOL)
        # the decode op, token by token, from the same starting window
        stepped[slots[i]] = start
        for t in range(s, e):
            y = gdn_ops.causal_conv1d_update_cpu(
                mixed[t : t + 1], stepped, weight, bias, "silu" if silu else None,
                conv_state_indices=slots[i : i + 1],
            )
            torch.testing.assert_close(y[0], out[t], **SAME)
        torch.testing.assert_close(stepped[slots[i]], states[slots[i]], **SAME)
    untouched = torch.ones(states.shape[0], dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(states[untouched], before[untouched])


def test_conv_update_batch_in_place_on_a_strided_pool_and_pad_slot():
    """Decode conv for a batch, on a dim-contiguous pool view (the AMX layout, same logical
    [slot, dim, W-1]); pad slot -1 is neither read nor written."""
    gen = torch.Generator().manual_seed(9)
    store = torch.randn(5, W - 1, DIM, generator=gen)
    states = store.transpose(1, 2)  # logical [5, DIM, W-1], stride 1 along dim
    before = states.clone()
    x = torch.randn(3, DIM, generator=gen)
    weight = torch.randn(DIM, W, generator=gen)
    slots = torch.tensor([4, -1, 0], dtype=torch.int32)
    y = gdn_ops.causal_conv1d_update_op(x, states, weight, None, False, None, slots, -1, True)
    for r, slot in ((0, 4), (2, 0)):
        ref_out, ref_state = ref_conv(x[r][:, None], weight, None, before[slot], False)
        torch.testing.assert_close(y[r].double(), ref_out[:, 0], **TOL)
        torch.testing.assert_close(states[slot].double(), ref_state, **TOL)
    assert torch.equal(states[[1, 2, 3]], before[[1, 2, 3]])
    assert torch.equal(y[1], torch.zeros(DIM))


def test_spec_verify_conv_is_refused_loudly():
    with pytest.raises(NotImplementedError, match="intermediate_conv_window"):
        gdn_ops.causal_conv1d_update_cpu(
            torch.zeros(1, DIM, 2), torch.zeros(2, DIM, W - 1), torch.zeros(DIM, W), None, "silu",
            torch.tensor([0]), intermediate_conv_window=torch.zeros(2, 2, DIM, W - 1),
        )


# ------------------------------------------------------------------- declarations / schemas


@pytest.fixture(scope="module")
def test_ns():
    """Every declared schema, defined and implemented in a private namespace."""
    lib = torch.library.Library("hc_test_gdn", "FRAGMENT")
    for op in gdn_ops.TORCH_OPS:
        lib.define(op.schema)
        lib.impl(op.name, op.impl, "CPU")
    yield torch.ops.hc_test_gdn
    del lib


def test_declarations():
    names = {op.name for op in gdn_ops.TORCH_OPS}
    assert names == {
        "causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu",
        "fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu", "fused_rmsnorm_gated_cpu",
    }
    assert all(isinstance(op, TorchOp) and op.schema.startswith(op.name + "(") for op in gdn_ops.TORCH_OPS)
    assert {b.target for b in gdn_ops.BINDINGS} == {
        "sgl_kernel.mamba.causal_conv1d_fn_cpu", "sgl_kernel.mamba.causal_conv1d_update_cpu",
        "sgl_kernel.mamba.chunk_gated_delta_rule_cpu",
    }
    assert all(isinstance(b, Binding) and b.how == "standin" for b in gdn_ops.BINDINGS)


def test_schema_argument_names_match_the_impls(test_ns):
    for op in gdn_ops.TORCH_OPS:
        schema = getattr(test_ns, op.name).default._schema
        params = list(inspect.signature(op.impl).parameters)
        assert [a.name for a in schema.arguments] == params, op.name


def test_every_op_runs_through_the_dispatcher(test_ns):
    gen = torch.Generator().manual_seed(13)
    # conv prefill + decode, positional as the sgl_kernel.mamba wrappers call them
    x = torch.randn(DIM, 9, generator=gen)
    weight = torch.randn(DIM, W, generator=gen)
    bias = torch.randn(DIM, generator=gen)
    s1, s2 = torch.zeros(3, DIM, W - 1), torch.zeros(3, DIM, W - 1)
    args = (torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32),
            torch.tensor([False, False]), True, -1, True)
    torch.testing.assert_close(
        test_ns.causal_conv1d_fwd_cpu(x, weight, bias, s1, *args),
        gdn_ops.causal_conv1d_fwd_op(x, weight, bias, s2, *args),
    )
    assert torch.equal(s1, s2) and s1.abs().sum() > 0
    xt = torch.randn(2, DIM, generator=gen)
    idx = torch.tensor([1, 2], dtype=torch.int32)
    torch.testing.assert_close(
        test_ns.causal_conv1d_update_cpu(xt, s1, weight, bias, True, None, idx, -1, True),
        gdn_ops.causal_conv1d_update_op(xt, s2, weight, bias, True, None, idx, -1, True),
    )
    assert torch.equal(s1, s2)

    # chunked prefill (positional, as the sgl_kernel.mamba wrapper calls it)
    q, k, v, g, beta = gdn_inputs(70, 17)
    p1 = torch.randn(3, HV, DV, DK)
    p2 = p1.clone()
    cu, slots = cu_of([30, 40]), torch.tensor([2, 0], dtype=torch.int32)
    o1, f1 = test_ns.chunk_gated_delta_rule_cpu(q, k, v, g, beta, p1, True, cu, False, True, slots)
    o2, f2 = gdn_ops.chunk_gated_delta_rule_op(q, k, v, g, beta, p2, True, cu, False, True, slots)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(f1, f2)
    assert torch.equal(p1, p2) and f1.shape == (2, HV, DV, DK)

    # gating, decode and norm with the keywords SGLang uses
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    a, b = torch.randn(2, HV, generator=gen), torch.randn(2, HV, generator=gen)
    for got, want in zip(test_ns.fused_gdn_gating_cpu(A_log, a, b, dt_bias),
                         gdn_ops.fused_gdn_gating_op(A_log, a, b, dt_bias)):
        torch.testing.assert_close(got, want)
    kw = dict(A_log=A_log, dt_bias=dt_bias, q=q[:, :2], k=k[:, :2], v=v[:, :2], a=a, b=b,
              initial_state_indices=slots, cu_seqlens=torch.arange(3, dtype=torch.int32),
              use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    torch.testing.assert_close(
        test_ns.fused_sigmoid_gating_delta_rule_update_cpu(initial_state_source=p1, **kw),
        gdn_ops.fused_sigmoid_gating_delta_rule_update_op(initial_state_source=p2, **kw),
    )
    assert torch.equal(p1, p2)
    z = torch.randn(4, DV, generator=gen)
    xs = torch.randn(4, DV, generator=gen)
    w = torch.rand(DV, generator=gen)
    torch.testing.assert_close(
        test_ns.fused_rmsnorm_gated_cpu(xs, w, z, 1e-6), gdn_ops.fused_rmsnorm_gated_op(xs, w, z, 1e-6)
    )
