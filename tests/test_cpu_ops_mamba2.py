"""Proof for the Mamba2 CPU stand-ins (``conformance.sglang_plugins.cpu.mamba2_ops``).

The reference is a plain float64 token-by-token Mamba2 recurrence and an explicit causal
conv, written here independently of the stand-ins.  Tolerances, relative to the largest
reference value (floor 1): float64 inputs agree to 1e-9; float32 inputs to 2e-4 where a
float32 result is compared (states stored as float32), and to 2e-7 for the output of a scan,
which computes in float64 whatever its inputs; float32 conv to 1e-5 and
single float32 decode steps to 1e-5; SGLang's gated norm to 1e-6 (it takes silu in float32).

SGLang itself is not imported (that needs the whole server stack); where the test checks
SGLang facts (signatures, call sites, the prefill track plan, the gated norm's CPU path)
it reads or loads single files of the installed SGLang, and skips without it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conformance.sglang_plugins.cpu import mamba2_ops as ops
from conformance.sglang_plugins.cpu.spec import Binding

TOL64 = 1e-9
TOL32 = 2e-4


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The tensors here are tiny; on the shared 2-core machine, intra-op threads only add
    contention (a 10x slowdown under load), so every test runs single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    actual = actual.to(torch.float64)
    expected = expected.to(torch.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} > {tol:.1e} * {scale:.3g}"


# ------------------------------------------------------------------ float64 reference


def ref_dt(dt_raw, dt_bias, softplus, clamp=True):  # noqa: ANN001, ANN201
    """dt + bias, softplus (identity above 20), then the scan's dt_limit (0, inf); the decode
    step has no limit (clamp=False)."""
    v = dt_raw.double() + (0 if dt_bias is None else dt_bias.double())
    if softplus:
        v = torch.where(v > 20, v, torch.log1p(torch.exp(v)))
    return v.clamp(min=0.0) if clamp else v


def ref_sequence(x, dt, A, B, C, D=None, z=None, init=None):  # noqa: ANN001, ANN201
    """One sequence, token by token. x (n,H,P); dt (n,H) processed; A (H,); B, C (n,G,N).

    Returns y (n,H,P) and states (n+1,H,P,N), states[k] = state after k tokens."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    n, H, P = x.shape
    G, N = B.shape[1:]
    head_group = [h // (H // G) for h in range(H)]
    Bh, Ch = B[:, head_group], C[:, head_group]  # (n, H, N): each head reads its group
    state = torch.zeros(H, P, N, dtype=torch.float64) if init is None else init.double().clone()
    states = [state.clone()]
    ys = []
    for t in range(n):
        decay = torch.exp(dt[t] * A)  # (H,)
        state = decay[:, None, None] * state + dt[t][:, None, None] * x[t][:, :, None] * Bh[t][:, None, :]
        y = (state * Ch[t][:, None, :]).sum(-1)
        if D is not None:
            Dd = D.double()
            y = y + x[t] * (Dd[:, None] if Dd.dim() == 1 else Dd)
        if z is not None:
            zz = z[t].double()
            y = y * zz * torch.sigmoid(zz)
        ys.append(y)
        states.append(state.clone())
    return torch.stack(ys) if ys else torch.zeros(0, H, P, dtype=torch.float64), torch.stack(states)


def ref_conv(prior, xs, weight, bias, silu=True):  # noqa: ANN001, ANN201
    """prior (dim, W-1), xs (dim, n): explicit depthwise causal conv; returns out (dim, n), new state."""
    ext = torch.cat([prior.double(), xs.double()], dim=1)
    W = weight.shape[1]
    out = torch.zeros(xs.shape, dtype=torch.float64)
    for k in range(xs.shape[1]):
        acc = torch.zeros(xs.shape[0], dtype=torch.float64) if bias is None else bias.double().clone()
        for j in range(W):
            acc = acc + weight[:, j].double() * ext[:, k + j]
        out[:, k] = acc * torch.sigmoid(acc) if silu else acc
    return out, ext[:, -(W - 1):]


# -------------------------------------------------------------------------- fixtures


def make_problem(L, H=4, G=2, P=8, N=16, dtype=torch.float64, seed=0, nseq=None, with_z=False, d2=False):  # noqa: ANN001, ANN201
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):  # noqa: ANN002, ANN202
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    p = types.SimpleNamespace()
    p.x = r(1, L, H, P)
    p.dt = r(1, L, H, scale=0.5) - 1.0
    p.dt_bias = r(H, scale=0.3)
    p.A = -torch.exp(r(H, scale=0.5))
    p.B = r(1, L, G, N, scale=0.5)
    p.C = r(1, L, G, N, scale=0.5)
    p.D = r(H, P) if d2 else r(H)
    p.z = r(1, L, H, P) if with_z else None
    p.init = r(nseq or 1, H, P, N)
    return p


def packed(lens):  # noqa: ANN001, ANN201
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens)).unsqueeze(0)
    return torch.tensor(cu, dtype=torch.int32), seq_idx


