"""The idle probe taken after every scenario: SGLang's idle invariant read from outside,
BEFORE any flush, then once more after a flush.

SGLang's ``/flush_cache`` rebuilds the mamba free list (``MambaSlotAllocator.clear``), so a
slot leaked through SGLang's real classes reads as used before a flush and as free after
it: a probe that flushes first is blind.  This probe therefore

1. waits (bounded) until the server is idle and its gauges are fresh -- with the kit's
   observe plugin loaded (``hybrid_conformance:idle_publish_seq`` advances while idle),
   else until the gauges settle or the deadline passes (SGLang refreshes idle gauges up
   to every 30 s on its own);
2. reads the invariant's terms (``conformance.checks.leaks.idle_invariant``) and keeps
   them as the probe's verdict input;
3. flushes, waits for a fresh sample again, and keeps the after-flush values too (after a
   flush nothing may stay evictable, and only open sessions may hold anything).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

from conformance.checks.leaks import after_flush_problems, idle_invariant, is_idle
from conformance.recordings import IdleProbe
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.sglang_contract.metric_names import KIT_IDLE_PUBLISH_SEQ

POLL_S = 0.02
#: Publishes after the first scrape that make a sample fresh.  One is enough: the caller
#: holds every answer, and SGLang's scheduler (one thread) released each request before it
#: sent its output; a publish that ends after the first scrape cannot have started before
#: that release, because nothing else runs on that thread while it publishes.  (With
#: ``--sleep-on-idle`` an idle scheduler publishes about once a second, so each further
#: publish awaited costs about a second per idle check.)
FRESH_AFTER = 1
#: An idle scheduler under ``--sleep-on-idle`` waits up to 1 s on its sockets between loop
#: turns (SGLang's ``IdleSleeper``), so a fresh idle publish costs about a second.  A
#: read-only question that reaches the scheduler (``/server_info``: its internal state)
#: wakes it, and the observe plugin publishes on that turn (its hook on that question makes
#: the publish due at once): about 0.15 s per probe of two samples instead of 0.6 s with the
#: publish due 0.2 s after the last, and 1.1 s per sample without a wake, measured on a
#: real SGLang server on CPU.
WAKE = True
#: With fresh samples, a broken invariant that persists this long is a finding, not a
#: request still winding down (the observe plugin republishes every 0.2 s while idle).
SETTLE_S = 3.0


def _wake(client: SGLangClient) -> None:
    """Wake a sleeping idle scheduler with a read-only question (see :data:`WAKE`)."""
    try:
        client.server_info()
    except KitError:  # a server that cannot answer shows up in the gauges and the liveness checks
        pass


def _fresh_idle_sample(client: SGLangClient, deadline_s: float, judge) -> tuple[dict[str, float], bool, float]:
    """(values, fresh, waited): poll until the server is idle with a fresh sample on which
    ``judge`` finds no problem; a problem that persists over fresh samples for
    :data:`SETTLE_S` ends the wait early; else the deadline does."""
    start = time.monotonic()
    seq0 = client.metrics().get(KIT_IDLE_PUBLISH_SEQ)
    observed = seq0 is not None
    bad_since: float | None = None
    while True:
        values = client.metrics()
        now = time.monotonic()
        seq = values.get(KIT_IDLE_PUBLISH_SEQ)
        fresh = observed and seq is not None and seq >= seq0 + FRESH_AFTER
        if is_idle(values) and (fresh or not observed):
            if not judge(values):
                return values, fresh, now - start
            bad_since = bad_since if bad_since is not None else now
            if fresh and now - bad_since >= SETTLE_S:
                return values, fresh, now - start
        else:
            bad_since = None
        if now - start >= deadline_s:
            return values, fresh, now - start
        if WAKE and not fresh:
            _wake(client)
        time.sleep(POLL_S)


def idle_probe(
    client: SGLangClient,
    scenario: str,
    *,
    requests: int,
    deadline_s: float = 45.0,
    flush: bool = True,
    zero_gauges: Sequence[str] = (),
    invariant: Callable[[Mapping[str, float]], list[str]] = idle_invariant,
) -> IdleProbe:
    """Judge the idle invariant before a flush (the leak check), then after one;
    ``zero_gauges`` are further gauges that must read 0 at idle (e.g. a PD queue);
    ``invariant`` replaces the judge of the invariant itself (e.g. one that allows the
    tree locks of open streaming sessions)."""

    def judge(values: Mapping[str, float]) -> list[str]:
        extra = [f"{g} = {values.get(g, float('nan')):g} at idle" for g in zero_gauges if values.get(g) != 0]
        return invariant(values) + extra

    before, fresh, waited = _fresh_idle_sample(client, deadline_s, judge)
    problems = list(judge(before))
    if not is_idle(before):
        problems.insert(0, "server never went idle (requests still running or queued)")
    after: Mapping[str, float] = {}
    if flush:
        client.flush_cache()
        after, _, waited2 = _fresh_idle_sample(client, max(2.0, deadline_s / 3), after_flush_problems)
        waited += waited2
        problems += [f"after /flush_cache: {p}" for p in after_flush_problems(after)]
    return IdleProbe(
        scenario,
        reached=not problems,
        values=before,
        waited_s=waited,
        requests=requests,
        after_flush=dict(after),
        fresh=fresh,
        problems=tuple(problems),
    )
