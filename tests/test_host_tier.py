"""The HiCache host tier on CPU: the stand-ins for SGLang's GPU-only host-pool copies (against
the layouts SGLang's host pools use) and the ``hicache`` check on recordings."""

from __future__ import annotations

import pytest
import torch

from conformance.checks.host_tier import host_reload_verdict
from conformance.errors import KitError
from conformance.recordings import HostReloadRecording, KLRecording
from conformance.records import Verdict
from conformance.sglang_plugins.cpu import hicache_ops
from conformance.workloads.host_tier import HostTierSizes, tier_tokens


def test_mamba_state_round_trip_through_a_page_first_host_pool() -> None:
    layers = [torch.randn(10, 3, 4) for _ in range(3)]  # device: one [slots, ...] tensor per layer
    host = torch.zeros(6, 3, 1, 3, 4)  # host page-first: [slots, layers, 1, ...]
    hicache_ops.transfer_kv_all_layer_direct_lf_pf(layers, [host], torch.tensor([7, 2]), torch.tensor([1, 4]), 1)
    assert torch.equal(host[1, :, 0], torch.stack([t[7] for t in layers]))
    assert torch.equal(host[4, :, 0], torch.stack([t[2] for t in layers]))
    assert not host[0].any() and not host[5].any()
    back = [torch.zeros(10, 3, 4) for _ in range(3)]
    for layer in range(3):
        hicache_ops.transfer_kv_per_layer_direct_pf_lf([host], [back[layer]], torch.tensor([1, 4]), torch.tensor([0, 9]), layer, 1)
    for layer in range(3):
        assert torch.equal(back[layer][0], layers[layer][7]) and torch.equal(back[layer][9], layers[layer][2])
        assert not back[layer][1:9].any()


def test_paged_kv_round_trip_keeps_k_and_v_apart() -> None:
    k = [torch.randn(16, 2, 3) for _ in range(2)]
    v = [torch.randn(16, 2, 3) for _ in range(2)]
    hk, hv = torch.zeros(5, 2, 2, 2, 3), torch.zeros(5, 2, 2, 2, 3)  # [pages, layers, page_size, heads, dim]
    hicache_ops.transfer_kv_all_layer_direct_lf_pf(k + v, [hk, hv], torch.tensor([4, 5, 10, 11]), torch.tensor([2, 3, 6, 7]), 2)
    assert torch.equal(hk[1, 0], k[0][4:6]) and torch.equal(hk[3, 1], k[1][10:12]) and torch.equal(hv[3, 1], v[1][10:12])
    dk, dv = torch.zeros(16, 2, 3), torch.zeros(16, 2, 3)
    hicache_ops.transfer_kv_per_layer_direct_pf_lf([hk, hv], [dk, dv], torch.tensor([2, 3, 6, 7]), torch.tensor([0, 1, 8, 9]), 1, 2)
    assert torch.equal(dk[8:10], k[1][10:12]) and torch.equal(dv[0:2], v[1][4:6]) and not dk[2:8].any()


def test_layer_first_copy_and_mismatched_indices() -> None:
    src, dst = [torch.arange(12.0).reshape(6, 2)], [torch.zeros(6, 2)]
    hicache_ops.transfer_kv_direct(src, dst, torch.tensor([5, 0]), torch.tensor([1, 2]), 1)
    assert dst[0][1].tolist() == [10.0, 11.0] and dst[0][2].tolist() == [0.0, 1.0] and not dst[0][3:].any()
    with pytest.raises(ValueError, match="2 source indices, 1 destination"):
        hicache_ops.transfer_kv_direct(src, dst, torch.tensor([5, 0]), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="page size 2"):
        hicache_ops.transfer_kv_all_layer_direct_lf_pf(src, dst, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]), 2)
    assert hicache_ops.cuda_host_register(torch.zeros(4)) is None


