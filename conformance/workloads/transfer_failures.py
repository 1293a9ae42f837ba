"""Workload for PD transfer failures: requests sent one by one, all in flight together,
through a PD router whose decode server has SGLang's own failure injection on
(``SGLANG_TEST_DISAGG_FAILURE_PROB``), each request's end kept as it came (served, or
SGLang's transfer-failure error); the load is sent again (at most ``LOAD_ROUNDS`` times in
all) while no request of it failed, since SGLang's probability is per transfer POLL and the
polls per request follow the machine's speed; then follow-up requests until one is served or
the tries run out.  Every request is bounded by the client's timeout; a request with no
answer is kept as ``error`` (the check says so), never retried.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.recordings import TransferFailureRecording, TransferOutcome

#: SGLang answers an aborted request with 200 (``finish_reason.type == "abort"``) or with its
#: error status; the router passes the decode server's answer on.
ANSWERED = (200, 400, 500, 503)
#: Follow-up requests after the load (each can fail at random too: SGLang's switch stays on, and
#: a request alone on the decode server fails more often than one in a load: measured 4 of 5 at
#: 0.01 per poll against 5 of 16 in the load).
FOLLOW_UP_TRIES = 40
#: Rounds of the load at most, sent again only while none of its requests failed.
LOAD_ROUNDS = 3
#: No further follow-up try after this many seconds of them (a failed handshake holds its
#: request until SGLang's bootstrap timeout).
FOLLOW_UP_BUDGET_S = 300.0


def _outcome(client: SGLangClient, prompt: Sequence[int], new_tokens: int, timeout: float | None) -> TransferOutcome:
    payload = {"input_ids": list(prompt), "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    try:
        resp = client.request("POST", "/generate", json=payload, timeout=timeout, ok=ANSWERED)
    except KitError as e:  # no answer within the timeout, or the connection dropped
        return TransferOutcome(0, "error", str(e)[:300])
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    if resp.status_code != 200 or not isinstance(body, dict):
        text = body if isinstance(body, str) else str(body.get("error", body.get("message", body)))
        return TransferOutcome(resp.status_code, "http", text.strip().replace("\n", " ")[:300])
    reason = body.get("meta_info", {}).get("finish_reason") or {}
    reason = reason if isinstance(reason, dict) else {"type": str(reason)}
    ids = body.get("output_ids")
    tokens = len(ids) if isinstance(ids, list) else int(body.get("meta_info", {}).get("completion_tokens") or 0)
    return TransferOutcome(200, str(reason.get("type", "")), str(reason.get("message", "") or "")[:300], tokens)


def record_transfer_failures(
    router: SGLangClient,
    prompts: Sequence[Sequence[int]],
    *,
    new_tokens: int,
    failure_prob: float,
    follow_up_prompt: Sequence[int],
    follow_up_tries: int = FOLLOW_UP_TRIES,
    rounds: int = LOAD_ROUNDS,
    follow_up_budget_s: float = FOLLOW_UP_BUDGET_S,
    timeout: float | None = None,
) -> TransferFailureRecording:
    """Send ``prompts`` through ``router`` concurrently, one request each, again while none
    failed (at most ``rounds`` times); then the follow-up prompt until it is served (at most
    ``follow_up_tries`` times, none started after ``follow_up_budget_s``)."""
    outcomes: tuple[TransferOutcome, ...] = ()
    with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 16))) as pool:
        for _ in range(max(1, rounds)):
            outcomes += tuple(pool.map(lambda p: _outcome(router, p, new_tokens, timeout), prompts))
            if any(o.status != 200 or o.finish in ("abort", "error", "http") for o in outcomes):
                break
    follow: list[TransferOutcome] = []
    deadline = time.monotonic() + follow_up_budget_s
    for _ in range(max(1, follow_up_tries)):
        if follow and time.monotonic() > deadline:
            break
        follow.append(_outcome(router, follow_up_prompt, 1, timeout))
        if follow[-1].status == 200 and follow[-1].finish not in ("abort", "error", "http"):
            break
    return TransferFailureRecording(outcomes, tuple(follow), failure_prob, new_tokens)
