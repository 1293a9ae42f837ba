"""Leaks suite (server targets): idle gauges back to 0 after load and after session
scenarios, a clean server log, a live process, the occupancy timeline, and the lazy
resident-slot ratio.  Every other suite's scenario also leaves an idle probe on the
endpoint (plugin); the cell's teardown fails if any of them did not reach idle.
"""

from __future__ import annotations

import dataclasses

import pytest

from conformance.checks.leaks import TRACK_SLOTS_GAUGE, lazy_resident_ratio, leak_verdict
from conformance.suites import grids, idle_deadline, note_idle_probe, settle, sizes_for, vocab_size
from conformance.workloads.cell_store import CellStore, synthetic_eager_timeline
from conformance.workloads.prompts import token_prompts
from conformance.workloads.idle import idle_probe
from conformance.workloads.runners import generate_tokens, record_sessions, sample_occupancy
from conformance.workloads.sessions import leak_session_scripts

pytestmark = pytest.mark.leaks

LAZY_RATIO_MAX = 0.75  # "about half" of extra_buffer's resident ping-pong slots


def _burst_load(endpoint):
    """A burst of requests that all match one cached prefix, sized to exceed the mamba pool
    when the server says how big it is (admissions then fail after their match and must
    give back what they took), else the per-target default."""
    cell = endpoint.cell
    size = sizes_for(endpoint)
    chunk, _ = grids(cell)
    slots = int(endpoint.info.get("max_mamba_cache_size") or 0)
    burst = min(slots // (1 + cell.strategy.ping_pong_slots) + 4, 96) if slots else size.load_requests
    (prefix,) = token_prompts([chunk + 5], vocab_size=vocab_size(endpoint), seed=21)
    tails = token_prompts([2] * burst, vocab_size=vocab_size(endpoint), seed=22)
    prompts = [prefix + t for t in tails]
    generate_tokens(endpoint.client, [prefix], 1)  # cache the shared prefix first
    return len(prompts), lambda: generate_tokens(endpoint.client, prompts, size.load_new_tokens)


def test_load_returns_to_idle(endpoint, cell_store: CellStore, record_verdict):
    cell = endpoint.cell
    endpoint.client.flush_cache()
    sent, load = _burst_load(endpoint)
    timeline, _ = sample_occupancy(endpoint.client, load)
    probe = note_idle_probe(endpoint, idle_probe(endpoint.client, f"burst of {sent} requests on one cached prefix", requests=sent, deadline_s=idle_deadline(endpoint)))
    cell_store.save_timeline(cell, timeline)
    ratio, extra = None, {}
    if cell.strategy.name == "extra_buffer_lazy":
        # Per running request, against extra_buffer's contract of 2 resident slots each: a
        # burst admits more lazy requests than extra_buffer ones, so raw peaks would mislead.
        ratio, how = lazy_resident_ratio(timeline, synthetic_eager_timeline(timeline), gauge=TRACK_SLOTS_GAUGE)
        extra["lazy_ratio_method"] = f"{how} per running request vs 2 (extra_buffer's contract)"
        eager = cell_store.sibling_timeline(cell, "extra_buffer")
        if eager is not None:
            extra["lazy_vs_extra_buffer_cell_peak_ratio"] = lazy_resident_ratio(timeline, eager, gauge=TRACK_SLOTS_GAUGE)[0]
    verdict = leak_verdict(
        [probe],
        log_text=endpoint.log_text(),
        alive=endpoint.alive(),
        timeline=timeline,
        lazy_resident_ratio=ratio,
        lazy_ratio_max=LAZY_RATIO_MAX if ratio is not None else None,
    )
    if extra:
        verdict = dataclasses.replace(verdict, metrics={**verdict.metrics, **extra})
    settle(record_verdict(verdict))


def test_sessions_return_to_idle(endpoint, record_verdict):
    size = sizes_for(endpoint)
    _, grid = grids(endpoint.cell)
    scripts = leak_session_scripts(vocab_size=vocab_size(endpoint), track_interval=grid, turns=max(3, size.session_turns))
    endpoint.client.flush_cache()
    errors: list[str] = []
    try:
        recording = record_sessions(endpoint.client, scripts)
        errors += list(recording.errors)
        sent = recording.requests
    except Exception as e:  # a failing scenario is a finding, judged below with the gauges
        errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        sent = 1
    probe = note_idle_probe(endpoint, idle_probe(endpoint.client, "sessions (streaming + non-streaming, abort, branch)", requests=sent, deadline_s=idle_deadline(endpoint)))
    verdict = leak_verdict(
        [probe],
        log_text=endpoint.log_text(),
        alive=endpoint.alive(),
        require_load_evidence=False,
        scenario_errors=errors,
    )
    settle(record_verdict(verdict))


def test_every_scenario_of_the_cell_returned_to_idle(endpoint, record_verdict):
    """The idle probes other suites left on this cell's endpoint so far (see plugin)."""
    probes = list(endpoint.extra.get("idle_probes", []))
    if not probes:
        pytest.skip("no scenario of this cell has run yet: the cell teardown probe covers the rest")
    verdict = leak_verdict(probes, log_text=endpoint.log_text(), alive=endpoint.alive(), require_load_evidence=False)
    settle(record_verdict(verdict))
