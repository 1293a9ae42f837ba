"""The reference server as a real subprocess on 127.0.0.1 (toy model): SGLang's routes,
bad input as 4xx while it keeps serving, concurrency without leaks, faults seen over HTTP."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import httpx
import pytest
import torch

from conformance.reference.drive import make_req, output_logprobs, run
from conformance.reference.engine import Engine, EngineConfig
from conformance.reference.toy_model import load_toy
from conformance.targets.reference_launch import read_metric, start_reference

torch.set_num_threads(1)
TIMEOUT = httpx.Timeout(60.0)


def start_server(tmp_path, *args: str, env: dict | None = None):
    return start_reference(tmp_path, *args, env=env)


def metric(text: str, name: str) -> float:
    value = read_metric(text, name)
    assert value is not None, f"{name} missing from /metrics"
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sp, url = start_server(tmp_path_factory.mktemp("srv"), "--model", "toy", "--strategy", "extra_buffer")
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as client:
            yield client
    finally:
        sp.stop()


def gen(client, ids, n=8, **kw):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **kw}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_twice_hits_and_matches(server):
    ids = [random.Random(0).randrange(3, 50) for _ in range(300)]
    a = gen(server, ids, return_logprob=True)
    b = gen(server, ids, return_logprob=True)
    assert a["meta_info"]["cached_tokens"] == 0 and b["meta_info"]["cached_tokens"] == 256
    assert a["output_ids"] == b["output_ids"]
    lp = lambda r: [e[0] for e in r["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert lp(a) == pytest.approx(lp(b), abs=1e-5)
    assert server.post("/flush_cache").status_code == 200
    assert metric(server.get("/metrics").text, "sglang:mamba_used_tokens") == 0


def test_logprob_fields_and_batch(server):
    out = server.post("/generate", json={"text": ["abc def", "ghi"], "return_logprob": True, "logprob_start_len": 0,
                                         "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert out.status_code == 200
    first = out.json()[0]
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == 7 and meta["completion_tokens"] == len(first["output_ids"])
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 7
    assert len(meta["output_top_logprobs"][0]) == 2 and meta["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.parametrize("body, status", [
    (b'{"text": "abc"', 400),
    (b'[1, 2]', 400),
    (b'{"text": ""}', 400),
    (b'{"input_ids": []}', 400),
    (b'{"input_ids": "abc"}', 400),
    (b'{"input_ids": [1, -2]}', 400),
    (b'{"input_ids": [1, 99999]}', 400),
    (b'{"text": "a", "sampling_params": {"max_new_tokens": -1}}', 400),
    (b'{"text": "a", "sampling_params": {"temperature": "hot"}}', 400),
    (b'{"text": "a", "input_ids": [3]}', 400),
    (b'{"text": "abc", "return_logprob": true, "logprob_start_len": 10}', 400),
    (b'{"text": "a", "session_params": {"id": "missing"}}', 400),
])
def test_bad_input_is_a_4xx_json_error_and_server_keeps_serving(server, body, status):
    r = server.post("/generate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert r.json()["error"]["message"]
    assert server.get("/health").status_code == 200


def test_input_longer_than_context_is_rejected(server):
    r = server.post("/generate", json={"input_ids": [5] * 4100, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_server_info_and_metrics_names(server):
    info = server.get("/server_info").json()
    assert (info["mamba_radix_cache_strategy"], info["page_size"], info["mamba_track_interval"],
            info["disable_radix_cache"]) == ("extra_buffer", 1, 256, False)
    text = server.get("/metrics").text
    for name in ("sglang:mamba_usage", "sglang:mamba_available_tokens", "sglang:mamba_evictable_tokens",
                 "sglang:mamba_used_tokens", "sglang:kv_used_tokens", "sglang:num_running_reqs",
                 "sglang:cached_tokens_total", "sglang:mamba_pingpong_peak_slots"):
        metric(text, name)


def test_openai_completions_echo_logprobs(server):
    r = server.post("/v1/completions", json={"model": "toy", "prompt": "hello there", "max_tokens": 2,
                                             "temperature": 0, "logprobs": 1, "echo": True})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("hello there")
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == 13


def test_streaming_session_round_trip(server):
    sid = server.post("/open_session", json={"capacity_of_str_len": 1000, "streaming": True}).json()
    t1 = server.post("/generate", json={"input_ids": [7] * 50, "session_params": {"id": sid},
                                        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).json()
    t2 = server.post("/generate", json={"input_ids": [8] * 5, "session_params": {"id": sid},
                                        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).json()
    assert t2["meta_info"]["cached_tokens"] == 50 + 4 - 1 and t2["meta_info"]["prompt_tokens"] == 59
    assert t1["meta_info"]["cached_tokens"] == 0
    assert metric(server.get("/metrics").text, "sglang:mamba_used_tokens") == 3  # held by the session
    assert server.post("/close_session", json={"session_id": sid}).status_code == 200
    assert server.post("/flush_cache").status_code == 200
    assert metric(server.get("/metrics").text, "sglang:mamba_used_tokens") == 0


def test_32_concurrent_shared_prefix_requests_match_cold_and_leave_no_leak(server):
    rng = random.Random(4)
    stem = [rng.randrange(3, 50) for _ in range(200)]
    prompts = [stem + [rng.randrange(3, 50) for _ in range(rng.randrange(5, 120))] for _ in range(32)]

    async def fire():
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=TIMEOUT, trust_env=False) as c:
            bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                       "return_logprob": True} for p in prompts]
            return await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))

    gen(server, stem, 2)
    replies = [r.json() for r in asyncio.run(fire())]
    cold = run(Engine(load_toy(), EngineConfig(strategy="extra_buffer", disable_radix_cache=True)),
               [make_req(p, 6) for p in prompts])
    assert sum(r["meta_info"]["cached_tokens"] > 0 for r in replies) >= 16
    for r, c in zip(replies, cold):
        assert r["output_ids"] == c.output_ids
        assert [e[0] for e in r["meta_info"]["output_token_logprobs"]] == pytest.approx(output_logprobs(c), abs=1e-5)
    assert server.post("/flush_cache").status_code == 200
    text = server.get("/metrics").text
    assert metric(text, "sglang:mamba_used_tokens") == 0 and metric(text, "sglang:kv_used_tokens") == 0
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("args, needle", [
    (["--model", "nope"], "unknown model"),
    (["--model", "toy", "--strategy", "fast"], "unknown strategy"),
    (["--model", "toy", "--strategy", "no_buffer", "--page-size", "64"], "no_buffer requires --page-size 1"),
    (["--model", "toy", "--strategy", "extra_buffer", "--page-size", "64", "--track-interval", "100"], "page_size"),
    (["--model", "toy", "--page-size", "x"], "invalid int value"),
])
def test_refused_start_is_one_line_and_exit_2(args, needle):
    proc = subprocess.run([sys.executable, "-m", "conformance.reference.server", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_leak_fault_kills_scheduler_over_http(tmp_path):
    sp, url = start_server(tmp_path, "--model", "toy", "--strategy", "extra_buffer",
                           env={"HYBRID_CONFORMANCE_FAULT": "pingpong_leak_on_finish"})
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as c:
            gen(c, [5] * 100, 3)
            for _ in range(100):  # the idle check runs right after the request
                if c.get("/health").status_code == 503:
                    break
                asyncio.run(asyncio.sleep(0.05))
            assert c.get("/health").status_code == 503
            assert c.post("/generate", json={"input_ids": [5, 6]}).status_code == 503
        assert "pool memory leak detected! [mamba] total=64" in sp.log_text()
    finally:
        sp.stop()


def test_silent_leak_fault_is_visible_in_metrics_only(tmp_path):
    sp, url = start_server(tmp_path, "--model", "toy", "--strategy", "no_buffer",
                           env={"HYBRID_CONFORMANCE_FAULT": "idle_check_disabled_with_leak"})
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as c:
            gen(c, [5] * 100, 3)
            assert c.get("/health").status_code == 200
            assert metric(c.get("/metrics").text, "sglang:mamba_used_tokens") > 0  # visible at idle
            # ... and hidden by a flush, as on SGLang (the free lists are rebuilt)
            assert c.post("/flush_cache").status_code == 200
            assert metric(c.get("/metrics").text, "sglang:mamba_used_tokens") == 0
    finally:
        sp.stop()