def test_the_bindings_name_sglang_homes_of_both_host_pools() -> None:
    targets = {b.target for b in hicache_ops.BINDINGS}
    for pool in ("mha", "mamba"):
        for name in ("transfer_kv_direct", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_per_layer_direct_pf_lf"):
            assert f"sglang.srt.mem_cache.pool_host.{pool}.{name}" in targets
    assert "sglang.srt.mem_cache.pool_host.common._cuda_host_register" in targets


def test_the_host_memory_reserve_is_overridden_where_every_release_binds_it() -> None:
    """SGLang's 10 GiB reserve lives in ``pool_host.base`` (0.5.15+) or ``memory_pool_host``
    (0.5.11-0.5.14), and 0.5.17's ``pool_host.mha`` imports it by name: each is a home."""
    (reserve,) = [b for b in hicache_ops.BINDINGS if b.how == "override"]
    assert reserve.impl == hicache_ops.HOST_MEMORY_RESERVE_BYTES < 10 * 1024**3
    assert {h for h, _ in reserve.homes} == {f"sglang.srt.mem_cache.{m}.HICACHE_HOST_MEMORY_RESERVE_BYTES"
                                             for m in ("pool_host.base", "memory_pool_host", "pool_host.mha")}


def _rec(device, host, stored=(100, 130)) -> HostReloadRecording:
    return HostReloadRecording(tuple(stored), tuple(device), tuple(host), KLRecording(()), (60, 160))


PASSED_KL = Verdict("kl", "pass", {"max_kl": 0.0})
IDLE = {"hybrid_conformance:host_kv_used": 900.0, "hybrid_conformance:host_mamba_used": 60.0}
EMPTY = {"hybrid_conformance:host_kv_used": 0.0, "hybrid_conformance:host_mamba_used": 0.0}


def test_host_hits_covering_every_stored_prefix_with_cold_answers_pass() -> None:
    v = host_reload_verdict(_rec((0, 30), (100, 100)), PASSED_KL, IDLE, EMPTY)
    assert v.status == "pass" and v.metrics["host_tokens"] == 200 and v.metrics["host_hit_requests"] == 2
    assert v.metrics["kl_max_kl"] == 0.0 and v.details["per_request"][1] == {"stored": 130, "device": 30, "host": 100}


def test_device_hits_only_refuse_to_pass() -> None:
    v = host_reload_verdict(_rec((100, 130), (0, 0)), PASSED_KL, IDLE, EMPTY)
    assert v.status == "fail" and "no request was served from the host tier" in v.reason


def test_a_stored_prefix_not_reused_fails() -> None:
    v = host_reload_verdict(_rec((0, 0), (100, 64)), PASSED_KL, IDLE, EMPTY)
    assert v.status == "fail" and "1/2 stored prefixes not reused" in v.reason and "64 of 130" in v.reason
    assert host_reload_verdict(_rec((0, 0), (0, 0), stored=(0, 0)), PASSED_KL, IDLE, EMPTY).reason.startswith("the warmed prompts store no prefix")


def test_answers_differing_from_cold_fail_and_a_kl_skip_is_no_pass() -> None:
    v = host_reload_verdict(_rec((0, 0), (100, 130)), Verdict("kl", "fail", {}, "top-k KL 1.3 > limit 1e-9"), IDLE, EMPTY)
    assert v.status == "fail" and "differ from cold: top-k KL 1.3" in v.reason
    v = host_reload_verdict(_rec((0, 0), (100, 130)), Verdict("kl", "skip", {}, "radix cache disabled"), IDLE, EMPTY)
    assert v.status == "skip" and "radix cache disabled" in v.reason


def test_pressure_overflows_the_device_tier_inside_the_host_tier() -> None:
    sizes = HostTierSizes.from_server_info({"max_total_num_tokens": 8192, "max_mamba_cache_size": 48, "hicache_ratio": 2.0})
    count, length = sizes.pressure(1500)
    assert count > 48 and count * length > 8192 and count * (length + 1) + 1500 < 2 * 8192
    with pytest.raises(KitError, match="cannot hold the pressure"):
        HostTierSizes(8192, 48, 1.0).pressure(1500)
    with pytest.raises(KitError, match="lacks the pool sizes"):
        HostTierSizes.from_server_info({"max_mamba_cache_size": 48})


def test_tier_tokens_read_sglangs_breakdown() -> None:
    assert tier_tokens({"meta_info": {"cached_tokens_details": {"device": 3, "host": 64}}}) == (3, 64)
    assert tier_tokens({"meta_info": {"cached_tokens": 5}}) == (0, 0)


def test_a_host_pool_holding_slots_after_a_flush_fails_and_missing_gauges_refuse() -> None:
    v = host_reload_verdict(_rec((0, 0), (100, 130)), PASSED_KL, IDLE, {**EMPTY, "hybrid_conformance:host_mamba_used": 2.0})
    assert v.status == "fail" and "host pool not empty after /flush_cache at idle: hybrid_conformance:host_mamba_used = 2" in v.reason
    assert v.metrics["idle_host_kv_used"] == 900.0 and v.metrics["after_flush_host_mamba_used"] == 2.0
    v = host_reload_verdict(_rec((0, 0), (100, 130)), PASSED_KL, IDLE, {})
    assert v.status == "fail" and "no host-tier gauge after /flush_cache" in v.reason
