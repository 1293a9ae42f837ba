"""Recording runners: send a workload through a :class:`~conformance.client.SGLangClient`
and return the frozen record its check judges. All requests are greedy; every request
and wait is bounded (the client's timeout, a deadline, a thread join with a timeout).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

from conformance.checks.leaks import TRACK_GAUGES
from conformance.checks.prefix_branching import consecutive_groups
from conformance.client import SGLangClient
from conformance.errors import KitError, ServerDiedError
from conformance.recordings import (
    KLRecording,
    KLSequence,
    OccupancySample,
    SessionRecording,
    TokenLogprobs,
    TopK,
    TreeRecording,
    TreeRequestRecord,
    TurnResult,
)
from conformance.workloads.prompts import extension
from conformance.workloads.sessions import SessionScript
from conformance.workloads.trees import BranchTree
from conformance.sglang_contract.metric_names import KIT_MAMBA_USED_PEAK, KV_USED_TOKENS, MAMBA_PINGPONG_RESIDENT_SLOTS, MAMBA_USED_TOKENS, NUM_RUNNING_REQS

Tokens = tuple[int, ...]
#: Sampled under load.  The observe plugin's busy-window Mamba peak is the load evidence on a release whose
#: own ``mamba_used_tokens`` gauge is never set (0.5.11) or moves only at its log intervals.
OCCUPANCY_GAUGES = (MAMBA_USED_TOKENS, KIT_MAMBA_USED_PEAK, KV_USED_TOKENS, NUM_RUNNING_REQS, MAMBA_PINGPONG_RESIDENT_SLOTS, *TRACK_GAUGES)


# ------------------------------------------------------------------ plumbing
def _sampling(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **extra}


def _batch(client: SGLangClient, payload: dict[str, Any], n: int, timeout: float | None) -> list[dict[str, Any]]:
    if getattr(client, "batches", True) or not isinstance(payload.get("sampling_params"), list):
        out = client.generate(payload, timeout=timeout)
    else:  # one request per prompt, all in flight together (the server batches them)
        singles = [{**payload, "input_ids": ids, "sampling_params": sp} for ids, sp in zip(payload["input_ids"], payload["sampling_params"])]
        with ThreadPoolExecutor(max_workers=max(1, min(len(singles), 32))) as pool:
            out = list(pool.map(lambda p: client.generate(p, timeout=timeout), singles))
    out = out if isinstance(out, list) else [out]
    if len(out) != n:
        raise KitError(f"/generate answered {len(out)} results for a batch of {n}")
    for r in out:
        if not isinstance(r, dict) or "meta_info" not in r:
            raise KitError(f"/generate answered without meta_info: {str(r)[:200]}")
    return out


def generate_tokens(
    client: SGLangClient, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *, top_k: int = 0,
    timeout: float | None = None, reasoning: bool = False, priority: int | None = None, rids: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One batched greedy /generate over token prompts (logprobs when ``top_k`` > 0).
    ``reasoning``: the requests ask for reasoning (SGLang's ``require_reasoning``: until the
    parser's think-end tokens appear, every output token counts as thinking).
    ``priority``: the requests' priority (SGLang's tree keeps it on the paths they insert).
    ``rids``: the requests' ids (the server's per-request records name them)."""
    news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    payload: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": [_sampling(n) for n in news]}
    if rids is not None:
        payload["rid"] = list(rids)
    if reasoning:
        payload["require_reasoning"] = True
    if priority is not None:
        payload["priority"] = priority
    if top_k > 0:
        payload.update({"return_logprob": True, "top_logprobs_num": top_k, "return_text_in_logprobs": False})
    return _batch(client, payload, len(prompts), timeout)


def output_ids(resp: dict[str, Any]) -> Tokens:
    if "output_ids" in resp:
        return tuple(int(t) for t in resp["output_ids"])
    rows = resp["meta_info"].get("output_token_logprobs") or []
    return tuple(int(r[1]) for r in rows)


def cached_tokens(resp: dict[str, Any]) -> int:
    return int(resp["meta_info"].get("cached_tokens", 0) or 0)