def logical_chunks(cu, cs):  # noqa: ANN001, ANN201
    """chunk_indices / chunk_offsets as SGLang's metadata defines them (one logical chunk per
    (sequence, physical chunk) piece); the stand-in accepts them and does not need them."""
    idx, off = [], []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        p = s
        while p < e:
            idx.append(p // cs)
            off.append(p % cs)
            p = (p // cs + 1) * cs
    return torch.tensor(idx, dtype=torch.int32), torch.tensor(off, dtype=torch.int32)


def run_scan(p, cs, cu=None, seq_idx=None, init=None, track=None, dtype=None):  # noqa: ANN001, ANN201
    L = p.x.shape[1]
    out = torch.full_like(p.x, float("nan"))
    ci, co = logical_chunks(cu, cs) if cu is not None else (None, None)
    res = ops.mamba_chunk_scan_combined(
        p.x, p.dt, p.A, p.B, p.C,
        chunk_size=cs, D=p.D, z=p.z, dt_bias=p.dt_bias,
        seq_idx=seq_idx if seq_idx is not None else torch.zeros(1, L, dtype=torch.int32),
        chunk_indices=ci, chunk_offsets=co,
        cu_seqlens=cu if cu is not None else torch.tensor([0, L], dtype=torch.int32),
        initial_states=init,
        return_varlen_states=True, return_final_states=False, return_track_states=True,
        track_seq_idx=None if track is None else torch.tensor([s for s, _ in track]),
        track_end_locs=None if track is None else torch.tensor([e for _, e in track]),
        dt_softplus=True, dt_limit=(0.0, float("inf")),
        out=out, state_dtype=dtype,
    )
    h, varlen, tracked = res
    return out, h, varlen, tracked


# ----------------------------------------------------------------------- chunked scan


@pytest.mark.parametrize(
    "with_init,with_z,d2,cs",
    [(False, False, False, 64), (True, True, True, 64), (True, False, False, 128)],
)
def test_scan_single_sequence_equals_recurrence(with_init, with_z, d2, cs):
    L = 300  # not a multiple of the chunk
    p = make_problem(L, with_z=with_z, d2=d2, seed=1)
    init = p.init if with_init else None
    out, h, varlen, tracked = run_scan(p, cs, init=init)
    dt = ref_dt(p.dt[0], p.dt_bias, True)
    y, states = ref_sequence(p.x[0], dt, p.A, p.B[0], p.C[0], p.D, None if p.z is None else p.z[0], None if init is None else init[0])
    assert_close(out[0], y, TOL64, "y")
    nchunks = math.ceil(L / cs)
    assert h.shape == (1, nchunks, 4, 8, 16)
    for c in range(nchunks):
        assert_close(h[0, c], states[c * cs], TOL64, f"h[{c}] = state at token {c * cs}")
    assert_close(varlen[0], states[L], TOL64, "final state")
    assert tracked is None


def test_scan_float32_vs_float64_recurrence():
    L, cs = 520, 128
    p = make_problem(L, dtype=torch.float32, seed=2, with_z=True)
    out, h, varlen, _ = run_scan(p, cs, init=p.init, dtype=torch.float32)
    assert out.dtype == torch.float32 and h.dtype == torch.float32 and varlen.dtype == torch.float32
    dt = ref_dt(p.dt[0], p.dt_bias, True)
    y, states = ref_sequence(p.x[0], dt, p.A, p.B[0], p.C[0], p.D, p.z[0], p.init[0])
    assert_close(out[0], y, TOL32, "y fp32")
    for c in range(h.shape[1]):
        assert_close(h[0, c], states[c * cs], TOL32, f"h[{c}] fp32")
    assert_close(varlen[0], states[L], TOL32, "final fp32")


def test_scan_of_float32_inputs_computes_in_float64():
    """The scan computes in float64 whatever its inputs, as the gated delta rule's stand-ins do:
    only the cast of the float32 output remains (3e-8 of the largest value here; a float32
    scan was 1.1e-6 off)."""
    L, cs = 520, 128
    p = make_problem(L, dtype=torch.float32, seed=3)
    out, h, varlen, _ = run_scan(p, cs, init=p.init, dtype=torch.float32)
    dt = ref_dt(p.dt[0], p.dt_bias, True)
    y, states = ref_sequence(p.x[0], dt, p.A, p.B[0], p.C[0], p.D, None, p.init[0])
    assert_close(out[0], y, 2e-7, "y from float32 inputs")


LENS = [37, 27, 130, 200, 90, 1, 64]  # starts 0,37,64,194,394,484,485: one on the 32-grid, the rest off it


def _packed_reference(p, lens, has_init):  # noqa: ANN001, ANN202
    cu, _ = packed(lens)
    dt = ref_dt(p.dt[0], p.dt_bias, True)
    ys, sts = [], []
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y, st = ref_sequence(
            p.x[0, s:e], dt[s:e], p.A, p.B[0, s:e], p.C[0, s:e], p.D,
            None if p.z is None else p.z[0, s:e], p.init[i] if has_init[i] else None,
        )
        ys.append(y)
        sts.append(st)
    return torch.cat(ys), sts


def test_varlen_packed_batch_equals_one_sequence_at_a_time():
    cs = 32
    lens = LENS
    has_init = [True, False, True, True, False, True, False]
    p = make_problem(sum(lens), nseq=len(lens), seed=3, with_z=True)
    cu, seq_idx = packed(lens)
    init = torch.where(torch.tensor(has_init)[:, None, None, None], p.init, 0.0)  # as mamba.py builds it
    out, h, varlen, _ = run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=init)
    y_ref, sts = _packed_reference(p, lens, has_init)
    assert_close(out[0], y_ref, TOL64, "packed y")
    for i, st in enumerate(sts):
        assert_close(varlen[i], st[-1], TOL64, f"final state of seq {i}")
    # h[c]: the state at flat position c*cs of the sequence that owns token c*cs - 1
    sid = seq_idx[0].tolist()
    starts = cu.tolist()
    assert_close(h[0, 0], init[0], TOL64, "h[0] = first sequence's initial state")
    for c in range(1, h.shape[1]):
        s = sid[c * cs - 1]
        assert_close(h[0, c], sts[s][c * cs - starts[s]], TOL64, f"h[{c}] (seq {s})")
    # one sequence at a time through the same op gives the same outputs and final states
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        q = types.SimpleNamespace(
            x=p.x[:, s:e], dt=p.dt[:, s:e], A=p.A, B=p.B[:, s:e], C=p.C[:, s:e], D=p.D,
            z=p.z[:, s:e], dt_bias=p.dt_bias,
        )
        o1, _, v1, _ = run_scan(q, cs, init=init[i : i + 1] if has_init[i] else None)
        assert_close(o1[0], out[0, s:e], TOL64, f"seq {i} alone vs packed")
        assert_close(v1[0], varlen[i], TOL64, f"seq {i} final alone vs packed")


def test_initial_states_are_honoured():
    cs, lens = 16, [12, 20]  # short: the initial state's decay must stay visible at the end
    p = make_problem(sum(lens), nseq=2, seed=4)
    cu, seq_idx = packed(lens)
    out0, _, v0, _ = run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=None)
    out1, _, v1, _ = run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=p.init)
    y0, _ = _packed_reference(p, lens, [False, False])
    y1, _ = _packed_reference(p, lens, [True, True])
    assert_close(out0[0], y0, TOL64, "zero init")
    assert_close(out1[0], y1, TOL64, "given init")
    assert float((out1 - out0).abs().max()) > 1e-3  # the initial state visibly matters
    assert float((v1 - v0).abs().max()) > 1e-4


