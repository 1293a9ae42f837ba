"""Leaks suite (server targets): SGLang's idle invariant after a burst larger than the pool
and after session scenarios (judged before any flush), a clean server log, a live process,
the occupancy timeline, resident track slots per running request against each strategy's
contract and the lazy claim against the extra_buffer sibling, and the aborted session turns.
Every other suite's scenario also leaves an idle probe on the endpoint (plugin); the cell's
teardown fails if any of them did not reach idle.
"""

from __future__ import annotations

import pytest

from conformance.matrix import axes
from conformance.checks.leaks import TrackSlotUse, leak_verdict, track_slot_use, track_slot_verdict
from conformance.checks.tree_structure import audits_vacuous, tree_findings
from conformance.errors import ServerDiedError
from conformance.programs.evidence import request_log
from conformance.sglang_contract.metric_names import KIT_TREE_AUDITS_TOTAL
from conformance.records import merge
from conformance.session.suite_support import grids, idle_deadline, note_idle_probe, settle, sizes_for, vocab_size
from conformance.targets.registry import target_for
from conformance.workloads.cell_store import CellStore, sibling_key
from conformance.session.suite_support import idle_probe
from conformance.workloads.prompts import token_prompts
from conformance.workloads.runners import generate_tokens, record_sessions, sample_occupancy
from conformance.workloads.sessions import first_turn_abort_script, leak_session_scripts

pytestmark = pytest.mark.leaks

#: Decode steps each burst request runs past the track boundary its prompt sits before.
PAST_BOUNDARY = 6


def _burst_load(endpoint):
    """One burst, the same for every strategy of a model: more requests than the mamba pool
    holds (the server says how big it is), all on one cached prefix, each prompt ending
    just before a decode track boundary so every request decodes across it (where lazy
    takes its second slot).  Admissions beyond the pool wait or fail after their match and
    must give back what they took."""
    size = sizes_for(endpoint)
    _, grid = grids(endpoint.cell)
    slots = int(endpoint.info.get("max_mamba_cache_size") or 0)
    burst = min(slots + 4, 96) if slots else size.load_requests
    new_tokens = max(size.load_new_tokens, 2 * PAST_BOUNDARY)
    (prefix,) = token_prompts([grid - new_tokens + PAST_BOUNDARY - 2], vocab_size=vocab_size(endpoint), seed=21)
    tails = token_prompts([2] * burst, vocab_size=vocab_size(endpoint), seed=22)
    prompts = [prefix + t for t in tails]
    generate_tokens(endpoint.client, [prefix], 1)  # cache the shared prefix first
    return len(prompts), lambda: generate_tokens(endpoint.client, prompts, new_tokens)


#: The KV fill: prompts of this many tokens stored one at a time, in all this much more than
#: the server's KV pool holds; then a burst of short prompts whose requests take every free
#: Mamba slot (a slot released behind the tree's back is then reused).
KV_FILL_PROMPT, KV_FILL_FACTOR, KV_FILL_BURST = 400, 1.4, (100,) * 8


def _kv_fill_load(endpoint):
    """Stored prompts worth ``KV_FILL_FACTOR`` x the server's KV pool (its own
    ``max_total_num_tokens``): from about the pool's size on, each store evicts under KV
    pressure (``evict_for_alloc`` with a token shortfall); then the burst."""
    kv = int(endpoint.info.get("max_total_num_tokens") or 0)
    if kv <= 0:
        pytest.skip("kv pressure: the server does not say how big its KV pool is (max_total_num_tokens)")
    n = int(kv * KV_FILL_FACTOR) // KV_FILL_PROMPT + 1
    stored = token_prompts([KV_FILL_PROMPT] * n, vocab_size=vocab_size(endpoint), seed=23)
    burst = token_prompts(list(KV_FILL_BURST), vocab_size=vocab_size(endpoint), seed=24)
    for p in stored:
        generate_tokens(endpoint.client, [p], 4)
    generate_tokens(endpoint.client, burst, 4)
    return n + len(burst), kv


def _overlap(endpoint) -> bool:
    """Whether the server's track-slot contract is SGLang's with the overlap scheduler on.
    The reference engine decodes without lookahead (it reports the overlap scheduler off)
    but holds the track slots SGLang holds with it on (the matrix's ``ping_pong_slots``)."""
    return target_for(endpoint).engine.track_slot_overlap(endpoint.cell, endpoint.info)


