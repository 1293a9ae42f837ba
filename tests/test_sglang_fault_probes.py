"""Direct probes: each seeded real-SGLang fault (``conformance/sglang_plugins/faults``) does
real damage on a real SGLang server on CPU, shown with raw numbers before any kit check
is asked to catch it -- and the same scenarios on a clean server show none (controls).

Every probe launches one ``sglang-cpu`` server (30-240 s on a loaded 2-core machine).
Default runs keep only the ``fault_probe_fast`` subset; ``-m fault_probe`` runs them all.
Leak probes switch SGLang's strict idle check off so the server keeps serving and the
leaked slots can be counted (with it on, SGLang kills the scheduler at the first idle).
(``pingpong_leak_on_finish`` is probed, strict check off, in test_sglang_leak_agreement.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from sglang_cpu_probes import (
    MAMBA_USED_TOKENS,
    aborted_decode_then_idle,
    batch_then_idle,
    batched_prefill_hits,
    branch_cached_tokens,
    branch_point_hit,
    cap_hits,
    cell_for,
    cold_ttfts,
    cut_prefill_hits,
    decode_across_boundary_then_idle,
    decode_hits,
    first_decode_boundary_hits,
    grid_prefill_hits,
    hits_then_idle,
    kv_fill_hits,
    kv_fill_then_idle,
    mixed_prefill_hits,
    overlap_edge_hits,
    pressure_hits,
    refused_follow_up_hit,
    priority_fill_held_hit,
    REASONING_LENGTHS,
    reasoning_hits,
    sub_chunk_prefill_hits,
    probe_server,
    streaming_session_then_idle,
    summary,
)

from conformance.checks.leaks import idle_invariant
from conformance.sglang_plugins.faults.track_path_slowdown import PREFILL_SLEEP_S
from conformance.targets import preimport

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(1800)]

EXTRA = ("qwen3-next", "extra_buffer")
LAZY = ("qwen3-next", "extra_buffer_lazy")
MAMBA2 = ("nemotron-h", "extra_buffer")


def used(scenario: Callable) -> Callable:
    """The scenario's ``sglang:mamba_used_tokens`` at idle, before any flush."""
    return lambda client: scenario(client)[MAMBA_USED_TOKENS]


def diverged(rows) -> list:
    return [r for r in rows if r.cached_tokens > 0 and r.diverged]


@dataclass(frozen=True)
class Probe:
    where: tuple[str, str]
    scenario: Callable[[Any], Any]
    harmed: Callable[[Any], bool]
    cell_fault: str = "none"
    options: tuple[tuple[str, str], ...] = ()  # the cell's server-option axis values


