"""The reference target's PD mode end to end on the toy model (real processes over
loopback): the clean PD unit matches the non-PD server exactly and leaks nothing; a seeded
PD fault (the prefill ships a state from one token too early) is caught by the KL check;
the roles refuse requests that did not come through the router; everything is torn down."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from conformance.checks.disagg import disagg_verdict
from conformance.checks.kl import kl_verdict
from conformance.checks.leaks import leak_verdict
from conformance.client import SGLangClient
from conformance.suites.disagg.record import probe_both, record_pd_logprobs
from conformance.errors import KitError, ServerStartError
from conformance.matrix.cells import load_matrix
from conformance.reference.faults import FAULT_ENV
from conformance.reference.pd import PD_FAULT_ENV, Shipment, pack, read_faults, unpack
from conformance.sglang_contract.metric_names import KV_USED_TOKENS, MAMBA_USED_TOKENS, PD_PENDING_TRANSFERS
from conformance.targets.disagg import serve_pd
from conformance.targets.pd_launch import PDPorts, reference_pd_spec
from conformance.targets.launcher import live_servers
from conformance.targets.reference_launch import start_reference
from conformance.workloads.prompts import token_prompts

REFERENCE = SimpleNamespace(target="reference")
GAUGES = (MAMBA_USED_TOKENS, KV_USED_TOKENS, PD_PENDING_TRANSFERS)
LENGTHS = [65, 100, 129, 200]  # around the toy model's chunk of 64


def _cell(strategy: str):
    return next(c for c in load_matrix().cells if c.strategy.name == strategy and c.fault.name == "none" and c.page_size == 1 and c.track_interval == 256)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    sp, url = start_reference(tmp_path_factory.mktemp("base"), "--model", "toy", "--strategy", "extra_buffer")
    with SGLangClient(url) as client:
        yield client
    sp.stop()


@pytest.fixture(scope="module")
def clean_pd(tmp_path_factory):
    cell = _cell("extra_buffer")
    spec = reference_pd_spec(cell, ports=PDPorts.pick(), model="toy")
    with serve_pd(cell, REFERENCE, log_dir=tmp_path_factory.mktemp("pd"), spec=spec) as pd:
        yield pd


def _kl(pd, baseline):
    prompts = token_prompts(LENGTHS, vocab_size=57, seed=5)
    rec = record_pd_logprobs(pd.router, baseline, prompts, new_tokens=6, top_k=3, vocab_size=57)
    return kl_verdict(rec, chunk=64, track_interval=256, exact=True)


def test_clean_pd_unit_matches_the_non_pd_server_exactly(clean_pd, baseline):
    verdict = disagg_verdict([_kl(clean_pd, baseline)])
    assert verdict.status == "pass", verdict.summary()
    assert verdict.metrics["hit_fraction"] == 1.0 and verdict.metrics["greedy_mismatch_fraction"] == 0.0
    assert verdict.metrics["topk_kl_mean"] < 1e-9


def test_clean_pd_unit_is_idle_on_both_servers_after_load(clean_pd):
    prompts = token_prompts(LENGTHS, vocab_size=57, seed=6)
    out = clean_pd.router.generate({"input_ids": [list(p) for p in prompts], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert [len(r["output_ids"]) for r in out] == [5] * len(prompts)
    probes = probe_both(clean_pd, "after load", requests=len(prompts), gauges=GAUGES)
    merged = clean_pd.router.metrics()
    assert merged[PD_PENDING_TRANSFERS] == 0.0 and MAMBA_USED_TOKENS in merged
    verdict = leak_verdict(probes, log_text="\n".join(clean_pd.log_texts().values()), alive=clean_pd.alive(), require_load_evidence=False, gauges=GAUGES)
    assert verdict.status == "pass", verdict.summary()
    assert set(clean_pd.log_paths()) == {"prefill", "decode", "router"}


def test_router_answers_text_batches_and_keeps_prefill_cache_hits(clean_pd):
    clean_pd.router.flush_cache()
    prompt = [3 + i % 50 for i in range(130)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    first = clean_pd.router.generate(body)
    again = clean_pd.router.generate({**body, "input_ids": prompt + [7, 8]})
    assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == 128  # the prefill's chunk-floored hit
    texts = clean_pd.router.generate({"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert isinstance(texts, list) and len(texts) == 2
    info = clean_pd.router.server_info()
    assert info["disaggregation_mode"] == "router" and info["decode_server_info"]["disable_radix_cache"] is True


def test_roles_refuse_requests_that_bypass_the_router(clean_pd):
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(KitError, match="needs bootstrap_room"):
        clean_pd.decode.generate(body)
    with pytest.raises(KitError, match="no state was received for bootstrap_room 42"):
        clean_pd.decode.generate({**body, "bootstrap_room": 42})
    with pytest.raises(KitError, match="must be a list exactly when"):
        clean_pd.prefill.generate({**body, "bootstrap_room": [1]})
    resp = httpx.post(clean_pd.decode.base_url + "/pd/transfer", content=b"not a state", timeout=10)
    assert resp.status_code == 400 and "malformed state transfer" in resp.text


def test_seeded_pd_fault_is_caught(tmp_path, baseline):
    cell = _cell("no_buffer")
    spec = reference_pd_spec(cell, ports=PDPorts.pick(), model="toy", role_env={"prefill": {FAULT_ENV: "pd_state_off_by_one"}})
    with serve_pd(cell, REFERENCE, log_dir=tmp_path, spec=spec) as pd:
        assert pd.prefill.server_info()["seeded_pd_fault"] == "pd_state_off_by_one"
        verdict = disagg_verdict([_kl(pd, baseline)])
    assert verdict.status == "fail", verdict.summary()
    assert verdict.reason.startswith("kl: ") and "differ" in verdict.reason


def test_a_failed_start_tears_every_process_down(tmp_path):
    cell = _cell("no_buffer")
    spec = reference_pd_spec(cell, ports=PDPorts.pick(), model="no-such-model")
    before = len(live_servers())
    with pytest.raises(ServerStartError, match="exited during start-up"):
        with serve_pd(cell, REFERENCE, log_dir=tmp_path, spec=spec):
            pass
    assert len(live_servers()) == before
    assert (tmp_path / f"{cell.id}-pd-prefill.log").exists() and (tmp_path / f"{cell.id}-pd-decode.log").exists()


# ------------------------------------------------------------------ in-process pieces
def test_state_transfer_round_trips_and_garbage_is_one_line():
    s = Shipment(7, 3, {"kv": torch.arange(4.0)}, torch.zeros(5), 2)
    back = unpack(pack(s))
    assert (back.room, back.prompt_len, back.first_token) == (7, 3, 2) and torch.equal(back.state["kv"], torch.arange(4.0))
    with pytest.raises(KitError, match="malformed state transfer"):
        unpack(b"garbage")


def test_pd_fault_is_read_in_one_place():
    faults, pd_fault = read_faults({FAULT_ENV: "pd_state_off_by_one"})
    assert pd_fault == "pd_state_off_by_one" and faults.name is None
    faults, pd_fault = read_faults({FAULT_ENV: "double_free", PD_FAULT_ENV: "pd_state_off_by_one"})
    assert pd_fault == "pd_state_off_by_one" and faults.name == "double_free"
    assert read_faults({FAULT_ENV: "double_free"})[1] is None
    with pytest.raises(KitError, match="unknown PD fault 'nope' in HYBRID_CONFORMANCE_PD_FAULT"):
        read_faults({PD_FAULT_ENV: "nope"})
