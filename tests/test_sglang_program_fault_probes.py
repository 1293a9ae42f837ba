"""Direct probes of the real-SGLang faults written for the request programs (the last six
modules of ``conformance/sglang_plugins/faults/catalogue.FAULT_MODULES``): each does real
damage on a real SGLang server on CPU, shown with raw numbers, and the same scenario on a
clean server shows none.  One ``sglang-cpu`` server per probe and control (marker
``fault_probe``: deselected by default, ``-m fault_probe`` runs them)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from sglang_cpu_probes import MAMBA_USED_TOKENS, cell_for, fresh_idle_metrics, hit_vs_cold, probe_server, prompts, summary, tail

from conformance.workloads.runners import cached_tokens, generate_tokens, output_ids

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(1800)]

EXTRA = ("qwen3-next", "extra_buffer")
LAZY = ("qwen3-next", "extra_buffer_lazy")
NO_BUFFER = ("qwen3-next", "no_buffer")


def identical_batch_then_idle(client) -> float:
    """Four identical 130-token prompts in one batch: each checkpoints 128 (one insert, three duplicates)."""
    (p,) = prompts((130,), seed=21)
    generate_tokens(client, [p] * 4, 2)
    return fresh_idle_metrics(client)[MAMBA_USED_TOKENS]


def two_boundary_decode_hits(client):
    """A decode from 250 to 520 tracks 256 and 512; prompt + output + 5 hits 512."""
    warm = prompts((250,), seed=22)
    return hit_vs_cold(client, [warm], [tail(5, "older")], warm_new=270, follow_output=True)


def input_logprobs_past_start(client) -> tuple[int, int]:
    """(input logprobs returned, asked) for P + Z with logprob_start_len=50 after P was cached."""
    (p,) = prompts((200,), seed=23)
    client.flush_cache()
    generate_tokens(client, [p], 1)
    seq = list(p + tail(10, "lp"))
    resp = client.generate({"input_ids": seq, "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}, "return_logprob": True,
                            "logprob_start_len": 50, "return_text_in_logprobs": False}, timeout=120)
    client.flush_cache()
    return len(resp["meta_info"].get("input_token_logprobs") or []), len(seq) - 50


def finishes_on_boundaries_then_idle(client) -> float:
    """Requests whose last decode step lands on, or one off, the 256 track boundary."""
    for n, new in ((250, 7), (251, 6), (249, 8), (248, 9), (252, 5)):
        generate_tokens(client, prompts((n,), seed=24 + n), new)
    return fresh_idle_metrics(client)[MAMBA_USED_TOKENS]


@dataclass(frozen=True)
class StopHit:
    cached: int
    committed: int
    diverged: bool


def stop_then_follow_up(client) -> StopHit:
    """P stops on a token of its own output; P + output + 5 then hits its finish insert."""
    (p,) = prompts((80,), seed=25)
    client.flush_cache()
    (free,) = generate_tokens(client, [p], 12)
    out = output_ids(free)
    stop = next(t for j, t in enumerate(out) if j >= 3 and t not in out[:j])
    client.flush_cache()
    stopped = client.generate({"input_ids": list(p), "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": False,
                                                                        "stop_token_ids": [stop]}}, timeout=120)
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop", stopped["meta_info"]["finish_reason"]
    got = output_ids(stopped)
    follow = p + got + tail(5, "stop")
    (hit,) = generate_tokens(client, [follow], 6, top_k=1)
    client.flush_cache()
    (cold,) = generate_tokens(client, [follow], 6, top_k=1)
    client.flush_cache()
    diff = max(abs(a[0] - b[0]) for a, b in zip(hit["meta_info"]["output_token_logprobs"], cold["meta_info"]["output_token_logprobs"]))
    return StopHit(int(hit["meta_info"]["cached_tokens"]), len(p) + len(got) - 1, output_ids(hit) != output_ids(cold) or diff > 1e-4)


def turn_after_abort(client) -> tuple[int, int]:
    """(prompt_tokens of the turn after an aborted streaming turn, what SGLang builds: the
    last finished turn + the new input)."""
    sid = client.open_session(65536, streaming=True)

    def turn(i: int, n: int, new: int) -> dict[str, Any]:
        payload = {"input_ids": list(tail(n, f"sa:{i}")), "sampling_params": {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True},
                   "rid": f"{sid}-t{i}", "session_params": {"id": sid}}
        return client.generate(payload, timeout=600)

    try:
        first = turn(0, 150, 8)
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.setdefault("r", turn(1, 10, 3000)), daemon=True)
        worker.start()
        time.sleep(2.0)
        client.abort_request(f"{sid}-t1")
        worker.join(timeout=120)
        assert (box["r"]["meta_info"].get("finish_reason") or {}).get("type") == "abort"
        third = turn(2, 5, 2)
    finally:
        client.close_session(sid)
    return int(third["meta_info"]["prompt_tokens"]), 150 + len(output_ids(first)) + 5


def cut_batch_then_follow_ups(client) -> tuple[int, ...]:
    """Twelve 500-token prompts in one batch request (the prefill batch that takes most of
    them exceeds the 4096-token budget and is cut), then members 3, 5 and 7 again + 5:
    cached_tokens of those follow-ups (their prefill checkpoints sit at 448)."""
    client.flush_cache()
    ps = prompts((500,) * 12, seed=27)
    generate_tokens(client, ps, 1)
    got = tuple(cached_tokens(r) for r in generate_tokens(client, [ps[i] + tail(5, f"cut{i}") for i in (3, 5, 7)], 1))
    client.flush_cache()
    return got


def repeats_then_hits(client) -> tuple[tuple[int, bool], ...]:
    """A 300-token prompt (its checkpoint at 256), then four follow-ups of it + 5 tokens, one
    at a time: (cached_tokens, output equals the cold one) of each follow-up."""
    (p,) = prompts((300,), seed=28)
    client.flush_cache()
    generate_tokens(client, [p], 1)
    follows = [p + tail(5, f"again{i}") for i in range(4)]
    hits = [generate_tokens(client, [f], 3)[0] for f in follows]
    client.flush_cache()
    colds = [generate_tokens(client, [f], 3)[0] for f in follows]
    client.flush_cache()
    return tuple((cached_tokens(h), output_ids(h) == output_ids(c)) for h, c in zip(hits, colds))


@dataclass(frozen=True)
class Probe:
    where: tuple[str, str]
    scenario: Callable[[Any], Any]
    harmed: Callable[[Any], bool]


PROGRAM_PROBES: dict[str, Probe] = {
    "dup_insert_leak": Probe(EXTRA, identical_batch_then_idle, lambda n: n >= 1),
    "older_pingpong_inserted": Probe(EXTRA, two_boundary_decode_hits, lambda rows: any(r.cached_tokens == 512 and r.diverged for r in rows)),
    "logprob_start_ignored": Probe(EXTRA, input_logprobs_past_start, lambda got: got[0] != got[1]),
    "lazy_finish_at_boundary_leak": Probe(LAZY, finishes_on_boundaries_then_idle, lambda n: n >= 1),
    "stop_finish_key_short": Probe(NO_BUFFER, stop_then_follow_up, lambda h: h.cached == h.committed - 1 and h.diverged),
    "session_abort_continues": Probe(EXTRA, turn_after_abort, lambda got: got[0] != got[1]),
    "cut_batch_checkpoint_dropped": Probe(EXTRA, cut_batch_then_follow_ups, lambda hits: any(h < 448 for h in hits)),
    # the answers stay right: harm is a stored state not reused
    "stored_state_not_reused": Probe(EXTRA, repeats_then_hits, lambda rows: all(same for _, same in rows) and any(h < 256 for h, _ in rows)),
}
LEAKS = ("dup_insert_leak", "lazy_finish_at_boundary_leak")


def _describe(value: Any) -> str:
    return summary(value) if isinstance(value, list) else repr(value)


@pytest.mark.parametrize("fault", sorted(PROGRAM_PROBES))
def test_program_fault_harms_real_sglang(fault: str, tmp_path: Path) -> None:
    probe = PROGRAM_PROBES[fault]
    with probe_server(cell_for(*probe.where), tmp_path, fault=fault, strict=fault not in LEAKS) as server:
        value = probe.scenario(server.client)
        assert server.fired(fault) >= 1, f"{fault} never fired: the scenario did not reach it ({_describe(value)})"
    assert probe.harmed(value), f"{fault}: no harm seen: {_describe(value)}"


@pytest.mark.parametrize("fault", sorted(PROGRAM_PROBES))
def test_same_scenario_is_harmless_on_clean_sglang(fault: str, tmp_path: Path) -> None:
    probe = PROGRAM_PROBES[fault]
    with probe_server(cell_for(*probe.where), tmp_path, fault=None, strict=False) as server:
        value = probe.scenario(server.client)
    assert not probe.harmed(value), f"clean SGLang looks harmed by {fault}'s scenario: {_describe(value)}"
