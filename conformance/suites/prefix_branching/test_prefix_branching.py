"""Prefix-branching suite: generated trees (branch points at, one before and one after chunk
and track boundaries; concurrent siblings; eviction pressure); observed ``cached_tokens``
against the prefix oracle, and outputs on a hit against cold outputs; multi-turn chains
(each turn extends the previous turn's prompt + output) judged the same way, turn by turn.
On a cell whose
eviction policy (or small KV pool) the kit models, which stored prefix the first KV
eviction gave up, against the policy's order (``conformance/checks/eviction_order.py``).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conformance.matrix import axes
from conformance.checks.eviction_order import Tlru, eviction_order_verdict, scenario, tlru_stored_len
from conformance.checks.prefix_branching import prefix_branching_verdict
from conformance.programs.evidence import REQUESTS_SUFFIX
from conformance.session.suite_support import branch_points_skipped, exact_mode, grids, lookahead, oracle_for, settle, sizes_for, vocab_size
from conformance.targets.registry import target_for
from conformance.workloads.prompts import token_prompts
from conformance.workloads.runners import generate_tokens, output_ids, record_tree
from conformance.workloads.trees import BranchTree, branching_tree, multi_turn_tree

pytestmark = pytest.mark.prefix_branching

SHAPES = {
    "sequential": dict(concurrent=False),
    "concurrent_then_eviction_pressure": dict(concurrent=True),
}


def _pressure(endpoint, shape: str, chunk: int) -> dict:
    """Enough short filler prompts to overflow the mamba pool (each stores one state)."""
    if shape == "sequential":
        return dict(pressure=0)
    slots = int(endpoint.info.get("max_mamba_cache_size") or 64)
    return dict(pressure=min(slots + 8, 160), pressure_len=chunk + 2)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_branching_tree(endpoint, shape, record_verdict):
    cell = endpoint.cell
    size = sizes_for(endpoint)
    chunk, grid = grids(cell)
    tree = branching_tree(
        chunk=chunk,
        track_interval=grid,
        vocab_size=vocab_size(endpoint),
        fanout=size.tree_fanout,
        depth=size.tree_depth,
        max_new_tokens=size.tree_new_tokens,
        seed=len(shape),
        **SHAPES[shape],
        **_pressure(endpoint, shape, chunk),
    )
    settle(record_verdict(_tree_verdict(endpoint, tree)))


def test_multi_turn_reuse(endpoint, record_verdict):
    """Each turn of a chain extends the previous turn's prompt + output: its hit is what the
    tree kept of the turn before, judged against the prefix oracle turn by turn, so a stored
    prefix not reused across turns (answers right, hits lower) fails here, not only when the
    programs happen to draw a follow-up."""
    chunk, grid = grids(endpoint.cell)
    tree = multi_turn_tree(chunk=chunk, track_interval=grid, vocab_size=vocab_size(endpoint), max_new_tokens=sizes_for(endpoint).tree_new_tokens)
    settle(record_verdict(_tree_verdict(endpoint, tree)))


def _tree_verdict(endpoint, tree: BranchTree):
    """Play ``tree`` on the cell's server and judge its hits and outputs."""
    size = sizes_for(endpoint)
    recording = record_tree(endpoint.client, tree, top_k=0 if exact_mode(endpoint) else size.top_k)
    verdict = prefix_branching_verdict(
        recording,
        oracle_for(endpoint),
        lookahead=lookahead(endpoint),
        chunked_prefill_size=endpoint.info.get("chunked_prefill_size") or None,
        exact=exact_mode(endpoint),
        kl_cap=endpoint.cell.model.thresholds.kl_abs_cap,
    )
    skipped = branch_points_skipped(endpoint)  # the release's own rule, said in the report
    return replace(verdict, details={**verdict.details, "no_branch_point_states": skipped}) if skipped else verdict


#: The eviction-order scenario's prompt length (a multiple of every track grid; far below the context).
EVICTION_PROMPT = 1024


def test_kv_eviction_follows_the_policy(endpoint, record_verdict):
    """Prompts sharing no prefix stored one at a time past the KV pool (the server's own
    ``max_total_num_tokens``), the first one with a high request priority and hit twice; the
    first stored state a KV-asked eviction walk freed must be the one the cell's policy ranks
    lowest (per-node evidence from the observe plugin)."""
    if not axes.enabled(endpoint.cell, axes.EVICTION_ORDER):
        pytest.skip("eviction order: only on a cell with a modelled eviction policy or the small KV pool")
    plugin_log = target_for(endpoint).engine.plugin_log(endpoint.log_path)
    if plugin_log is None:
        pytest.skip("eviction order: needs the observe plugin's per-node eviction records (real SGLang)")
    kv = int(endpoint.info.get("max_total_num_tokens") or 0)
    if kv <= 0:
        pytest.skip("eviction order: the server does not say how big its KV pool is (max_total_num_tokens)")
    policy = axes.value_of(endpoint.cell, "eviction").name
    tlru = Tlru(axes.TLRU_THRESHOLD, axes.TLRU_NEXT_PROMPT_ESTIMATE) if policy == "tlru" else None
    stored = scenario(kv, EVICTION_PROMPT, tlru_stored_len(tlru, endpoint.cell.page_size) if tlru else None)
    prompts = dict(zip((s.name for s in stored), token_prompts([s.length for s in stored], vocab_size=vocab_size(endpoint), seed=31)))
    endpoint.client.flush_cache()
    path = plugin_log.with_suffix(REQUESTS_SUFFIX)
    start = path.stat().st_size if path.exists() else 0
    sequences = {}
    for s in stored:
        for _ in range(s.sends):
            (resp,) = generate_tokens(endpoint.client, [prompts[s.name]], 1, priority=s.priority)
        sequences[s.name] = (*prompts[s.name], *output_ids(resp))
    data = path.read_bytes()
    # the server's start line (are its per-node hooks in place?), then what the scenario caused
    head = [r for r in (json.loads(line) for line in data[:start].splitlines() if line.strip()) if r.get("ev") == "start"][-1:]
    records = head + [json.loads(line) for line in data[start:].splitlines() if line.strip()]
    settle(record_verdict(eviction_order_verdict(policy, stored, sequences, records, tlru=tlru)))
