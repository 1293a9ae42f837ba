"""Helpers for the direct probes of seeded real-SGLang faults (``test_sglang_fault_probes``)
and the cross-target leak test: start one real SGLang server on CPU for a matrix cell,
with a fault and SGLang's strict idle check chosen by the test, and read what it did.

A probe is deliberately not a kit check: it shows the damage with the rawest numbers
(a slot count at idle, a logprob difference between a hit and a cold run, a
``cached_tokens`` value), so that a check later catching the fault is known to catch
real harm.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from conformance.checks.leaks import is_idle
from conformance.client import SGLangClient
from conformance.matrix.cells import Cell, load_matrix
from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.sglang_contract.metric_names import KIT_IDLE_PUBLISH_SEQ, MAMBA_USED_TOKENS
from conformance.sglang_plugins.activation import FAULT_PLUGIN, REPORT_ENV, read_report
from conformance.targets.launcher import ServerProcess, free_port
from conformance.targets.plugin_proof import check_plugins
from conformance.targets.sglang_cpu import SGLangCpuTarget
from conformance.workloads.runners import generate_tokens, output_ids, served_logprobs, warm_beside_a_decode

STRICT_ENV = "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"
EXTRA_BUFFER_QWEN = ("qwen3-next", "extra_buffer")


def require_sglang() -> None:
    """Skip (never pass) with the cause when real SGLang cannot be imported here."""
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()


def cell_for(family: str, strategy: str, fault: str = "none", options: tuple[tuple[str, str], ...] = ()) -> Cell:
    """The page-1 sglang-cpu cell of that family, strategy and cell fault, with exactly these
    server-option axis values (none: the plain cell)."""
    for cell in load_matrix().cells:
        if (cell.model.family == family and cell.strategy.name == strategy and cell.fault.name == fault and "sglang-cpu" in cell.targets
                and cell.page_size == 1 and tuple(cell.options) == tuple(options)):
            return cell
    raise LookupError(f"no sglang-cpu cell for {family}/{strategy}/{fault} in the matrix")


@dataclass
class ProbeServer:
    cell: Cell
    client: SGLangClient
    process: ServerProcess
    report: Path

    def fired(self, fault: str) -> int:
        """How often the fault changed SGLang's behaviour (its highest reported count)."""
        counts = [int(r.get("count", 0)) for r in read_report(self.report) if r.get("status") == "fired" and r.get("fault") == fault]
        return max(counts, default=0)

    def log(self) -> str:
        return self.process.log_text()


@contextlib.contextmanager
def probe_server(cell: Cell, tmp_path: Path, *, fault: str | None = None, strict: bool = True) -> Iterator[ProbeServer]:
    """A healthy real SGLang server for ``cell`` with SGLang fault ``fault`` (or none) and
    SGLang's strict idle memory check on or off; killed on exit however the test ends."""
    require_sglang()
    saved = os.environ.pop(SGLANG_FAULT_ENV, None)
    if fault:
        os.environ[SGLANG_FAULT_ENV] = fault
    try:
        target = SGLangCpuTarget()
        spec = target.launch_spec(cell, port=free_port())
    finally:
        os.environ.pop(SGLANG_FAULT_ENV, None)
        if saved is not None:
            os.environ[SGLANG_FAULT_ENV] = saved
    env = dict(spec.env)
    env[STRICT_ENV] = "1" if strict else "0"
    report = tmp_path / f"{cell.id}.plugins.jsonl"
    env[REPORT_ENV] = str(report)
    if fault:
        assert env.get(SGLANG_FAULT_ENV) == fault and FAULT_PLUGIN in spec.plugins
    proc = ServerProcess(name=f"probe server {cell.id}", argv=spec.argv, env=env, health_url=spec.base_url + spec.health_path, log_path=tmp_path / f"{cell.id}.log", start_timeout_s=spec.start_timeout_s,
                         preimport_env=spec.env if spec.preimport else None)
    proc.start()
    client = SGLangClient(spec.base_url, liveness=proc.exit_reason)
    try:
        check_plugins(proc.name, report, spec.plugins, proc.log_path)
        yield ProbeServer(cell, client, proc, report)
    finally:
        client.close()
        proc.stop()