def _top(rows: Any) -> TopK:
    return tuple((int(r[1]), float(r[0])) for r in (rows or []) if r is not None and r[0] is not None)


def served_logprobs(resp: dict[str, Any]) -> TokenLogprobs:
    mi = resp["meta_info"]
    rows, tops = mi.get("output_token_logprobs") or [], mi.get("output_top_logprobs") or []
    return TokenLogprobs(tuple(int(r[1]) for r in rows), tuple(float(r[0]) for r in rows), tuple(_top(t) for t in tops))


def prefill_logprobs(client: SGLangClient, seqs: Sequence[Sequence[int]], starts: Sequence[int], *, top_k: int, timeout: float | None = None) -> list[TokenLogprobs]:
    """Flush, then prefill whole sequences cold (``logprob_start_len=0``); logprobs from ``starts``."""
    client.flush_cache()
    payload = {
        "input_ids": [list(s) for s in seqs],
        "sampling_params": _sampling(0),
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": top_k,
        "return_text_in_logprobs": False,
    }
    out = []
    for seq, start, resp in zip(seqs, starts, _batch(client, payload, len(seqs), timeout)):
        mi = resp["meta_info"]
        rows, tops = mi.get("input_token_logprobs") or [], mi.get("input_top_logprobs") or []
        if len(rows) != len(seq) or len(tops) != len(seq):
            raise KitError(f"cold prefill returned {len(rows)} input logprobs for {len(seq)} tokens (logprob_start_len=0 not honoured?)")
        out.append(
            TokenLogprobs(
                tuple(int(r[1]) for r in rows[start:]),
                tuple(float(r[0]) for r in rows[start:]),
                tuple(_top(t) for t in tops[start:]),
            )
        )
    return out


def cache_enabled(client: SGLangClient) -> bool:
    """False when /server_info says the radix cache is disabled (unknown counts as on)."""
    try:
        info = client.server_info()
    except ServerDiedError:
        raise
    except KitError:
        return True
    return not bool(info.get("disable_radix_cache", False))


# ------------------------------------------------------------------ KL
#: The new tokens a served KL request adds past what turn one left (its own, uncached).
KL_EXT_LEN = 8


def record_kl(
    client: SGLangClient,
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    scenario: str = "prefill_hit",
    new_tokens: int = 16,
    top_k: int = 5,
    turn1_tokens: int | Sequence[int] = 16,
    ext_len: int = KL_EXT_LEN,
    timeout: float | None = None,
    mixed: bool = False,
    reasoning: bool = False,
    rid_tag: str | None = None,
) -> KLRecording:
    """Serve ``prompts`` on a cache hit, then re-prefill served tokens cold twice.

    ``prefill_hit``: warm with ``max_new_tokens=0``, then generate prompt + ``ext_len``
    new tokens (with ``ext_len=0`` the identical prompt, SGLang's variant, which can never
    hit under ``no_buffer``: its only state sits at the full prompt, past the key limit).
    ``decode_hit``: turn one generates ``turn1_tokens`` (one count, or one per prompt); turn two (prompt + output +
    ``ext_len`` new tokens) is served, hitting what turn one's decode cached.  The cold
    half (reference, noise floor, cold generate) is :func:`judge_against_cold`'s.
    ``mixed`` (a server with ``--enable-mixed-chunk``): the prefill-hit warm-up prefills run
    one by one while a decode without logprobs is running, so SGLang batches each with that
    decode (``mix_with_running``; a request with logprobs is never mixed) and stores their
    checkpoints from mixed batches.
    ``reasoning`` (a server with ``--strip-thinking-cache``): turn one of ``decode_hit`` asks
    for reasoning, so its whole output is thinking and SGLang caches only its prompt: turn
    two then hits a state at or below the prompt (never one its decode tracked past it).
    ``rid_tag``: the served requests' ids are ``<rid_tag>-<i>`` (each sequence keeps its id
    and input, for the server's per-node records).
    """
    if scenario not in ("prefill_hit", "decode_hit"):
        raise KitError(f"record_kl: unknown scenario {scenario!r} (prefill_hit or decode_hit)")
    enabled = cache_enabled(client)
    client.flush_cache()
    if scenario == "prefill_hit":
        if mixed:
            warm_beside_a_decode(client, prompts, vocab_size=vocab_size, timeout=timeout)
        else:
            generate_tokens(client, prompts, 0, timeout=timeout)
        inputs = [tuple(p) + extension(ext_len, vocab_size=vocab_size, seed=f"kl:{i}") for i, p in enumerate(prompts)]
    else:
        first = generate_tokens(client, prompts, turn1_tokens, timeout=timeout, reasoning=reasoning)
        inputs = [tuple(p) + output_ids(r) + extension(ext_len, vocab_size=vocab_size, seed=f"kl:{i}") for i, (p, r) in enumerate(zip(prompts, first))]
    rids = [f"{rid_tag}-{i}" for i in range(len(inputs))] if rid_tag else None
    served = generate_tokens(client, inputs, new_tokens, top_k=top_k, timeout=timeout, rids=rids)
    return judge_against_cold(
        served, inputs, client, scenario=scenario, enabled=enabled, new_tokens=new_tokens,
        top_k=top_k, timeout=timeout, rids=rids or (),
    )


