"""An in-process stand-in for an SGLang server (no HTTP) that the runner tests drive, plus
a recorder/replayer so recorded responses (tests/data/checks/*.json) replay through the
real runner code. Its cache hits come from the prefix oracle; its "model" is a fixed
deterministic function of the last tokens, so cold and cached runs agree unless a fault
perturbs the logits of requests that hit the cache (``hit_noise``) or leaks pool slots.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from conformance.checks.prefix_oracle import PrefixOracle

DATA = Path(__file__).parent / "data" / "checks"


class FakeSGLang:
    def __init__(
        self,
        *,
        vocab: int = 48,
        chunk: int = 16,
        track: int = 32,
        strategy: str = "extra_buffer",
        hit_noise: float = 0.0,
        cache: bool = True,
        leak_per_session: int = 0,
        step_s: float = 0.0,
    ):
        self.vocab, self.hit_noise, self.cache, self.step_s = vocab, hit_noise, cache, step_s
        self.oracle = PrefixOracle(strategy, chunk, 1, track)
        self.leaked = 0
        self.leak_per_session = leak_per_session
        self.running = 0
        self.sessions: dict[str, bool] = {}
        self.opened = 0
        self.aborted: set[str] = set()
        self._lock = threading.Lock()

    # -- the "model" -------------------------------------------------------
    def logprobs(self, seq: list[int], noisy: bool) -> list[float]:
        h = (seq[-1] * 7 + (seq[-2] if len(seq) > 1 else 0) * 13 + len(seq) * 3) % 97
        logits = [3.0 * math.sin(0.37 * h + 1.3 * j) for j in range(self.vocab)]
        if noisy:
            logits = [x + self.hit_noise * math.cos(0.9 * j + h) for j, x in enumerate(logits)]
        m = max(logits)
        z = m + math.log(sum(math.exp(x - m) for x in logits))
        return [x - z for x in logits]

    def _top(self, lp: list[float], k: int) -> list[list]:
        order = sorted(range(len(lp)), key=lambda j: -lp[j])[:k]
        return [[lp[j], j, None] for j in order]

    def _one(self, toks: list[int], sp: dict, payload: dict) -> dict:
        cached = self.oracle.expected_hit(toks) if self.cache else 0
        noisy = cached > 0 and self.hit_noise > 0
        seq, out, out_lp, out_top = list(toks), [], [], []
        k = int(payload.get("top_logprobs_num", 0) or 0)
        rid = payload.get("rid")
        finish = "length"
        self.running += 1
        try:
            for _ in range(int(sp.get("max_new_tokens", 16))):
                if rid is not None and rid in self.aborted:
                    finish = "abort"
                    break
                lp = self.logprobs(seq, noisy)
                tok = max(range(self.vocab), key=lambda j: lp[j])
                out.append(tok)
                out_lp.append([lp[tok], tok, None])
                out_top.append(self._top(lp, k))
                seq.append(tok)
                if self.step_s:
                    time.sleep(self.step_s)
        finally:
            self.running -= 1
        meta: dict[str, Any] = {"cached_tokens": cached, "prompt_tokens": len(toks), "finish_reason": {"type": finish}}
        if payload.get("return_logprob"):
            meta["output_token_logprobs"] = out_lp
            meta["output_top_logprobs"] = out_top
            if payload.get("logprob_start_len") == 0:
                rows, tops = [[None, toks[0], None]], [None]
                for i in range(1, len(toks)):
                    lp = self.logprobs(toks[:i], False)
                    rows.append([lp[toks[i]], toks[i], None])
                    tops.append(self._top(lp, k))
                meta["input_token_logprobs"], meta["input_top_logprobs"] = rows, tops
        if self.cache:
            self.oracle.record_request(toks, out)
        return {"text": "", "output_ids": out, "meta_info": meta}

    # -- SGLangClient's surface --------------------------------------------
    def generate(self, payload: dict, *, timeout: float | None = None) -> Any:
        if "text" in payload:
            texts = payload["text"] if isinstance(payload["text"], list) else [payload["text"]]
            outs = [{"text": f" {len(t) % 7} + 1 = {len(t) % 7 + 1}.\n#### {len(t) % 7 + 1}", "meta_info": {"cached_tokens": 0}} for t in texts]
            return outs if isinstance(payload["text"], list) else outs[0]
        ids = payload["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        seqs = ids if batch else [ids]
        sps = payload.get("sampling_params", {})
        sps = sps if isinstance(sps, list) else [sps] * len(seqs)
        with self._lock:
            outs = [self._one(list(s), sp, payload) for s, sp in zip(seqs, sps)]
        return outs if batch else outs[0]

    def generate_stream(self, payload: dict, *, timeout: float | None = None):
        """SSE chunks as SGLang sends them: cumulative ``completion_tokens``, the finish
        reason only on the last chunk; an abort by rid ends the stream with ``abort``."""
        toks, sp, rid = list(payload["input_ids"]), payload.get("sampling_params", {}), payload.get("rid")
        self.running += 1
        try:
            out, finish = [], "length"
            for _ in range(int(sp.get("max_new_tokens", 16))):
                if rid is not None and rid in self.aborted:
                    finish = "abort"
                    break
                lp = self.logprobs(toks + out, False)
                out.append(max(range(self.vocab), key=lambda j: lp[j]))
                if self.step_s:
                    time.sleep(self.step_s)
                yield {"text": "", "output_ids": list(out), "meta_info": {"completion_tokens": len(out), "cached_tokens": 0, "finish_reason": None}}
        finally:
            self.running -= 1
        yield {"text": "", "output_ids": list(out), "meta_info": {"completion_tokens": len(out), "cached_tokens": 0, "finish_reason": {"type": finish}}}

    def flush_cache(self) -> None:
        """As SGLang 0.5.23: a flush rebuilds the free lists, so leaked slots read free after it."""
        self.oracle.flush()
        self.leaked = 0

    def server_info(self) -> dict:
        return {"disable_radix_cache": not self.cache}

    def metrics(self) -> dict[str, float]:
        busy = float(self.running)
        return {
            "sglang:mamba_used_tokens": busy * 3 + self.leaked,
            "sglang:kv_used_tokens": busy * 40,
            "sglang:num_running_reqs": busy,
        }

    def wait_gauges(self, names, *, want: float = 0.0, deadline_s: float = 1.0, poll_s: float = 0.01):
        start = time.monotonic()
        while True:
            m = self.metrics()
            last = {n: m.get(n, float("nan")) for n in names}
            if all(v == want for v in last.values()) or time.monotonic() - start >= deadline_s:
                return all(v == want for v in last.values()), last, time.monotonic() - start
            time.sleep(poll_s)

    def open_session(self, capacity_of_str_len: int, *, session_id=None, streaming=None, timeout=None) -> str:
        self.opened += 1
        sid = session_id or f"s{self.opened}"
        self.sessions[sid] = bool(streaming)
        return sid

    def close_session(self, session_id: str) -> None:
        self.sessions.pop(session_id)
        self.leaked += self.leak_per_session

    def abort_request(self, rid: str) -> None:
        self.aborted.add(rid)


class Recorder:
    """Wraps a client and keeps every call with its answer (a transcript)."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)

        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.calls.append({"method": name, "args": list(args), "response": out})
            return out

        return call