def fresh_idle_metrics(client: SGLangClient, *, timeout_s: float = 30.0) -> dict[str, float]:
    """Gauges published while idle (the observe plugin's sequence advanced twice), read
    before any flush."""
    seq0 = client.metrics().get(KIT_IDLE_PUBLISH_SEQ, 0.0)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        values = client.metrics()
        if is_idle(values) and values.get(KIT_IDLE_PUBLISH_SEQ, 0.0) >= seq0 + 2:
            return values
        time.sleep(0.25)
    raise AssertionError(f"no fresh idle sample within {timeout_s:.0f}s: {client.metrics()}")


def mamba_used_at_idle(client: SGLangClient) -> float:
    return fresh_idle_metrics(client)[MAMBA_USED_TOKENS]


@dataclass(frozen=True)
class HitVsCold:
    """One prompt served on a cache hit and again cold (flushed cache)."""

    cached_tokens: int
    hit_tokens: tuple[int, ...]
    cold_tokens: tuple[int, ...]
    max_logprob_diff: float

    @property
    def diverged(self) -> bool:
        return self.hit_tokens != self.cold_tokens or self.max_logprob_diff > 1e-4


def hit_vs_cold(
    client: SGLangClient,
    warm: Sequence[Sequence[Sequence[int]]],
    served: Sequence[Sequence[int]],
    *,
    warm_new: int = 0,
    new_tokens: int = 8,
    follow_output: bool = False,
    beside_a_decode: bool = False,
    reasoning: bool = False,
) -> list[HitVsCold]:
    """Warm the cache with each batch of ``warm`` in turn (``warm_new`` decoded tokens per
    request), serve ``served`` (one batch) on whatever it hits -- appended to the last warm
    batch's prompts and outputs when ``follow_output`` (a decode hit) -- then serve the same
    inputs again after a flush; per prompt: cached tokens, both outputs, and the largest
    chosen-token logprob difference.  ``reasoning``: the warm requests ask for reasoning
    (``require_reasoning``)."""
    client.flush_cache()
    last: list[Any] = []
    for batch in warm:
        if beside_a_decode:  # each prompt prefilled while a decode runs: a mixed-chunk server mixes them
            warm_beside_a_decode(client, batch, vocab_size=VOCAB)
            continue
        last = generate_tokens(client, batch, warm_new, reasoning=reasoning)
    if follow_output:
        served = [tuple(p) + output_ids(r) + tuple(s) for p, r, s in zip(warm[-1], last, served)]
    hit = generate_tokens(client, served, new_tokens, top_k=1)
    client.flush_cache()
    cold = generate_tokens(client, served, new_tokens, top_k=1)
    client.flush_cache()
    out = []
    for h, c in zip(hit, cold):
        lh, lc = served_logprobs(h), served_logprobs(c)
        diff = max((abs(a - b) for a, b in zip(lh.logprobs, lc.logprobs)), default=0.0)
        out.append(HitVsCold(int(h["meta_info"].get("cached_tokens", 0)), output_ids(h), output_ids(c), diff))
    return out


def skip_unless(condition: bool, why: str) -> None:
    if not condition:
        pytest.skip(why)


def summary(rows: Sequence[HitVsCold]) -> str:
    return "; ".join(f"cached={r.cached_tokens} maxdiff={r.max_logprob_diff:.2e} tokens_equal={r.hit_tokens == r.cold_tokens}" for r in rows)


def as_dict(values: Any) -> dict[str, float]:
    return {k: v for k, v in values.items() if k.startswith(("sglang:mamba", "sglang:kv", "hybrid_conformance:"))}


# ------------------------------------------------------------------ scenarios
VOCAB = 1000


def prompts(lengths: Sequence[int], seed: int) -> list[tuple[int, ...]]:
    from conformance.workloads.prompts import token_prompts

    return token_prompts(lengths, vocab_size=VOCAB, seed=seed)


def tail(n: int, seed: str) -> tuple[int, ...]:
    from conformance.workloads.prompts import extension

    return extension(n, vocab_size=VOCAB, seed=seed)


#: Batched prefills whose lengths are not chunk multiples (every row but the first starts
#: off the chunk grid), plus lengths on and one past the grid (64 and 128 divide them).
BATCH_LENGTHS = (300, 200, 150, 260)
GRID_LENGTHS = (256, 257, 384, 385)


def batch_then_idle(client: SGLangClient) -> dict[str, float]:
    generate_tokens(client, prompts(BATCH_LENGTHS, seed=1), 8)
    return fresh_idle_metrics(client)