def test_track_states_equal_recurrence_at_requested_ends():
    cs, lens = 32, LENS
    has_init = [True, True, False, True, True, False, True]
    p = make_problem(sum(lens), nseq=len(lens), seed=5)
    cu, seq_idx = packed(lens)
    init = torch.where(torch.tensor(has_init)[:, None, None, None], p.init, 0.0)
    starts = cu.tolist()
    track = [
        (0, 32),  # on the flat grid
        (1, starts[1] + 20),  # off the grid
        (2, starts[2]),  # empty prefix: the initial state
        (2, starts[2] + 64),  # on the grid, sequence started on the grid
        (3, starts[3] + 150),  # mid chunk, after several chunks
        (4, starts[4] + 90),  # sequence end
        (5, starts[5] + 1),  # single-token sequence
        (1, starts[1] + 1),
    ]
    _, _, _, tracked = run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=init, track=track)
    _, sts = _packed_reference(p, lens, has_init)
    assert tracked.shape == (1, len(track), 4, 8, 16)
    for i, (s, e) in enumerate(track):
        assert_close(tracked[0, i], sts[s][e - starts[s]], TOL64, f"track {i}: seq {s} up to {e}")
    with pytest.raises(ValueError):
        run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=init, track=[(0, 40)])  # past the end of seq 0