class Replayer:
    """Answers calls from a transcript, checking each call matches the recorded one."""

    def __init__(self, calls: list[dict]):
        self.calls, self.pos = calls, 0

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            rec = self.calls[self.pos]
            self.pos += 1
            assert rec["method"] == name, f"call {self.pos}: expected {rec['method']}, got {name}"
            assert json.loads(json.dumps(list(args))) == rec["args"], f"call {self.pos} ({name}): arguments differ from the recording"
            return rec["response"]

        return call


def load_transcript(name: str) -> list[dict]:
    return json.loads((DATA / name).read_text())


def test_fake_cold_and_cached_runs_agree_without_fault():
    fake = FakeSGLang()
    prompt = list(range(3, 40))
    first = fake.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
    second = fake.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}})
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 32  # the prefill checkpoint at the grid
    assert first["output_ids"] == second["output_ids"]


def test_fake_hit_noise_changes_only_cached_runs():
    fake = FakeSGLang(hit_noise=2.0)
    prompt = list(range(3, 40))
    req = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "top_logprobs_num": 3}
    cold = fake.generate(req)["meta_info"]["output_token_logprobs"]
    hit = fake.generate(req)["meta_info"]["output_token_logprobs"]
    assert cold != hit


def test_replayer_refuses_a_call_that_differs_from_the_recording():
    rec = Recorder(FakeSGLang())
    rec.flush_cache()
    rep = Replayer(json.loads(json.dumps(rec.calls)))
    try:
        rep.server_info()
    except AssertionError as e:
        assert "expected flush_cache" in str(e)
    else:
        raise AssertionError("the replayer accepted a call that is not in the recording")