PROBES: dict[str, Probe] = {
    # leaks: mamba slots counted at idle (a slot counted twice reads below 0)
    "session_pingpong_leak": Probe(EXTRA, used(streaming_session_then_idle), lambda n: n >= 3),
    "lazy_slot_not_returned": Probe(LAZY, used(decode_across_boundary_then_idle), lambda n: n >= 2),
    "double_free": Probe(EXTRA, used(batch_then_idle), lambda n: n <= -4),
    "abort_leak": Probe(EXTRA, used(aborted_decode_then_idle), lambda n: n >= 1),
    # SGLang's own forced retraction (every 3rd decode step): the retracted requests' slots stay used
    "retract_leaks_mamba_slot": Probe(EXTRA, used(batch_then_idle), lambda n: n >= 1, "forced_retract"),
    # a follow-up refused for KV after matching a stored 512-token state, retried once a holder
    # finished: the tree still holds the state (clean: a hit of 512), the faulty retry starts from 0
    "refused_retry_drops_match": Probe(EXTRA, refused_follow_up_hit, lambda seen: seen[0] == 0, options=(("kv_pool", "small"),)),
    "evict_locked_node": Probe(EXTRA, used(hits_then_idle), lambda n: n <= -4),
    # states: a cache hit against the same request served cold
    "cow_skipped": Probe(EXTRA, batched_prefill_hits, lambda rows: len(diverged(rows)) == len(rows)),
    "state_drift": Probe(EXTRA, batched_prefill_hits, lambda rows: bool(diverged(rows))),
    "gdn_h_offset_floor": Probe(EXTRA, batched_prefill_hits, lambda rows: bool(diverged(rows[1:])) and not diverged(rows[:1])),
    "mamba2_track_index_global": Probe(MAMBA2, batched_prefill_hits, lambda rows: bool(diverged(rows[1:])) and not diverged(rows[:1])),
    "track_seqlen_minus_one": Probe(EXTRA, grid_prefill_hits, lambda rows: bool(diverged(rows))),
    "force_track_h_dropped": Probe(EXTRA, branch_point_hit, lambda rows: rows[0].cached_tokens == 192 and rows[0].diverged),
    "decode_track_mask_empty": Probe(EXTRA, decode_hits, lambda rows: any(r.cached_tokens == 256 and r.diverged for r in rows)),
    # the boundary a first decode step reaches never recorded: the follow-up stops at the prefill checkpoint (192), answers right
    "first_decode_boundary_unseen": Probe(EXTRA, first_decode_boundary_hits, lambda rows: [r.cached_tokens for r in rows] == [192] and not diverged(rows)),
    "lazy_alloc_fail_still_inserts": Probe(LAZY, decode_hits, lambda rows: any(r.cached_tokens == 256 and r.diverged for r in rows), "lazy_alloc_fail"),
    # reporting: cached_tokens for B = P+Y after A = P+X (KV match 200, mamba state reused: none)
    "cached_tokens_overreport": Probe(EXTRA, branch_cached_tokens, lambda got: got == (200, 200)),
    # performance: every cold prefill waits in the track path (SGLang's own first_token_latency)
    "track_path_slowdown": Probe(EXTRA, cold_ttfts, lambda ttfts: min(ttfts) >= PREFILL_SLEEP_S),
    # server-option axes: checkpoints stored from mixed prefill+decode batches (--enable-mixed-chunk)
    "mixed_chunk_track_dropped": Probe(EXTRA, mixed_prefill_hits, lambda rows: bool(diverged(rows)), options=(("mixed_chunk", "on"),)),
    # prefills cut by chunked prefill off the checkpoint grid (--chunked-prefill-size 96, grid 64):
    # the hits land on the cuts (96, 192) instead of the checkpoints (64, 160) and diverge
    "chunk_cut_key_past_checkpoint": Probe(EXTRA, cut_prefill_hits, lambda rows: [r.cached_tokens for r in rows] == [96, 192] and all(r.diverged for r in rows),
                                           options=(("chunked_prefill", "off-grid"),)),
    # the overlap scheduler (on by default for extra_buffer): a prefill checkpoint donated after the
    # overlapped first decode step ran -- which tracks when the prompt is one short of the interval
    "overlap_track_slot_reused": Probe(EXTRA, overlap_edge_hits, lambda rows: bool(diverged(rows))),
    # a small Mamba pool (16 slots): a burst runs it short, evictions under pressure
    # chunks below the mamba chunk (--chunked-prefill-size 32, grid 64): nothing tracked, nothing stored;
    # the fault stores the untracked slot at the cuts (hits at 96 and 192 instead of none)
    "sub_chunk_handoff_donates_untracked": Probe(EXTRA, sub_chunk_prefill_hits, lambda rows: [r.cached_tokens for r in rows] == [96, 192] and all(r.diverged for r in rows),
                                                 options=(("chunked_prefill", "sub-chunk"),)),
    "pressure_evict_slot_still_cached": Probe(EXTRA, pressure_hits, lambda rows: bool(diverged(rows)), options=(("mamba_pool", "small"),)),
    # the same pool's request cap (3) holding a burst back
    "mamba_cap_reclaims_cached_slot": Probe(EXTRA, cap_hits, lambda rows: bool(diverged(rows)), options=(("mamba_pool", "small"),)),
    # a small KV pool (4096 tokens): storing 5600 tokens runs it short, KV evictions under pressure
    # (the freed slots' hits measured equal to cold, 5 fired: the damage is the slot the tree and the
    # allocator both count, read at idle before any flush)
    "kv_evict_frees_cached_mamba_slot": Probe(EXTRA, used(kv_fill_then_idle), lambda n: n != 0, options=(("kv_pool", "small"),)),
    # --strip-thinking-cache: a reasoning request caches its prompt only; the fault names its newest
    # state (tracked at 256, while thinking) with the whole prompt: hits at 250/245 diverge
    "strip_thinking_state_past_key": Probe(EXTRA, reasoning_hits, lambda rows: [r.cached_tokens for r in rows] == list(REASONING_LENGTHS) and all(r.diverged for r in rows),
                                           options=(("reasoning", "strip-thinking"),)),
    # --radix-eviction-policy priority under KV pressure: the held prompt (priority 10) is given up
    # first once the tree keeps its priority negated (clean: kept, hit ~1024; the last stored prompt hits either way)
    "evict_priority_inverted": Probe(EXTRA, priority_fill_held_hit, lambda hits: hits[0] == 0 and hits[1] > 0,
                                     options=(("eviction", "priority"),)),
    # --mamba-max-states-per-path 1: each insert's cap step hands the new tail's slot back while the
    # tree keeps it, so at idle the slot is both free and cached (the gauge reads below 0).  (Its hits
    # were measured equal to cold on this and on cap_hits' burst: the allocator hands slots out
    # first-in first-out, so a slot freed to the back of 48 is reused only after the others.)
    "path_cap_frees_tail_slot": Probe(EXTRA, used(hits_then_idle), lambda n: n < 0, options=(("path_cap", "1"),)),
}
FAST = ("cow_skipped",)