def test_load_returns_to_idle(endpoint, cell_store: CellStore, record_verdict):
    cell = endpoint.cell
    endpoint.client.flush_cache()
    sent, load = _burst_load(endpoint)
    timeline, _ = sample_occupancy(endpoint.client, load)
    probe = note_idle_probe(endpoint, idle_probe(endpoint.client, f"burst of {sent} requests on one cached prefix", requests=sent, deadline_s=idle_deadline(endpoint)))
    cell_store.save_timeline(cell, timeline)
    use = track_slot_use(timeline)
    if use is not None and cell.fault.name == "none":
        cell_store.save("track_slots", cell, use.to_json())
    raw = cell_store.load("track_slots", sibling_key(cell, cell.strategy.eager.name)) if cell.strategy.lazy else None
    verdicts = [
        leak_verdict([probe], log_text=endpoint.log_text(), alive=endpoint.alive(), timeline=timeline, tree=tree_audit(endpoint, probe.values)),
        track_slot_verdict(cell.strategy, use, overlap=_overlap(endpoint), eager=TrackSlotUse(**raw) if raw else None),
    ]
    settle(record_verdict(merge("leaks", verdicts)))


def tree_audit(endpoint, values) -> list:
    """The tree audit's findings on this cell's server so far (``checks.tree_structure``): each
    violation the observe plugin recorded, or ``vacuous`` when a server that audits ran none;
    none on a target without the kit's plugins."""
    log = request_log(endpoint.log_path, target=endpoint.target)
    if log is None:
        return []
    return tree_findings(log.tree_violations[:5]) + audits_vacuous(values.get(KIT_TREE_AUDITS_TOTAL, 0))


def test_kv_pressure_returns_to_idle(endpoint, record_verdict):
    """A cell with the small KV pool (``kv_pool = small``, conformance.matrix.axes): store more prompt
    KV than the pool holds, one prompt at a time, then a burst; the idle invariant after it.
    Only those cells: the default pools are sized so the other suites never run KV short."""
    if not axes.enabled(endpoint.cell, axes.KV_PRESSURE):
        pytest.skip("kv pressure: only on a cell with the small KV pool (kv_pool = small)")
    endpoint.client.flush_cache()
    sent, kv = _kv_fill_load(endpoint)
    probe = note_idle_probe(endpoint, idle_probe(endpoint.client, f"{sent} requests storing {KV_FILL_FACTOR} x the KV pool ({kv} tokens)",
                                                 requests=sent, deadline_s=idle_deadline(endpoint)))
    settle(record_verdict(leak_verdict([probe], log_text=endpoint.log_text(), alive=endpoint.alive(), require_load_evidence=False)))


def test_sessions_return_to_idle(endpoint, record_verdict):
    size = sizes_for(endpoint)
    _, grid = grids(endpoint.cell)
    scripts = (*leak_session_scripts(vocab_size=vocab_size(endpoint), track_interval=grid, turns=max(3, size.session_turns)),
               first_turn_abort_script(vocab_size=vocab_size(endpoint), track_interval=grid))
    # streaming sessions only where the cell's server takes them (the sessions axis, conformance.matrix.axes)
    scripts = tuple(s for s in scripts if not s.streaming or axes.enabled(endpoint.cell, axes.STREAMING_SESSIONS))
    endpoint.client.flush_cache()
    errors: list[str] = []
    probes = []

    def after_abort(turn) -> None:  # the sessions stay open: judge the invariant with their holdings, no flush
        probes.append(idle_probe(endpoint.client, f"after aborting {turn.session} turn {turn.turn}", requests=1, flush=False, deadline_s=idle_deadline(endpoint)))

    recording = None
    try:
        recording = record_sessions(endpoint.client, scripts, after_abort=after_abort)
        errors += list(recording.errors)
        sent = recording.requests
    except Exception as e:  # a failing scenario is a finding, judged below with the gauges
        errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        sent = 1
    try:
        probes.append(idle_probe(endpoint.client, "sessions (streaming + non-streaming, abort, first-turn abort, branch)", requests=sent, deadline_s=idle_deadline(endpoint)))
    except ServerDiedError as e:  # the scheduler died in the sessions (e.g. SGLang's idle leak check): judged below from its log
        errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    for p in probes:
        note_idle_probe(endpoint, p)
    verdict = leak_verdict(
        probes,
        log_text=endpoint.log_text(),
        alive=endpoint.alive(),
        require_load_evidence=False,
        scenario_errors=errors,
        sessions=recording,
    )
    settle(record_verdict(verdict))


def test_every_scenario_of_the_cell_returned_to_idle(endpoint, record_verdict):
    """The idle probes other suites left on this cell's endpoint so far (see plugin)."""
    probes = list(endpoint.extra.get("idle_probes", []))
    if not probes:
        pytest.skip("no scenario of this cell has run yet: the cell teardown probe covers the rest")
    verdict = leak_verdict(probes, log_text=endpoint.log_text(), alive=endpoint.alive(), require_load_evidence=False)
    settle(record_verdict(verdict))