def streaming_session_then_idle(client: SGLangClient, turns: int = 2) -> dict[str, float]:
    sid = client.open_session(65536, streaming=True)
    try:
        for i in range(turns):
            payload = {"input_ids": list(tail(150, f"session:{i}")), "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}, "rid": f"{sid}-t{i}", "session_params": {"id": sid}}
            client.generate(payload, timeout=120)
    finally:
        client.close_session(sid)
    return fresh_idle_metrics(client)


def aborted_decode_then_idle(client: SGLangClient, *, after_s: float = 2.0) -> dict[str, float]:
    import threading

    rid = "probe-abort"
    payload = {"input_ids": list(tail(200, "abort")), "sampling_params": {"temperature": 0.0, "max_new_tokens": 3000, "ignore_eos": True}, "rid": rid}
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.setdefault("r", client.generate(payload, timeout=600)), daemon=True)
    worker.start()
    time.sleep(after_s)
    client.abort_request(rid)
    worker.join(timeout=120)
    assert not worker.is_alive(), "aborted request did not return"
    finish = (box["r"].get("meta_info", {}).get("finish_reason") or {}).get("type")
    assert finish == "abort", f"the request was not aborted mid-decode (finish {finish})"
    return fresh_idle_metrics(client)


def decode_across_boundary_then_idle(client: SGLangClient) -> dict[str, float]:
    """Prompts a few tokens short of the 256 track boundary, decoding across it."""
    generate_tokens(client, prompts((250, 245), seed=3), 16)
    return fresh_idle_metrics(client)


def batched_prefill_hits(client: SGLangClient) -> list[HitVsCold]:
    warm = prompts(BATCH_LENGTHS, seed=1)
    return hit_vs_cold(client, [warm], [p + tail(5, f"b{i}") for i, p in enumerate(warm)])


def mixed_prefill_hits(client: SGLangClient) -> list[HitVsCold]:
    """Prefix checkpoints stored from mixed prefill+decode batches (``--enable-mixed-chunk``)."""
    warm = prompts(BATCH_LENGTHS, seed=4)
    return hit_vs_cold(client, [warm], [p + tail(5, f"m{i}") for i, p in enumerate(warm)], beside_a_decode=True)


def cut_prefill_hits(client: SGLangClient) -> list[HitVsCold]:
    """A 200-token prompt prefilled alone on a server that cuts prefills at 96 (the
    ``off-grid`` chunked prefill cell, grid 64: checkpoints at 64 and 160, cuts at 96 and
    192), then prompts sharing 100 and 195 of its tokens hit the cut-prefill checkpoints."""
    (warm,) = prompts((200,), seed=8)
    return hit_vs_cold(client, [[warm]], [warm[:100] + tail(5, "c0"), warm[:195] + tail(5, "c1")])


def sub_chunk_prefill_hits(client: SGLangClient) -> list[HitVsCold]:
    """The 200-token prompt of :func:`cut_prefill_hits` on a server that cuts prefills at 32
    (the ``sub-chunk`` cell, grid 64: no chunk tracks a state, nothing is stored), then
    prompts sharing 100 and 195 of its tokens."""
    return cut_prefill_hits(client)


#: Prompts one token short of the decode track interval (256): the first decode step tracks.
TRACK_EDGE_LENGTHS = (255, 511)


def overlap_edge_hits(client: SGLangClient) -> list[HitVsCold]:
    """Prompts one token short of the track interval, prefilled one at a time: the first decode
    step tracks a state (at 256 / 512) while, under the overlap scheduler, the prefill's
    checkpoint (192 / 448) still waits for its result to donate it; then ``p + 5`` hits it."""
    warm = prompts(TRACK_EDGE_LENGTHS, seed=9)  # four new tokens each: the first decode steps run
    return hit_vs_cold(client, [[p] for p in warm], [p + tail(5, f"o{i}") for i, p in enumerate(warm)], warm_new=4)


#: Five prompts stored one at a time, then a burst of four new ones: each running extra_buffer
#: request holds three Mamba slots, so the burst runs the ``mamba_pool = small`` pool (16) short.
PRESSURE_SOLO, PRESSURE_BURST = (300,) * 5, (300,) * 4


