"""Direct probes of the HiCache faults of real SGLang (``conformance/sglang_plugins/faults/hicache_*``):
each starts the qwen3-next ``hicache`` cell on ``sglang-cpu`` (SGLang's host tier on CPU,
``--enable-hierarchical-cache``) with the fault, runs the host-tier workload
(``workloads.host_tier``) and shows the raw damage: the answers on host-tier hits are not
the cold answers.  The control runs the clean cell: host-tier hits reported, every stored
prefix reused, the same tokens as cold, both host pools empty after a flush.

One real SGLang server per probe: ``fault_probe`` only (deselected by default, see
tests/conftest.py); the kit's own catch of each fault is
``hybrid-conformance mutants --target sglang-cpu --only <fault>``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_cpu_probes import probe_server

from conformance.checks.host_tier import host_reload_verdict
from conformance.checks.kl import kl_verdict
from conformance.matrix.cells import Cell, load_matrix
from conformance.sglang_plugins.faults.catalogue import in_group
from conformance.workloads.host_tier import HostTierSizes, record_host_reload
from conformance.workloads.idle import idle_probe
from conformance.workloads.prompts import prefill_hit_lengths, token_prompts
from conformance.checks.prefix_oracle import PrefixOracle

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(1200)]
HICACHE_FAULTS = in_group("hicache")


def _hicache_cell() -> Cell:
    for cell in load_matrix().cells:
        if cell.model.family == "qwen3-next" and cell.cache_variant.name == "hicache" and "sglang-cpu" in cell.targets and cell.page_size == 1:
            return cell
    raise LookupError("no sglang-cpu hicache cell for qwen3-next in the matrix")


def _reload(tmp_path: Path, fault: str | None):
    cell = _hicache_cell()
    with probe_server(cell, tmp_path, fault=fault) as server:
        info = server.client.server_info()
        vocab = int(info.get("vocab_size") or 512)
        prompts = token_prompts(prefill_hit_lengths(cell.grid.chunk, cell.grid.track_grid, n=4, max_len=600), vocab_size=vocab, seed=31)
        oracle = PrefixOracle(cell.strategy, cell.grid.chunk, cell.page_size, cell.track_interval)
        rec = record_host_reload(server.client, prompts, HostTierSizes.from_server_info(info), oracle, vocab_size=vocab,
                                 chunked_prefill_size=info.get("chunked_prefill_size") or None)
        probe = idle_probe(server.client, "hicache probe", requests=len(prompts))
    kl = kl_verdict(rec.kl, chunk=cell.grid.chunk, track_interval=cell.grid.track_grid, exact=True)
    return host_reload_verdict(rec, kl, probe.values, probe.after_flush)


@pytest.mark.parametrize("fault", list(HICACHE_FAULTS))
def test_hicache_fault_does_damage_on_real_sglang(fault: str, tmp_path: Path) -> None:
    verdict = _reload(tmp_path, fault)
    assert verdict.status == "fail" and "differ from cold" in verdict.reason, verdict.summary()


def test_control_hicache_clean(tmp_path: Path) -> None:
    verdict = _reload(tmp_path, None)
    assert verdict.status == "pass" and verdict.metrics["host_hit_requests"] > 0, verdict.summary()