def _installed_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _load_file(path: Path, name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sglang_prefill_track_plan_reads_the_right_states():
    """SGLang's own plan (prefill_track_metadata.py, loaded standalone) applied to h /
    track_states / varlen_states as Mamba2AttnBackend._track_mamba_state_extend does."""
    plan_mod = _load_file(_installed_sglang() / "srt/layers/attention/mamba/prefill_track_metadata.py", "_ptm")
    cs = 32
    extend = [100, 64, 70, 96, 40]  # starts 0, 100, 164, 234, 330
    prefix = [0, 32, 0, 64, 0]
    # track lens as the scheduler sets them: seq end (aligned or not), or aligned + 1 (force-h)
    track_lens = [prefix[0] + 100, prefix[1] + 64, prefix[2] + 64 + 1, prefix[3] + 96, -1]
    mask = [True, True, True, True, False]
    expect_tokens = [96, 64, 64, 96, None]  # extend tokens covered by the tracked state
    p = make_problem(sum(extend), nseq=len(extend), seed=6)
    cu, seq_idx = packed(extend)
    has_init = [x > 0 for x in prefix]
    init = torch.where(torch.tensor(has_init)[:, None, None, None], p.init, 0.0)
    plan = plan_mod.build_prefill_track_plan(mask, track_lens, extend, prefix, cs, mamba2=True)
    assert plan.recompute_rows and plan.h_rows and plan.final_rows  # all three sources exercised
    track = list(zip(plan.recompute_rows, plan.recompute_end_locs))
    _, h, varlen, tracked = run_scan(p, cs, cu=cu, seq_idx=seq_idx, init=init, track=track)
    slots = torch.tensor([3, 5, 7, 9, 11])
    dst = torch.tensor([2, 4, 6, 8, 10])
    pool = torch.zeros(12, 4, 8, 16, dtype=torch.float64)
    pool[slots] = varlen  # mamba.py: ssm_state[state_indices] = varlen_state
    pool[dst[plan.h_rows]] = h.squeeze(0)[torch.tensor(plan.h_src)]
    pool[dst[plan.recompute_rows]] = tracked.squeeze(0)
    pool[dst[plan.final_rows]] = pool[slots[plan.final_rows]]
    _, sts = _packed_reference(p, extend, has_init)
    for row, n in enumerate(expect_tokens):
        if n is not None:
            assert_close(pool[dst[row]], sts[row][n], TOL64, f"tracked state of row {row}")
    assert float(pool[10].abs().max()) == 0.0  # untracked row's destination untouched


def test_return_modes_match_sglang_contract():
    p = make_problem(96, seed=7)
    kw = dict(chunk_size=32, D=p.D, dt_bias=p.dt_bias, dt_softplus=True)
    out = torch.empty_like(p.x)
    assert ops.mamba_chunk_scan_combined(p.x, p.dt, p.A, p.B, p.C, out=out, **kw) is None
    fin = ops.mamba_chunk_scan_combined(p.x, p.dt, p.A, p.B, p.C, out=out, return_final_states=True, **kw)
    states = ops.mamba_chunk_scan_combined(p.x, p.dt, p.A, p.B, p.C, out=out, return_intermediate_states=True, **kw)
    dt = ref_dt(p.dt[0], p.dt_bias, True)
    y, st = ref_sequence(p.x[0], dt, p.A, p.B[0], p.C[0], p.D)
    assert fin.shape == (1, 4, 8, 16) and fin.dtype == torch.float32
    assert_close(fin[0], st[-1], 1e-6, "final_states (float32 like the kernel)")
    assert states.shape == (1, 3, 4, 8, 16)
    assert_close(states[0, 2], st[64], TOL64, "intermediate states")
    assert_close(out[0], y, TOL64, "out written in place")


def test_prefill_of_1000_tokens_is_fast():
    lens = [400, 350, 250]
    p = make_problem(sum(lens), H=4, G=1, P=16, N=16, dtype=torch.float32, nseq=3, seed=8)
    cu, seq_idx = packed(lens)
    run_scan(p, 128, cu=cu, seq_idx=seq_idx, init=p.init)  # warm-up
    t0 = time.perf_counter()
    run_scan(p, 128, cu=cu, seq_idx=seq_idx, init=p.init, track=[(0, 256), (1, 400 + 300)])
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"1000-token prefill scan took {elapsed:.2f} s"


# ------------------------------------------------------------------------ causal conv


def _conv_setup(dtype=torch.float64, seed=10):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    dim, W, slots = 24, 4, 9
    lens = [1, 2, 7, 30, 3]
    cache = [5, 2, 7, 0, 3]
    has_init = [True, False, True, False, True]
    x_tm = torch.randn(sum(lens), dim, generator=g, dtype=torch.float64).to(dtype)  # token-major
    weight = torch.randn(dim, W, generator=g, dtype=torch.float64).to(dtype)
    bias = torch.randn(dim, generator=g, dtype=torch.float64).to(dtype)
    states = torch.randn(slots, dim, W - 1, generator=g, dtype=torch.float64).to(dtype)
    return dim, W, lens, cache, has_init, x_tm, weight, bias, states


@pytest.mark.parametrize("flavour", ["srt", "triton"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, TOL64), (torch.float32, 1e-5)])
def test_conv_fwd_varlen_vs_reference_and_states_in_place(flavour, dtype, tol):
    dim, W, lens, cache, has_init, x_tm, weight, bias, states = _conv_setup(dtype)
    cu, _ = packed(lens)
    before = states.clone()
    x = x_tm.t()  # (dim, tokens), a transposed view as mamba.py passes it
    kw = dict(
        activation="silu", conv_states=states, has_initial_state=torch.tensor(has_init),
        cache_indices=torch.tensor(cache, dtype=torch.int32), query_start_loc=cu, seq_lens_cpu=lens,
    )
    fn = ops.causal_conv1d_fn if flavour == "srt" else ops.causal_conv1d_fn_triton
    out = fn(x, weight, bias, **kw)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(x, x_tm.t())  # input untouched
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        prior = before[cache[i]] if has_init[i] else torch.zeros(dim, W - 1, dtype=dtype)
        ref_out, ref_state = ref_conv(prior, x[:, s:e], weight, bias)
        assert_close(out[:, s:e], ref_out, tol, f"conv out seq {i}")
        assert_close(states[cache[i]], ref_state, tol, f"conv state seq {i}")
    untouched = [k for k in range(states.shape[0]) if k not in cache]
    assert torch.equal(states[untouched], before[untouched])


def test_conv_pad_slot_is_skipped():
    dim, W, lens, cache, has_init, x_tm, weight, bias, states = _conv_setup()
    cu, _ = packed(lens)
    before = states.clone()
    cache_pad = list(cache)
    cache_pad[2] = ops.PAD_SLOT_ID
    ops.causal_conv1d_fn_triton(
        x_tm.t(), weight, bias, states, cu, lens,
        cache_indices=torch.tensor(cache_pad), has_initial_state=torch.tensor(has_init), activation="silu",
    )
    assert torch.equal(states[cache[2]], before[cache[2]])  # the padded sequence's would-be slot
    assert not torch.equal(states[cache[0]], before[cache[0]])