#: The decode the mixed warm-up runs beside: long enough to outlast the warm-up prefills.
MIXED_BACKGROUND_TOKENS = 192


def warm_beside_a_decode(client: SGLangClient, prompts: Sequence[Sequence[int]], *, vocab_size: int, timeout: float | None = None) -> None:
    """Prefill ``prompts`` one at a time while one request decodes (no logprobs on either, so
    a mixed-chunk server batches each prefill with the decode)."""
    background = extension(16, vocab_size=vocab_size, seed="kl:mixed-background")
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(generate_tokens, client, [background], MIXED_BACKGROUND_TOKENS, timeout=timeout)
        time.sleep(0.5)  # its prefill is done and it decodes
        for p in prompts:
            generate_tokens(client, [p], 0, timeout=timeout)
        running.result()


def judge_against_cold(
    served: Sequence[dict[str, Any]],
    inputs: Sequence[Tokens],
    reference: SGLangClient,
    *,
    scenario: str,
    enabled: bool,
    new_tokens: int,
    top_k: int,
    timeout: float | None = None,
    rids: Sequence[str] = (),
) -> KLRecording:
    """The cold half of a KL recording, on ``reference`` with a flushed cache:

    * the reference: one teacher-forced cold prefill of input + served tokens (batched);
    * the noise floor, from two cold paths that differ from that reference the way a hit
      does, not from a rerun of it: the same inputs generated cold (prefill of the input,
      then decode steps, in the same batch as the hit was served: its tokens are also the
      free-running cold generate), and the reference prefill again one sequence at a time
      (another batch composition)."""
    hits = [cached_tokens(r) for r in served]
    served_lp = [served_logprobs(r) for r in served]
    reference.flush_cache()
    cold_served = [served_logprobs(r) for r in generate_tokens(reference, inputs, new_tokens, top_k=top_k, timeout=timeout)]
    full = [tuple(inp) + s.token_ids for inp, s in zip(inputs, served_lp)]
    starts = [len(inp) for inp in inputs]
    reference.flush_cache()
    ref = prefill_logprobs(reference, full, starts, top_k=top_k, timeout=timeout)
    one_by_one = [prefill_logprobs(reference, [f], [st], top_k=top_k, timeout=timeout)[0] for f, st in zip(full, starts)]
    reference.flush_cache()
    seqs = tuple(
        KLSequence(scenario, st, h, s, r, cs, cs.token_ids, alone, rid=rids[i] if rids else "", input_ids=tuple(inputs[i]))
        for i, (st, h, s, r, cs, alone) in enumerate(zip(starts, hits, served_lp, ref, cold_served, one_by_one))
    )
    return KLRecording(seqs, enabled, top_k)


