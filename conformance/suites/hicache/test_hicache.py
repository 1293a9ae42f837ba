"""HiCache suite (cells of the ``hicache`` cache variant): prefixes stored, pushed out of the
device tier, then served again from SGLang's host tier (``workloads.host_tier``), judged by
``checks.host_tier``: host-tier hits reported and covering every stored prefix, answers
equal to cold (exact on float32 CPU twins), both host pools empty after the idle probe's
flush, and the idle invariant before any flush after the workload (the idle probe every
suite leaves; the leaks suite and the cell's teardown judge it).  A cell without a host tier is a stated skip, never a pass, and starts nothing.
"""

from __future__ import annotations

import pytest

from conformance.checks.host_tier import CHECK, host_reload_verdict
from conformance.checks.kl import NOISE_FACTOR, kl_verdict
from conformance.records import Verdict
from conformance.session.suite_support import exact_mode, grids, idle_deadline, note_idle_probe, oracle_for, settle, sizes_for, vocab_size
from conformance.targets.sglang_cpu import HICACHE_FLAG
from conformance.workloads.host_tier import HostTierSizes, record_host_reload
from conformance.session.suite_support import idle_probe
from conformance.workloads.prompts import prefill_hit_lengths, token_prompts

pytestmark = pytest.mark.hicache
SEED = 31


def test_host_tier_reload(cell, request, record_verdict):
    if HICACHE_FLAG not in cell.cache_variant.args:
        settle(record_verdict(Verdict(CHECK, "skip", reason=f"not applicable: cache variant {cell.cache_variant.name!r} has no host tier ({HICACHE_FLAG})")))
    endpoint = request.getfixturevalue("endpoint")
    size = sizes_for(endpoint)
    chunk, grid = grids(cell)
    prompts = token_prompts(prefill_hit_lengths(chunk, grid, n=size.kl_prompts, max_len=size.kl_max_len), vocab_size=vocab_size(endpoint), seed=SEED)
    rec = record_host_reload(
        endpoint.client, prompts, HostTierSizes.from_server_info(endpoint.info), oracle_for(endpoint),
        vocab_size=vocab_size(endpoint), new_tokens=size.kl_new_tokens, top_k=size.top_k,
        chunked_prefill_size=endpoint.info.get("chunked_prefill_size") or None,
    )
    probe = note_idle_probe(endpoint, idle_probe(endpoint.client, "hicache: host-tier reload", requests=len(prompts), deadline_s=idle_deadline(endpoint)))
    th = cell.model.thresholds
    kl = kl_verdict(
        rec.kl, chunk=chunk, track_interval=grid, k3_max=th.kl_k3_max, floor_factor=th.kl_floor_factor,
        abs_cap=th.kl_abs_cap, hit_fraction_min=th.hit_fraction_min, exact=exact_mode(endpoint), noise_factor=NOISE_FACTOR,
    )
    settle(record_verdict(host_reload_verdict(rec, kl, probe.values, probe.after_flush)))
