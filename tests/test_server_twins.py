"""The "done when" checks of the reference server on every tiny twin under every strategy:
a 300-token prompt posted twice hits the cache the second time with identical output_ids
and logprobs, and ``sglang:mamba_used_tokens`` is 0 at idle after a flush.  (No_buffer
caches no branch points and keys the prompt state at the full prompt length, so an
identical prompt cannot hit there, as in SGLang; its hit is checked on a continuation.)
These start 12 servers: about two minutes on two cores."""

from __future__ import annotations

import random

import httpx
import pytest

from conformance.reference.model import known_twins
from conformance.targets.reference_launch import read_metric, start_reference

TIMEOUT = httpx.Timeout(120.0)

STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")


def gen(client, ids, n=8, **kw):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **kw}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("twin", known_twins())
def test_twin_prompt_twice(tmp_path, twin, strategy):
    sp, url = start_reference(tmp_path, "--model", twin, "--strategy", strategy)
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as c:
            info = c.get("/server_info").json()
            vocab, chunk = info["vocab_size"], info["mamba_cache_chunk_size"]
            ids = [random.Random(1).randrange(3, vocab) for _ in range(300)]
            a = gen(c, ids, return_logprob=True)
            b = gen(c, ids, return_logprob=True)
            lp = lambda r: [e[0] for e in r["meta_info"]["output_token_logprobs"]]  # noqa: E731
            assert a["output_ids"] == b["output_ids"]
            assert lp(a) == pytest.approx(lp(b), abs=1e-5)
            assert a["meta_info"]["cached_tokens"] == 0
            if strategy == "no_buffer":
                assert b["meta_info"]["cached_tokens"] == 0
                longer = ids + [5, 6, 7]
                hot = gen(c, longer, return_logprob=True)
                assert hot["meta_info"]["cached_tokens"] == 300
            else:
                assert b["meta_info"]["cached_tokens"] == 300 // chunk * chunk > 0
                longer = ids + a["output_ids"] + [5, 6, 7]
                hot = gen(c, longer, return_logprob=True)
            assert c.post("/flush_cache").status_code == 200
            cold = gen(c, longer, return_logprob=True)
            assert cold["meta_info"]["cached_tokens"] == 0
            assert hot["output_ids"] == cold["output_ids"]
            assert lp(hot) == pytest.approx(lp(cold), abs=1e-5)
            assert c.post("/flush_cache").status_code == 200
            assert read_metric(c.get("/metrics").text, "sglang:mamba_used_tokens") == 0
            assert c.get("/health").status_code == 200
    finally:
        sp.stop()