def _describe(seen: Any) -> str:
    return summary(seen) if isinstance(seen, list) and seen and hasattr(seen[0], "diverged") else repr(seen)


@pytest.mark.parametrize("fault", [pytest.param(f, marks=[pytest.mark.fault_probe_fast] if f in FAST else []) for f in PROBES])
def test_fault_does_damage_on_real_sglang(fault: str, tmp_path: Path) -> None:
    probe = PROBES[fault]
    with probe_server(cell_for(*probe.where, probe.cell_fault, probe.options), tmp_path, fault=fault, strict=False) as server:
        seen = probe.scenario(server.client)
        fired = server.fired(fault)
    # the server was forked from the pre-imported launcher unless the run asked for plain launches
    assert server.process.launch == ("pre-imported" if preimport.enabled() else "plain"), server.log()[-2000:]
    assert fired >= 1, f"{fault}: its hooks never fired on this scenario"
    assert probe.harmed(seen), f"{fault} (fired {fired}x) did no visible damage: {_describe(seen)}"


# ------------------------------------------------------------------ controls: the same scenarios, no fault
def _clean(where: tuple[str, str], tmp_path: Path, cell_fault: str = "none"):
    return probe_server(cell_for(*where, cell_fault), tmp_path, fault=None, strict=False)


def test_control_extra_buffer_clean(tmp_path: Path) -> None:
    """Every extra_buffer scenario above on a clean server: no slot at idle, hits equal cold,
    cached_tokens is the mamba-floored hit."""
    with _clean(EXTRA, tmp_path) as s:
        c = s.client
        idle = [batch_then_idle(c), streaming_session_then_idle(c), aborted_decode_then_idle(c), hits_then_idle(c)]
        hits = batched_prefill_hits(c) + grid_prefill_hits(c) + branch_point_hit(c) + decode_hits(c)
        reported = branch_cached_tokens(c)
        first = first_decode_boundary_hits(c)
    assert [v[MAMBA_USED_TOKENS] for v in idle] == [0] * len(idle) and not any(idle_invariant(v) for v in idle), idle
    assert all(r.cached_tokens > 0 for r in hits) and not diverged(hits), summary(hits)
    assert reported == (0, 200)
    assert [r.cached_tokens for r in first] == [256] and not diverged(first), summary(first)  # the first decode step's boundary kept


