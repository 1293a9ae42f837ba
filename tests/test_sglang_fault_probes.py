"""Direct probes: each seeded real-SGLang fault (``conformance/sglang_plugins/faults``) does
real damage on a real SGLang server on CPU, shown with raw numbers before any kit check
is asked to catch it -- and the same scenarios on a clean server show none (controls).

Every probe launches one ``sglang-cpu`` server (30-240 s on a loaded 2-core machine).
Default runs keep only the ``fault_probe_fast`` subset; ``-m fault_probe`` runs them all.
Leak probes switch SGLang's strict idle check off so the server keeps serving and the
leaked slots can be counted (with it on, SGLang kills the scheduler at the first idle).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_cpu_probes import (
    MAMBA_GAUGE,
    aborted_decode_then_idle,
    batch_then_idle,
    batched_prefill_hits,
    branch_cached_tokens,
    branch_point_hit,
    burst_on_cached_prefix_then_idle,
    cell_for,
    decode_across_boundary_then_idle,
    decode_hits,
    grid_prefill_hits,
    probe_server,
    streaming_session_then_idle,
    summary,
)

from conformance.checks.leaks import idle_invariant

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(1800)]

EXTRA = ("qwen3-next", "extra_buffer")
LAZY = ("qwen3-next", "extra_buffer_lazy")
MAMBA2 = ("nemotron-h", "extra_buffer")


def _server(tmp_path: Path, where: tuple[str, str], fault: str | None, cell_fault: str = "none"):
    return probe_server(cell_for(*where, cell_fault), tmp_path, fault=fault, strict=False)


def _leaked(values: dict[str, float]) -> float:
    return values[MAMBA_GAUGE]


# ------------------------------------------------------------------ leaks: slots counted at idle
def test_session_pingpong_leak(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "session_pingpong_leak") as s:
        before = _leaked(batch_then_idle(s.client))
        after = _leaked(streaming_session_then_idle(s.client))
        assert s.fired("session_pingpong_leak") >= 1
    assert before == 0 and after >= 3, f"mamba used at idle: {before:g} before, {after:g} after one streaming session"


@pytest.mark.fault_probe_fast
def test_pingpong_leak_on_finish(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "pingpong_leak_on_finish") as s:
        values = batch_then_idle(s.client)
        assert s.fired("pingpong_leak_on_finish") >= 4
    assert _leaked(values) >= 4, f"mamba used at idle after 4 finished requests: {_leaked(values):g}"


def test_lazy_slot_not_returned(tmp_path: Path) -> None:
    with _server(tmp_path, LAZY, "lazy_slot_not_returned") as s:
        values = decode_across_boundary_then_idle(s.client)
        assert s.fired("lazy_slot_not_returned") >= 2
    assert _leaked(values) >= 2, f"mamba used at idle after 2 boundary crossings: {_leaked(values):g}"


def test_double_free(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "double_free") as s:
        values = batch_then_idle(s.client)
        assert s.fired("double_free") >= 4
    assert _leaked(values) <= -4, f"mamba used at idle after 4 double frees: {_leaked(values):g} (a slot counted twice reads below 0)"


def test_abort_leak(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "abort_leak") as s:
        before = _leaked(batch_then_idle(s.client))
        after = _leaked(aborted_decode_then_idle(s.client))
        assert s.fired("abort_leak") >= 1
    assert before == 0 and after >= 1, f"mamba used at idle: {before:g} after normal requests, {after:g} after one aborted"


def test_evict_locked_node(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "evict_locked_node") as s:
        values = burst_on_cached_prefix_then_idle(s.client)
        assert s.fired("evict_locked_node") >= 1
    problems = idle_invariant(values)
    assert problems, f"idle invariant held after evicting locked nodes: {values}"


# ------------------------------------------------------------------ states: hit vs cold
def _diverged(rows) -> list:
    return [r for r in rows if r.cached_tokens > 0 and r.diverged]


@pytest.mark.fault_probe_fast
def test_cow_skipped(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "cow_skipped") as s:
        rows = batched_prefill_hits(s.client)
        assert s.fired("cow_skipped") >= 1
    assert len(_diverged(rows)) == len(rows), summary(rows)


def test_state_drift(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "state_drift") as s:
        rows = batched_prefill_hits(s.client)
        assert s.fired("state_drift") >= 1
    assert _diverged(rows), summary(rows)


def test_gdn_h_offset_floor(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "gdn_h_offset_floor") as s:
        rows = batched_prefill_hits(s.client)
        assert s.fired("gdn_h_offset_floor") >= 1
    assert _diverged(rows[1:]) and not _diverged(rows[:1]), summary(rows)


def test_mamba2_track_index_global(tmp_path: Path) -> None:
    with _server(tmp_path, MAMBA2, "mamba2_track_index_global") as s:
        rows = batched_prefill_hits(s.client)
        assert s.fired("mamba2_track_index_global") >= 1
    assert _diverged(rows[1:]) and not _diverged(rows[:1]), summary(rows)


def test_track_seqlen_minus_one(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "track_seqlen_minus_one") as s:
        rows = grid_prefill_hits(s.client)
        assert s.fired("track_seqlen_minus_one") >= 1
    assert _diverged(rows), summary(rows)


def test_force_track_h_dropped(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "force_track_h_dropped") as s:
        rows = branch_point_hit(s.client)
        assert s.fired("force_track_h_dropped") >= 1
    assert rows[0].cached_tokens == 192 and rows[0].diverged, summary(rows)


def test_decode_track_mask_empty(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "decode_track_mask_empty") as s:
        rows = decode_hits(s.client)
        assert s.fired("decode_track_mask_empty") >= 1
    assert [r for r in rows if r.cached_tokens == 256 and r.diverged], summary(rows)


def test_lazy_alloc_fail_still_inserts(tmp_path: Path) -> None:
    with _server(tmp_path, LAZY, "lazy_alloc_fail_still_inserts", cell_fault="lazy_alloc_fail") as s:
        rows = decode_hits(s.client)
        assert s.fired("lazy_alloc_fail_still_inserts") >= 1
    assert [r for r in rows if r.cached_tokens == 256 and r.diverged], summary(rows)


def test_cached_tokens_overreport(tmp_path: Path) -> None:
    with _server(tmp_path, EXTRA, "cached_tokens_overreport") as s:
        reported, kv_prefix = branch_cached_tokens(s.client)
        assert s.fired("cached_tokens_overreport") >= 1
    assert reported == kv_prefix == 200, f"cached_tokens {reported} for a 200-token KV match whose mamba state is not cached (reused: 0)"


# ------------------------------------------------------------------ controls: the same scenarios, no fault
@pytest.mark.fault_probe_fast
def test_control_extra_buffer_clean(tmp_path: Path) -> None:
    """Every extra_buffer scenario above on a clean server: no slot at idle, hits equal cold."""
    with _server(tmp_path, EXTRA, None) as s:
        c = s.client
        idle = [batch_then_idle(c), streaming_session_then_idle(c), aborted_decode_then_idle(c), burst_on_cached_prefix_then_idle(c)]
        hits = batched_prefill_hits(c) + grid_prefill_hits(c) + branch_point_hit(c) + decode_hits(c)
        reported, _ = branch_cached_tokens(c)
    assert [_leaked(v) for v in idle] == [0, 0, 0, 0] and not any(idle_invariant(v) for v in idle), idle
    assert all(r.cached_tokens > 0 for r in hits) and not _diverged(hits), summary(hits)
    assert reported == 0


def test_control_lazy_clean(tmp_path: Path) -> None:
    with _server(tmp_path, LAZY, None) as s:
        values = decode_across_boundary_then_idle(s.client)
    assert _leaked(values) == 0 and not idle_invariant(values), values


def test_control_lazy_alloc_fail_clean(tmp_path: Path) -> None:
    """SGLang 0.5.23 tracks in place when the lazy boundary allocation fails: hits stay exact."""
    with _server(tmp_path, LAZY, None, cell_fault="lazy_alloc_fail") as s:
        rows = decode_hits(s.client)
    assert [r for r in rows if r.cached_tokens == 256] and not _diverged(rows), summary(rows)


def test_control_mamba2_clean(tmp_path: Path) -> None:
    with _server(tmp_path, MAMBA2, None) as s:
        rows = batched_prefill_hits(s.client)
    assert all(r.cached_tokens > 0 for r in rows) and not _diverged(rows), summary(rows)