# ------------------------------------------------------------------ prefix branching
def record_tree(client: SGLangClient, tree: BranchTree, *, top_k: int = 0, timeout: float | None = None) -> TreeRecording:
    """Send a tree group by group, then re-run every request that hit the cache cold.

    ``top_k`` > 0 records the first output token's top-k (non-exact mode on GPU); the served
    tokens' logprobs are recorded always (exact mode compares them with the cold ones).
    """
    asked = max(top_k, 1)
    enabled = cache_enabled(client)
    sent: dict[str, tuple[Tokens, Tokens]] = {}
    rows: list[TreeRequestRecord] = []
    pressured = False
    for group in consecutive_groups(tree.requests):
        flushed = any(r.flush_before for r in group)
        if flushed:
            client.flush_cache()
            pressured = False
        if any(r.pressure_before for r in group) and tree.pressure_prompts:
            generate_tokens(client, tree.pressure_prompts, 1, timeout=timeout)
            pressured = True
        try:
            prompts = [r.prompt(sent) for r in group]
        except KitError as e:
            raise KitError(f"tree {tree.name}: {e}") from None
        resps = generate_tokens(client, prompts, [r.max_new_tokens for r in group], top_k=asked, timeout=timeout)
        for r, p, resp in zip(group, prompts, resps):
            out = output_ids(resp)
            sent[r.path] = (p, out)
            lp = served_logprobs(resp)
            first = lp.top[0] if top_k > 0 and lp.top else ()
            rows.append(TreeRequestRecord(r.path, p, out, cached_tokens(resp), r.group, first_top=first, output_logprobs=tuple(lp.logprobs),
                                          flushed_before=flushed, after_pressure=pressured))
    final = []
    for row, r in zip(rows, tree.requests):
        if row.cached_tokens > 0:
            client.flush_cache()
            (resp,) = generate_tokens(client, [row.prompt], r.max_new_tokens, top_k=asked, timeout=timeout)
            lp = served_logprobs(resp)
            cold_top = lp.top[0] if top_k > 0 and lp.top else ()
            row = replace(row, cold_output=output_ids(resp), cold_first_top=cold_top, cold_output_logprobs=tuple(lp.logprobs))
        final.append(row)
    client.flush_cache()
    return TreeRecording(tuple(final), enabled, tree.name)


# ------------------------------------------------------------------ leaks
def _turn_payload(turn_tokens: Tokens, max_new: int, rid: str, sid: str, parent: str | None, replace: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"id": sid}
    if parent is not None:
        params["rid"] = parent
    if replace:
        params["replace"] = True
    return {"input_ids": list(turn_tokens), "sampling_params": _sampling(max_new), "rid": rid, "session_params": params}


def _streamed_tokens(chunk: dict[str, Any]) -> int:
    mi = chunk.get("meta_info") or {}
    if mi.get("completion_tokens") is not None:
        return int(mi["completion_tokens"])
    return len(chunk.get("output_ids") or [])


def _aborted_turn(
    client: SGLangClient, payload: dict[str, Any], *, min_s: float, min_tokens: int = 2, timeout: float
) -> tuple[dict[str, Any] | None, int, str]:
    """Stream one turn, abort it by rid once the stream has delivered ``min_tokens`` output
    tokens (and at least ``min_s`` after it was sent), read the stream to its end.

    Returns (last chunk, output tokens streamed when the abort was sent, error).  Decoding
    is seen on the stream itself, not on a gauge SGLang publishes only every 40 steps."""
    seen = threading.Event()
    done = threading.Event()
    box: dict[str, Any] = {"last": None, "tokens": 0, "error": ""}

    def consume() -> None:
        try:
            for chunk in client.generate_stream(payload, timeout=timeout):
                box["last"] = chunk
                box["tokens"] = _streamed_tokens(chunk)
                if box["tokens"] >= min_tokens:
                    seen.set()
        except KitError as e:
            box["error"] = str(e).splitlines()[0][:200]
        finally:
            done.set()

    t0 = time.monotonic()
    reader = threading.Thread(target=consume, name=f"stream-{payload['rid']}", daemon=True)
    reader.start()
    end = t0 + timeout
    while time.monotonic() < end and not done.is_set() and not (seen.is_set() and time.monotonic() - t0 >= min_s):
        time.sleep(0.01)
    at_abort = box["tokens"]
    client.abort_request(payload["rid"])
    done.wait(timeout)
    reader.join(timeout=1.0)
    if not done.is_set():
        return box["last"], at_abort, f"stream still open {timeout:.0f}s after the abort"
    return box["last"], at_abort, box["error"]