def pressure_hits(client: SGLangClient) -> list[HitVsCold]:
    """The stored prompts and the burst, then hits on all nine (``p + 5``)."""
    solo, burst = prompts(PRESSURE_SOLO, seed=10), prompts(PRESSURE_BURST, seed=11)
    every = list(solo) + list(burst)
    return hit_vs_cold(client, [[p] for p in solo] + [burst], [p + tail(5, f"q{i}") for i, p in enumerate(every)], warm_new=4)


CAP_SOLO, CAP_BURST = (300,) * 2, (300,) * 5


def cap_hits(client: SGLangClient) -> list[HitVsCold]:
    """Two stored prompts, a burst of 5 decoding (past a 16-slot pool's request cap of 3,
    within the default pool's 9), then hits on all seven (within 9 too)."""
    solo, burst = prompts(CAP_SOLO, seed=12), prompts(CAP_BURST, seed=13)
    every = list(solo) + list(burst)
    return hit_vs_cold(client, [[p] for p in solo] + [burst], [p + tail(5, f"m{i}") for i, p in enumerate(every)], warm_new=16)


#: Prompts stored one at a time: 14 x 400 = 5600 tokens of KV, past the ``kv_pool = small``
#: pool (4096) and within the default (8192); 14 stored states fit either Mamba pool.  Then a
#: burst of 8 x 100 tokens (6400 in all: still within the default pool) whose requests take
#: every free Mamba slot (5 each), so a slot freed behind the tree's back is reused.
KV_FILL, KV_BURST = (400,) * 14, (100,) * 8


def kv_fill_hits(client: SGLangClient) -> list[HitVsCold]:
    """The stored prompts (the small KV pool runs short from the 11th: its evictions take the
    oldest), the burst, then hits on the last four stored (``p + 5``)."""
    stored, burst = prompts(KV_FILL, seed=15), prompts(KV_BURST, seed=16)
    last = stored[-4:]
    return hit_vs_cold(client, [[p] for p in stored] + [burst], [p + tail(5, f"k{i}") for i, p in enumerate(last)], warm_new=4)


def kv_fill_then_idle(client: SGLangClient) -> dict[str, float]:
    """The KV fill and burst of :func:`kv_fill_hits`, then the gauges at idle before any flush
    (a slot the tree still names but the allocator took back counts twice there)."""
    client.flush_cache()
    for p in prompts(KV_FILL, seed=15):
        generate_tokens(client, [p], 4)
    generate_tokens(client, prompts(KV_BURST, seed=16), 4)
    return fresh_idle_metrics(client)