def test_control_forced_retract_clean(tmp_path: Path) -> None:
    """SGLang's forced retraction on a clean server: the retracted requests are prefilled
    again and every slot is back at idle (the fault's probe on the same scenario shows the
    retraction happens: its hook fires)."""
    with _clean(EXTRA, tmp_path, "forced_retract") as s:
        values = batch_then_idle(s.client)
    assert values[MAMBA_USED_TOKENS] == 0 and not idle_invariant(values), values


def test_control_lazy_clean(tmp_path: Path) -> None:
    with _clean(LAZY, tmp_path) as s:
        values = decode_across_boundary_then_idle(s.client)
    assert values[MAMBA_USED_TOKENS] == 0 and not idle_invariant(values), values


def test_control_lazy_alloc_fail_clean(tmp_path: Path) -> None:
    """SGLang 0.5.23 tracks in place when the lazy boundary allocation fails: hits stay exact."""
    with _clean(LAZY, tmp_path, "lazy_alloc_fail") as s:
        rows = decode_hits(s.client)
    assert any(r.cached_tokens == 256 for r in rows) and not diverged(rows), summary(rows)


def test_control_mamba2_clean(tmp_path: Path) -> None:
    with _clean(MAMBA2, tmp_path) as s:
        rows = batched_prefill_hits(s.client)
    assert all(r.cached_tokens > 0 for r in rows) and not diverged(rows), summary(rows)


def test_control_mixed_chunk_clean(tmp_path: Path) -> None:
    """Checkpoints stored from mixed prefill+decode batches on a clean server: hits equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("mixed_chunk", "on"),)), tmp_path, fault=None, strict=False) as s:
        rows = mixed_prefill_hits(s.client)
    assert all(r.cached_tokens > 0 for r in rows) and not diverged(rows), summary(rows)


def test_control_cut_prefill_clean(tmp_path: Path) -> None:
    """Prefills cut off the grid on a clean server: the hits land on the checkpoints (64, 160)
    and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("chunked_prefill", "off-grid"),)), tmp_path, fault=None, strict=False) as s:
        rows = cut_prefill_hits(s.client)
    assert [r.cached_tokens for r in rows] == [64, 160] and not diverged(rows), summary(rows)


def test_cut_prefill_fault_is_missed_with_the_option_off(tmp_path: Path) -> None:
    """The same scenario and fault on the plain cell (SGLang's default chunked prefill size):
    nothing is cut, the hook never fires; the one extend stores one checkpoint (192), which the
    longer prompt hits and the shorter cannot (measured: hits 0 and 192, equal to cold)."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="chunk_cut_key_past_checkpoint", strict=False) as s:
        rows = cut_prefill_hits(s.client)
        fired = s.fired("chunk_cut_key_past_checkpoint")
    assert fired == 0 and [r.cached_tokens for r in rows] == [0, 192] and not diverged(rows), (fired, summary(rows))


def test_control_overlap_edge_clean(tmp_path: Path) -> None:
    """Prompts one short of the track interval on a clean (overlap) server: the hits land on the
    prefill checkpoints (192, 448) and equal cold."""
    with _clean(EXTRA, tmp_path) as s:
        rows = overlap_edge_hits(s.client)
    assert [r.cached_tokens for r in rows] == [192, 448] and not diverged(rows), summary(rows)


def test_overlap_fault_is_missed_with_overlap_off(tmp_path: Path) -> None:
    """The same scenario and fault with ``--disable-overlap-schedule``: one track slot, results
    processed before the next step is built -- the hook never changes anything."""
    with probe_server(cell_for(*EXTRA, options=(("overlap", "off"),)), tmp_path, fault="overlap_track_slot_reused", strict=False) as s:
        rows = overlap_edge_hits(s.client)
        fired = s.fired("overlap_track_slot_reused")
    assert fired == 0 and [r.cached_tokens for r in rows] == [192, 448] and not diverged(rows), (fired, summary(rows))


def test_control_path_cap_clean(tmp_path: Path) -> None:
    """The scenarios on a clean server that keeps one Mamba state per path: no slot at idle, and
    the hits land on the tails the cap keeps and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("path_cap", "1"),)), tmp_path, fault=None, strict=False) as s:
        idle = hits_then_idle(s.client)
        rows = cap_hits(s.client)
    assert idle[MAMBA_USED_TOKENS] == 0 and not idle_invariant(idle), idle
    assert all(r.cached_tokens > 0 for r in rows) and not diverged(rows), summary(rows)