@pytest.mark.parametrize("flavour", ["srt", "triton"])
def test_conv_fwd_equals_update_token_by_token(flavour):
    dim, W, lens, cache, has_init, x_tm, weight, bias, states = _conv_setup(seed=11)
    cu, _ = packed(lens)
    fwd_states = states.clone()
    upd_states = states.clone()
    for k, flag in enumerate(has_init):
        if not flag:
            upd_states[cache[k]] = 0.0  # the update op always starts from the stored window
    out = ops.causal_conv1d_fn(
        x_tm.t(), weight, bias, query_start_loc=cu, cache_indices=torch.tensor(cache),
        has_initial_state=torch.tensor(has_init), conv_states=fwd_states, activation="silu",
    )
    upd = ops.causal_conv1d_update if flavour == "srt" else ops.causal_conv1d_update_triton
    starts = cu.tolist()
    for i in range(len(lens)):
        for t in range(lens[i]):
            tok = starts[i] + t
            o = upd(x_tm[tok : tok + 1], upd_states, weight, bias, "silu", conv_state_indices=torch.tensor([cache[i]], dtype=torch.int32))
            assert o.shape == (1, dim)
            assert_close(o[0], out[:, tok], TOL64, f"update token {tok}")
    assert_close(upd_states, fwd_states, TOL64, "conv states after prefill vs token-by-token")


def test_conv_update_batch_slots_pad_and_multi_token():
    g = torch.Generator().manual_seed(12)
    dim, W = 16, 4
    weight = torch.randn(dim, W, generator=g, dtype=torch.float64)
    bias = torch.randn(dim, generator=g, dtype=torch.float64)
    states = torch.randn(6, dim, W - 1, generator=g, dtype=torch.float64)
    before = states.clone()
    x = torch.randn(3, dim, generator=g, dtype=torch.float64)
    idx = torch.tensor([4, ops.PAD_SLOT_ID, 1], dtype=torch.int32)
    out = ops.causal_conv1d_update_triton(x, states, weight, bias, True, conv_state_indices=idx)
    for b, slot in ((0, 4), (2, 1)):
        ref_out, ref_state = ref_conv(before[slot], x[b : b + 1].t(), weight, bias)
        assert_close(out[b], ref_out[:, 0], TOL64, f"row {b}")
        assert_close(states[slot], ref_state, TOL64, f"slot {slot}")
    for slot in (0, 2, 3, 5):
        assert torch.equal(states[slot], before[slot])
    assert torch.isfinite(out[1]).all()
    # (batch, dim, T): T tokens at once == T single-token updates
    xs = torch.randn(2, dim, 5, generator=g, dtype=torch.float64)
    a, b = before.clone(), before.clone()
    idx2 = torch.tensor([3, 0])
    multi = ops.causal_conv1d_update(xs, a, weight, bias, "silu", conv_state_indices=idx2)
    singles = torch.stack([ops.causal_conv1d_update(xs[:, :, t], b, weight, bias, "silu", conv_state_indices=idx2) for t in range(5)], dim=-1)
    assert_close(multi, singles, TOL64, "multi-token update")
    assert_close(a, b, TOL64, "state after multi-token update")
    with pytest.raises(NotImplementedError):
        ops.causal_conv1d_update_triton(x, states, weight, bias, True, conv_state_indices=idx, intermediate_conv_window=states)


# -------------------------------------------------------------- selective state update


@pytest.mark.parametrize(
    "softplus,use_bias,use_D,use_z",
    [(True, True, True, False), (False, False, False, False), (True, False, True, True), (False, True, False, True)],
)
def test_selective_state_update_is_one_recurrence_step(softplus, use_bias, use_D, use_z):
    g = torch.Generator().manual_seed(20)
    H, G, P, N, slots = 4, 2, 8, 16, 7
    batch = 3

    def r(*s, scale=1.0):  # noqa: ANN002, ANN202
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    pool = r(slots, H, P, N)
    before = pool.clone()
    idx = torch.tensor([5, 1, 3], dtype=torch.int32)
    x = r(batch, H, P)
    dt_h = r(batch, H, scale=0.5) - (0.5 if softplus else -1.5)  # positive dt without softplus
    A_h = -torch.exp(r(H, scale=0.5))
    B = r(batch, G, N, scale=0.5)
    C = r(batch, G, N, scale=0.5)
    D_h = r(H) if use_D else None
    bias_h = r(H, scale=0.3) if use_bias else None
    z = r(batch, H, P) if use_z else None
    out = torch.full((batch, H, P), float("nan"), dtype=torch.float64)
    # mamba.py's decode call: A, dt, dt_bias, D expanded over head_dim (stride-0 views)
    ops.selective_state_update(
        pool, x, dt_h[:, :, None].expand(-1, -1, P), A_h[:, None, None].expand(-1, P, N), B, C,
        None if D_h is None else D_h[:, None].expand(-1, P), z=z,
        dt_bias=None if bias_h is None else bias_h[:, None].expand(-1, P),
        dt_softplus=softplus, state_batch_indices=idx, out=out,
    )
    for b in range(batch):
        dt = ref_dt(dt_h[b : b + 1], bias_h, softplus, clamp=False)
        y, st = ref_sequence(x[b : b + 1], dt, A_h, B[b : b + 1], C[b : b + 1], D_h, None if z is None else z[b : b + 1], before[idx[b]])
        assert_close(out[b], y[0], TOL64, f"y row {b}")
        assert_close(pool[idx[b]], st[1], TOL64, f"state slot {int(idx[b])}")
    for s in (0, 2, 4, 6):
        assert torch.equal(pool[s], before[s])