def refused_follow_up_hit(client: SGLangClient, *, slack: int = 32, holders: int = 2, new: int = 64) -> tuple[int, int]:
    """The programs' pool-sized ``refuse`` shape by hand: a prompt of 513 tokens stored (its
    state at 512), two streamed holders (ignore_eos, ``new`` tokens each) whose prompts and
    decodes take all the KV pool but that request and ``slack`` tokens, then, once both
    decode, a follow-up of the stored prompt + 64 tokens: it matches 512, cannot fit, waits
    refused until a holder finishes.  Nothing evicts the stored state (the slack holds the
    holders' decodes).  Returns (the follow-up's cached_tokens, the stored prompt's length)."""
    import threading

    from conformance.sglang_contract.metric_names import KIT_KV_TOTAL

    client.flush_cache()
    kv_total = int(client.metrics().get(KIT_KV_TOTAL) or client.server_info()["max_total_num_tokens"])
    stored = prompts([513], seed=41)[0]
    generate_tokens(client, [stored], 2)
    each = (kv_total - (len(stored) + 2) - slack) // holders - new
    started: list[int] = []

    def hold(i: int) -> None:
        body = {"input_ids": list(prompts([each], seed=42 + i)[0]), "stream": True,
                "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
        for j, _ in enumerate(client.generate_stream(body)):
            if j == 1:
                started.append(i)

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(holders)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(started) < holders and time.monotonic() < deadline:
        time.sleep(0.01)
    back = client.generate({"input_ids": list(stored + tail(64, "refused")), "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    for t in threads:
        t.join(timeout=120)
    return int(back["meta_info"]["cached_tokens"]), len(stored)


def priority_fill_held_hit(client: SGLangClient) -> tuple[int, int]:
    """The eviction-order scenario (``conformance/checks/eviction_order.py``): a 1024-token prompt
    sent three times at request priority 10, then priority-0 prompts stored one at a time past the
    server's KV pool (8192: ten of them); then (the held prompt's hit, the last stored prompt's hit),
    each as the prompt + 5 tokens.  The priority policy keeps the held prompt (its evictions take
    the oldest priority-0 prompts): a hit of 1024 or so; LRU gives it up first: 0."""
    from conformance.checks.eviction_order import scenario

    client.flush_cache()
    stored = scenario(int(client.server_info().get("max_total_num_tokens") or 8192), 1024)
    seqs = prompts([1024] * len(stored), seed=31)
    for s, p in zip(stored, seqs):
        for _ in range(s.sends):
            generate_tokens(client, [p], 1, priority=s.priority)
    held, last = (generate_tokens(client, [p + tail(5, f"pr{i}")], 1)[0] for i, p in ((0, seqs[0]), (1, seqs[-1])))
    return int(held["meta_info"]["cached_tokens"]), int(last["meta_info"]["cached_tokens"])


def grid_prefill_hits(client: SGLangClient) -> list[HitVsCold]:
    warm = prompts(GRID_LENGTHS, seed=2)
    return hit_vs_cold(client, [[p] for p in warm], [p + tail(5, f"g{i}") for i, p in enumerate(warm)])


def branch_point_hit(client: SGLangClient) -> list[HitVsCold]:
    """A = P+X, then B = P+Y branches at P's last chunk boundary (192), then C = P+Z hits it."""
    (shared,) = prompts((200,), seed=5)
    a, b, c = (shared + tail(60, f"branch:{k}") for k in "abc")
    return hit_vs_cold(client, [[a], [b]], [c])


#: Prompts whose 16-token decode crosses the track interval (256): the newest state is past them.
REASONING_LENGTHS = (250, 245)


def reasoning_hits(client: SGLangClient) -> list[HitVsCold]:
    """Turn one asks for reasoning and decodes across the 256 boundary (on a strip-thinking
    server only its prompt is cached: the newest state, at 256, is past that key); turn two
    (prompt + output + 5) hits what was stored."""
    warm = prompts(REASONING_LENGTHS, seed=14)
    return hit_vs_cold(client, [warm], [tail(5, f"r{i}") for i in range(len(warm))], warm_new=16, follow_output=True, reasoning=True)


def decode_hits(client: SGLangClient) -> list[HitVsCold]:
    """Turn one decodes across the 256 boundary; turn two (prompt + output + 5) hits it."""
    warm = prompts((250, 245), seed=3)
    return hit_vs_cold(client, [warm], [tail(5, f"d{i}") for i in range(len(warm))], warm_new=16, follow_output=True)


def first_decode_boundary_hits(client: SGLangClient) -> list[HitVsCold]:
    """Turn one's prompt is one token short of the 256 boundary, so its first decode step
    reaches it; turn two (prompt + output + 5) hits the state tracked there (clean: 256)."""
    warm = prompts((255,), seed=4)
    return hit_vs_cold(client, [warm], [tail(5, "first-boundary")], warm_new=4, follow_output=True)


def branch_cached_tokens(client: SGLangClient) -> tuple[int, int]:
    """(cached_tokens reported for B = P+Y after A = P+X, the KV prefix length P)."""
    (shared,) = prompts((200,), seed=6)
    client.flush_cache()
    generate_tokens(client, [shared + tail(60, "ct:a")], 1)
    (resp,) = generate_tokens(client, [shared + tail(60, "ct:b")], 1)
    client.flush_cache()
    return int(resp["meta_info"].get("cached_tokens", 0)), len(shared)


def hits_then_idle(client: SGLangClient) -> dict[str, float]:
    """Warm a batch, serve cache hits on it, then the pools at idle before any flush."""
    client.flush_cache()
    warm = prompts(BATCH_LENGTHS, seed=7)
    generate_tokens(client, warm, 0)
    generate_tokens(client, [p + tail(5, f"h{i}") for i, p in enumerate(warm)], 4)
    return fresh_idle_metrics(client)


def cold_ttfts(client: SGLangClient, n: int = 3) -> list[float]:
    """SGLang's own ``first_token_latency`` of ``n`` cold 300-token prompts, one at a time."""
    from conformance.workloads.perf import stream_one

    out = []
    for i, p in enumerate(prompts([300] * n, seed=31)):
        client.flush_cache()
        out.append(float(stream_one(client, p, 4, timeout=300).meta.get("first_token_latency") or 0.0))
    return out