def test_path_cap_fault_is_missed_with_the_cap_off(tmp_path: Path) -> None:
    """The same scenario and fault without the cap: SGLang emits no cap step, the hook never
    fires, no slot at idle."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="path_cap_frees_tail_slot", strict=False) as s:
        idle = hits_then_idle(s.client)
        fired = s.fired("path_cap_frees_tail_slot")
    assert fired == 0 and idle[MAMBA_USED_TOKENS] == 0 and not idle_invariant(idle), (fired, idle)


def test_control_refused_follow_up_clean(tmp_path: Path) -> None:
    """The refused follow-up on a clean small-KV-pool server: retried after a holder finished, it
    reuses the stored state (512 of its 513-token prefix)."""
    with probe_server(cell_for(*EXTRA, options=(("kv_pool", "small"),)), tmp_path, fault=None, strict=False) as s:
        hit, _ = refused_follow_up_hit(s.client)
    assert hit == 512, hit


def test_control_pressure_clean(tmp_path: Path) -> None:
    """The burst on a clean small-pool server: some hits survive the evictions and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("mamba_pool", "small"),)), tmp_path, fault=None, strict=False) as s:
        rows = pressure_hits(s.client)
    assert any(r.cached_tokens > 0 for r in rows) and not diverged(rows), summary(rows)


def test_pressure_fault_is_missed_with_the_default_pool(tmp_path: Path) -> None:
    """The same scenario and fault with the kit's default pool (48 slots): this scenario never
    runs it short, the hook never fires, the hits equal cold.  (The suites' bursts do run the
    default pool short: the fault's note in docs/faults.md says so.)"""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="pressure_evict_slot_still_cached", strict=False) as s:
        rows = pressure_hits(s.client)
        fired = s.fired("pressure_evict_slot_still_cached")
    assert fired == 0 and any(r.cached_tokens > 0 for r in rows) and not diverged(rows), (fired, summary(rows))


def test_cap_fault_is_missed_with_the_default_pool(tmp_path: Path) -> None:
    """The cap scenario and fault with the kit's default pool (48 slots, cap 9): the burst and
    the hits fit under the cap, the hook never fires, the hits equal cold."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="mamba_cap_reclaims_cached_slot", strict=False) as s:
        rows = cap_hits(s.client)
        fired = s.fired("mamba_cap_reclaims_cached_slot")
    assert fired == 0 and any(r.cached_tokens > 0 for r in rows) and not diverged(rows), (fired, summary(rows))


def test_control_sub_chunk_prefill_clean(tmp_path: Path) -> None:
    """Chunks below the mamba chunk on a clean server: nothing is stored, both prompts run cold."""
    with probe_server(cell_for(*EXTRA, options=(("chunked_prefill", "sub-chunk"),)), tmp_path, fault=None, strict=False) as s:
        rows = sub_chunk_prefill_hits(s.client)
    assert [r.cached_tokens for r in rows] == [0, 0] and not diverged(rows), summary(rows)


def test_sub_chunk_fault_is_missed_with_grid_sized_chunks(tmp_path: Path) -> None:
    """The same scenario and fault with chunks of 1.5 grids (``off-grid``, 96): every chunk
    tracks, the hook never fires, the hits land on the checkpoints (64, 160) and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("chunked_prefill", "off-grid"),)), tmp_path, fault="sub_chunk_handoff_donates_untracked", strict=False) as s:
        rows = sub_chunk_prefill_hits(s.client)
        fired = s.fired("sub_chunk_handoff_donates_untracked")
    assert fired == 0 and [r.cached_tokens for r in rows] == [64, 160] and not diverged(rows), (fired, summary(rows))