def record_sessions(
    client: SGLangClient,
    scripts: Sequence[SessionScript],
    *,
    timeout: float = 60.0,
    after_abort: Callable[[TurnResult], None] | None = None,
) -> SessionRecording:
    """Run each session script (open, turns, close).  A turn with ``abort_after_s`` is
    streamed and aborted by rid once the stream shows it decoding (at least
    ``abort_after_s`` after it was sent); ``after_abort`` is called with its record while
    its session is still open (e.g. an idle probe without a flush)."""
    turns: list[TurnResult] = []
    errors: list[str] = []
    sent = 0
    for script in scripts:
        sid = client.open_session(script.capacity_of_str_len, streaming=script.streaming)
        rids: list[str] = []
        last_ok: str | None = None
        try:
            for i, turn in enumerate(script.turns):
                rid = f"{sid}-t{i}"
                rids.append(rid)
                parent = None if script.streaming else (rids[turn.parent] if turn.parent is not None else last_ok)
                payload = _turn_payload(turn.tokens, turn.max_new_tokens, rid, sid, parent, turn.replace)
                sent += 1
                if turn.abort_after_s is not None:
                    last, at_abort, err = _aborted_turn(client, payload, min_s=turn.abort_after_s, timeout=timeout)
                    mi = (last or {}).get("meta_info") or {}
                    fin = (mi.get("finish_reason") or {}).get("type", "error" if err else "unknown")
                    rec = TurnResult(
                        script.name, i, rid, fin, int(mi.get("cached_tokens", 0) or 0), _streamed_tokens(last or {}), err,
                        decoding_seen=at_abort >= 2, tokens_at_abort=at_abort, max_new_tokens=turn.max_new_tokens, aborted=True,
                    )
                    turns.append(rec)
                    if after_abort is not None:
                        after_abort(rec)
                    continue
                try:
                    resp = client.generate(payload, timeout=timeout)
                except KitError as e:
                    raise KitError(f"session {script.name} turn {i}: {e}") from None
                resp = resp[0] if isinstance(resp, list) else resp
                fin = (resp.get("meta_info", {}).get("finish_reason") or {}).get("type", "unknown")
                turns.append(TurnResult(script.name, i, rid, fin, cached_tokens(resp), len(output_ids(resp)), max_new_tokens=turn.max_new_tokens))
                if fin == "abort":
                    errors.append(f"session {script.name} turn {i} was aborted by the server: {resp['meta_info'].get('finish_reason')}")
                else:
                    last_ok = rid
        finally:
            client.close_session(sid)
    return SessionRecording(tuple(turns), tuple(errors), sent)


def sample_occupancy(
    client: SGLangClient,
    load: Callable[[], Any],
    *,
    interval_s: float = 0.02,
    max_s: float = 120.0,
    gauges: Sequence[str] = OCCUPANCY_GAUGES,
) -> tuple[list[OccupancySample], Any]:
    """Run ``load()`` in a thread while sampling the gauges; returns (timeline, load's result)."""
    samples: list[OccupancySample] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(load)
        while True:
            m = client.metrics()
            samples.append(OccupancySample(round(time.monotonic() - t0, 4), {g: m[g] for g in gauges if g in m}))
            if fut.done():
                break
            if time.monotonic() - t0 > max_s:
                raise KitError(f"load still running after {max_s:.0f}s while sampling pool occupancy")
            time.sleep(interval_s)
        return samples, fut.result(timeout=max_s)