def test_selective_state_update_pad_slot_and_float32():
    g = torch.Generator().manual_seed(21)
    H, P, N = 2, 4, 8
    pool = torch.randn(4, H, P, N, generator=g)
    before = pool.clone()
    x = torch.randn(2, H, P, generator=g)
    dt = torch.randn(2, H, P, generator=g)
    A = -torch.rand(H, P, N, generator=g) - 0.5
    B = torch.randn(2, 1, N, generator=g)
    C = torch.randn(2, 1, N, generator=g)
    out = torch.empty(2, H, P)
    ops.selective_state_update(pool, x, dt, A, B, C, dt_softplus=True, state_batch_indices=torch.tensor([ops.PAD_SLOT_ID, 2]), out=out)
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])  # pad row writes nothing
    d = F.softplus(dt[1].double())
    expected = before[2].double() * torch.exp(A.double() * d[..., None]) + (d * x[1].double())[..., None] * B[1, 0].double()
    assert_close(pool[2], expected, 1e-5, "float32 state")
    assert torch.isfinite(out).all()


def test_selective_state_update_multi_token_buffer_and_tree():
    g = torch.Generator().manual_seed(22)
    H, G, P, N, T = 2, 1, 4, 8, 4
    pool = torch.randn(3, H, P, N, generator=g, dtype=torch.float64)
    before = pool.clone()
    x = torch.randn(1, T, H, P, generator=g, dtype=torch.float64)
    dt_h = torch.randn(1, T, H, generator=g, dtype=torch.float64) * 0.5
    A_h = -torch.rand(H, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(1, T, G, N, generator=g, dtype=torch.float64)
    C = torch.randn(1, T, G, N, generator=g, dtype=torch.float64)
    D_h = torch.randn(H, generator=g, dtype=torch.float64)
    buf = torch.zeros(2, T, H, P, N, dtype=torch.float64)
    out = torch.empty_like(x)
    common = dict(dt_softplus=True, state_batch_indices=torch.tensor([2]), intermediate_states_buffer=buf, cache_steps=T,
                  intermediate_state_indices=torch.tensor([1]), disable_state_update=True)
    args = (pool, x, dt_h[..., None].expand(-1, -1, -1, P), A_h[:, None, None].expand(H, P, N), B, C, D_h[:, None].expand(H, P))
    ops.selective_state_update(*args, out=out, **common)
    dt = ref_dt(dt_h[0], None, True, clamp=False)
    y, st = ref_sequence(x[0], dt, A_h, B[0], C[0], D_h, None, before[2])
    assert torch.equal(pool, before)  # disable_state_update
    assert_close(out[0], y, TOL64, "chain outputs")
    for t in range(T):
        assert_close(buf[1, t], st[t + 1], TOL64, f"buffered state step {t}")
    # EAGLE tree: token 2 and 3 hang off token 0 and token 2 -> path 0-2-3
    tree = torch.tensor([[-1, 0, 0, 2]])
    ops.selective_state_update(*args, out=out, retrieve_parent_token=tree, **common)
    path = [0, 2, 3]
    y2, st2 = ref_sequence(x[0, path], dt[path], A_h, B[0, path], C[0, path], D_h, None, before[2])
    assert_close(out[0, 3], y2[2], TOL64, "tree leaf output")
    assert_close(buf[1, 3], st2[3], TOL64, "tree leaf state")


# ------------------------------------------------ the mixer's data flow, end to end


def test_mixer_flow_extend_in_pieces_then_decode_equals_one_pass():
    """mamba.py's sequence of calls (conv -> split x/B/C -> scan, states in the pool; decode:
    conv update -> selective_state_update with head_dim-expanded params), run as prefill
    150 + extend 100 (from the pool's states) + 6 decode steps, equals one 256-token pass."""
    g = torch.Generator().manual_seed(40)
    H, G, P, N, W, cs = 4, 1, 8, 16, 4, 64
    I = H * P
    conv_dim = I + 2 * G * N
    n_total, pieces = 256, (150, 100)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g, dtype=torch.float64) * scale  # noqa: E731
    xBC = r(n_total, conv_dim)
    dt_raw = r(n_total, H, scale=0.5) - 1.0
    weight, bias = r(conv_dim, W, scale=0.5), r(conv_dim, scale=0.1)
    A, D, dt_bias = -torch.exp(r(H, scale=0.5)), r(H), r(H, scale=0.3)
    conv_pool = torch.zeros(6, conv_dim, W - 1, dtype=torch.float64)
    ssm_pool = torch.zeros(6, H, P, N, dtype=torch.float64)

    def prefill(tokens, dts, slot, has_init):  # noqa: ANN001, ANN202
        n = tokens.shape[0]
        qsl = torch.tensor([0, n], dtype=torch.int32)
        conv = ops.causal_conv1d_fn_triton(
            tokens.t(), weight, bias, activation="silu", conv_states=conv_pool,
            has_initial_state=torch.tensor([has_init]), cache_indices=torch.tensor([slot]),
            query_start_loc=qsl, seq_lens_cpu=[n],
        ).t()
        xs, B, C = torch.split(conv, [I, G * N, G * N], dim=-1)
        init = torch.where(torch.tensor([has_init])[:, None, None, None], ssm_pool[[slot]], 0) if has_init else None
        out = torch.empty(1, n, H, P, dtype=torch.float64)
        _, varlen, _ = ops.mamba_chunk_scan_combined(
            xs.reshape(1, n, H, P), dts.unsqueeze(0), A, B.reshape(1, n, G, N), C.reshape(1, n, G, N),
            chunk_size=cs, D=D, z=None, dt_bias=dt_bias, seq_idx=torch.zeros(1, n, dtype=torch.int32),
            chunk_indices=None, chunk_offsets=None, cu_seqlens=qsl, initial_states=init,
            return_varlen_states=True, return_final_states=False, return_track_states=True,
            track_seq_idx=None, track_end_locs=None, dt_softplus=True, dt_limit=(0.0, float("inf")),
            out=out, state_dtype=ssm_pool.dtype,
        )
        ssm_pool[[slot]] = varlen
        return out.reshape(n, I)

    def decode(token, dts, slot):  # noqa: ANN001, ANN202
        conv = ops.causal_conv1d_update_triton(token[None], conv_pool, weight, bias, "silu", conv_state_indices=torch.tensor([slot]))
        xs, B, C = torch.split(conv, [I, G * N, G * N], dim=-1)
        out = torch.empty(1, I, dtype=torch.float64)
        ops.selective_state_update(
            ssm_pool, xs.view(-1, H, P), dts[None, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
            B.view(-1, G, N), C.view(-1, G, N), D[:, None].expand(-1, P), z=None,
            dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True,
            state_batch_indices=torch.tensor([slot]), out=out.view(1, -1, P),
        )
        return out[0]

    one_pass = prefill(xBC, dt_raw, 1, False)
    a, b = pieces
    got = [prefill(xBC[:a], dt_raw[:a], 4, False), prefill(xBC[a : a + b], dt_raw[a : a + b], 4, True)]
    got += [decode(xBC[t], dt_raw[t], 4)[None] for t in range(a + b, n_total)]
    assert_close(torch.cat(got), one_pass, TOL64, "pieces + decode vs one pass")
    assert_close(ssm_pool[4], ssm_pool[1], TOL64, "ssm state")
    assert_close(conv_pool[4], conv_pool[1], TOL64, "conv state")


# ------------------------------------------------------------------- the gated norm


def _sglang_source(rel: str) -> tuple[str, ast.Module]:
    path = _installed_sglang() / rel
    src = path.read_text()
    return src, ast.parse(src)


def _find_def(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_mixer2_gated_norm_cpu_path_is_torch_and_matches_formula():
    """Mixer2RMSNormGated has no forward_cpu, and the CPU dispatch key's candidates are
    forward_cpu only, so CPU (in-tree or the kit's OOT key "cpu") runs forward_native: that
    function, executed from the installed file, equals  w * rmsnorm_per_group(x * silu(gate))
    (to 1e-6: it evaluates silu(gate) in float32)."""
    src, tree = _sglang_source("srt/layers/attention/mamba/mixer2_rms_norm_gated.py")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Mixer2RMSNormGated")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert "forward_native" in methods and "forward_cpu" not in methods
    _, fo_tree = _sglang_source("kernels/fused_op.py")
    pm = next(n for n in ast.walk(fo_tree) if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_PLATFORM_METHODS")
    assert ast.literal_eval(pm.value)["cpu"] == ("forward_cpu",)

    fn_src = textwrap.dedent(ast.get_source_segment(src, _find_def(cls, "forward_native")))
    ns: dict = {"torch": torch}
    exec(compile(fn_src, "mixer2_rms_norm_gated.forward_native", "exec"), ns)  # noqa: S102
    forward_native = ns["forward_native"]
    g = torch.Generator().manual_seed(30)
    for n_groups, use_rms in ((1, True), (4, True), (2, False)):
        hidden, eps = 32, 1e-5
        w = torch.randn(hidden, generator=g, dtype=torch.float64)
        me = types.SimpleNamespace(
            n_groups=n_groups, use_rms_norm=use_rms, tp_size=1, tp_rank=0, variance_epsilon=eps,
            group_size=hidden // n_groups, per_rank_hidden_size=hidden, weight=w, use_attn_tp_group=False,
        )
        x = torch.randn(5, hidden, generator=g, dtype=torch.float64)
        gate = torch.randn(5, hidden, generator=g, dtype=torch.float64)
        got = forward_native(me, x, gate)
        gx = x * gate * torch.sigmoid(gate)
        if use_rms:
            grp = gx.view(5, n_groups, hidden // n_groups)
            expected = w * (grp / torch.sqrt(grp.square().mean(-1, keepdim=True) + eps)).view(5, hidden)
        else:
            expected = gx
        # SGLang takes silu of the gate in float32: agreement to float32 precision
        assert_close(got, expected, 1e-6, f"gated norm n_groups={n_groups} rms={use_rms}")


# ------------------------------------------------------- signatures and declarations

_PAIRS = [
    (ops.causal_conv1d_fn, "srt/layers/attention/mamba/causal_conv1d.py", "causal_conv1d_fn"),
    (ops.causal_conv1d_update, "srt/layers/attention/mamba/causal_conv1d.py", "causal_conv1d_update"),
    (ops.causal_conv1d_fn_triton, "kernels/ops/mamba/causal_conv1d_triton.py", "causal_conv1d_fn"),
    (ops.causal_conv1d_update_triton, "kernels/ops/mamba/causal_conv1d_triton.py", "causal_conv1d_update"),
    (ops.mamba_chunk_scan_combined, "kernels/ops/mamba/triton_ops/ssd_combined.py", "mamba_chunk_scan_combined"),
    (ops.selective_state_update, "kernels/ops/mamba/triton_ops/ssu_dispatch.py", "selective_state_update"),
    (ops.selective_state_update, "kernels/ops/mamba/triton_ops/mamba_ssm.py", "selective_state_update"),
]


@pytest.mark.parametrize("ours,rel,name", _PAIRS, ids=[f"{p[1].rsplit('/', 1)[1]}:{p[2]}" for p in _PAIRS])
def test_signature_matches_sglang(ours, rel, name):
    _, tree = _sglang_source(rel)
    theirs = _find_def(tree, name).args
    their_pos = [a.arg for a in theirs.posonlyargs + theirs.args]
    params = inspect.signature(ours).parameters
    our_pos = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert our_pos[: len(their_pos)] == their_pos, (our_pos, their_pos)
    for a in theirs.kwonlyargs:
        assert a.arg in params
    # SGLang's defaults are ours
    their_defaults = dict(zip(their_pos[len(their_pos) - len(theirs.defaults):], theirs.defaults))
    for arg, node in their_defaults.items():
        try:
            value = ast.literal_eval(node)
        except ValueError:
            continue  # a name (PAD_SLOT_ID) or a call (float("inf"))
        assert params[arg].default == value, arg
    if theirs.kwarg is not None:
        assert any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_mamba_py_call_sites_bind_to_the_stand_ins():
    """Every call mamba.py's forward makes to these names binds to our signatures."""
    _, tree = _sglang_source("srt/layers/attention/mamba/mamba.py")
    fwd = _find_def(tree, "forward", cls="MambaMixer2")
    local = {"ccfn": (ops.causal_conv1d_fn, ops.causal_conv1d_fn_triton), "ccu": (ops.causal_conv1d_update, ops.causal_conv1d_update_triton)}
    direct = {
        "mamba_chunk_scan_combined": (ops.mamba_chunk_scan_combined,),
        "selective_state_update": (ops.selective_state_update,),
        "causal_conv1d_update_triton": (ops.causal_conv1d_update_triton,),
    }
    seen = set()
    for node in ast.walk(fwd):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {**local, **direct}:
            seen.add(node.func.id)
            for fn in {**local, **direct}[node.func.id]:
                inspect.signature(fn).bind(*([None] * len(node.args)), **{k.arg: None for k in node.keywords})
    assert seen == set(local) | set(direct)


def test_bindings_declare_every_entry_point():
    by_target = {b.target: b for b in ops.BINDINGS}
    assert all(isinstance(b, Binding) and b.why for b in ops.BINDINGS)
    assert ops.TORCH_OPS == ()
    m = "sglang.srt.layers.attention.mamba.mamba."
    expected = {
        "sglang.kernels.ops.mamba.triton_ops.mamba_chunk_scan_combined": ("replace", ops.mamba_chunk_scan_combined),
        "sglang.kernels.ops.mamba.triton_ops.selective_state_update": ("replace", ops.selective_state_update),
        m + "causal_conv1d_fn": ("bind", ops.causal_conv1d_fn),
        m + "causal_conv1d_fn_triton": ("bind", ops.causal_conv1d_fn_triton),
        m + "causal_conv1d_update": ("bind", ops.causal_conv1d_update),
        m + "causal_conv1d_update_triton": ("bind", ops.causal_conv1d_update_triton),
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn": ("replace", ops.causal_conv1d_fn_triton),
        "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update": ("replace", ops.causal_conv1d_update_triton),
    }
    assert {t: (b.how, b.impl) for t, b in by_target.items()} == expected
    # "bind" names are exactly the ones mamba.py binds only under is_cuda(); "replace" ones
    # are defined or imported at module level of their module on every platform
    _, tree = _sglang_source("srt/layers/attention/mamba/mamba.py")
    cuda_block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "is_cuda()")
    cuda_names = {a.asname or a.name for n in cuda_block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {t[len(m):] for t, (how, _) in expected.items() if how == "bind"} == cuda_names
    for target, (how, _) in expected.items():
        if how != "replace":
            continue
        mod, _, attr = target.rpartition(".")
        rel = mod.removeprefix("sglang.").replace(".", "/")
        path = _installed_sglang() / (rel + "/__init__.py" if (_installed_sglang() / rel).is_dir() else rel + ".py")
        mtree = ast.parse(path.read_text())
        top = {a.asname or a.name for n in mtree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        top |= {n.name for n in mtree.body if isinstance(n, ast.FunctionDef)}
        assert attr in top, target