def test_control_strip_thinking_clean(tmp_path: Path) -> None:
    """Reasoning requests on a clean strip-thinking server: only the prompts are cached, so the
    follow-ups hit at or below them (the prefill checkpoint, 192) and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("reasoning", "strip-thinking"),)), tmp_path, fault=None, strict=False) as s:
        rows = reasoning_hits(s.client)
    assert all(0 < r.cached_tokens < n for r, n in zip(rows, REASONING_LENGTHS)) and not diverged(rows), summary(rows)


def test_strip_thinking_fault_is_missed_with_reasoning_off(tmp_path: Path) -> None:
    """The same requests (asking for reasoning) and fault on the plain cell (no reasoning parser:
    no output counts as thinking, every committed token is keyed): the key never falls below the
    newest state, the hook never fires, the follow-ups hit the decode's state (256) and equal cold."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="strip_thinking_state_past_key", strict=False) as s:
        rows = reasoning_hits(s.client)
        fired = s.fired("strip_thinking_state_past_key")
    assert fired == 0 and all(r.cached_tokens >= 256 for r in rows) and not diverged(rows), (fired, summary(rows))


def test_control_priority_fill_clean(tmp_path: Path) -> None:
    """The eviction-order fill on a clean priority-policy server: the held prompt (priority 10)
    survives the KV evictions, which take the oldest priority-0 prompts."""
    with probe_server(cell_for(*EXTRA, options=(("eviction", "priority"),)), tmp_path, fault=None, strict=False) as s:
        hits = priority_fill_held_hit(s.client)
    assert hits[0] >= 1000 and hits[1] > 0, hits


def test_priority_fault_is_missed_under_lru(tmp_path: Path) -> None:
    """The same fill and fault on the plain cell (LRU, the axis off): the fault fires (every
    priority-10 insert) but LRU reads no priority, so the tree gives the held prompt up first
    with or without it -- the same hits as a clean LRU server would give."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="evict_priority_inverted", strict=False) as s:
        hits = priority_fill_held_hit(s.client)
        fired = s.fired("evict_priority_inverted")
    assert fired >= 1 and hits[0] == 0 and hits[1] > 0, (fired, hits)


def test_control_kv_fill_clean(tmp_path: Path) -> None:
    """The KV fill on a clean small-KV-pool server: the last prompts' hits survive the evictions
    of the oldest and equal cold."""
    with probe_server(cell_for(*EXTRA, options=(("kv_pool", "small"),)), tmp_path, fault=None, strict=False) as s:
        rows = kv_fill_hits(s.client)
        idle = kv_fill_then_idle(s.client)[MAMBA_USED_TOKENS]
    assert idle == 0 and any(r.cached_tokens > 0 for r in rows) and not diverged(rows), (idle, summary(rows))


def test_kv_fault_is_missed_with_the_default_kv_pool(tmp_path: Path) -> None:
    """The same fill and fault with the kit's default KV pool (8192 tokens): 6400 tokens fit,
    no KV shortfall, the hook never fires, the hits equal cold and no slot is counted twice."""
    with probe_server(cell_for(*EXTRA), tmp_path, fault="kv_evict_frees_cached_mamba_slot", strict=False) as s:
        rows = kv_fill_hits(s.client)
        idle = kv_fill_then_idle(s.client)[MAMBA_USED_TOKENS]
        fired = s.fired("kv_evict_frees_cached_mamba_slot")
    assert fired == 0 and idle == 0 and any(r.cached_tokens > 0 for r in rows) and not diverged(rows), (fired, idle, summary(rows))
