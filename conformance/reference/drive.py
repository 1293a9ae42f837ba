"""Synchronous driving of a reference :class:`Engine` without HTTP: for unit tests and the
benchmark.  ``run(engine, reqs)`` submits requests together (one prefill batch) and steps
the engine until they finish."""

from __future__ import annotations

import itertools

from conformance.reference.request import Req, SamplingParams

_ids = itertools.count()


def make_req(input_ids, max_new_tokens: int = 8, *, logprobs: bool = True, temperature: float = 0.0,
             ignore_eos: bool = True, rid: str | None = None, **kw) -> Req:
    return Req(rid or f"req-{next(_ids)}", list(input_ids),
               SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=ignore_eos),
               return_logprob=logprobs, **kw)


def run(engine, reqs: list[Req], max_steps: int = 100_000) -> list[Req]:
    """Submit ``reqs`` at once and step until all finished (and the idle check ran)."""
    done: list[Req] = []
    for r in reqs:
        r.on_done = done.append
        engine.submit(r)
    for _ in range(max_steps):
        if not engine.step() and len(done) == len(reqs):
            return reqs
    raise RuntimeError(f"engine did not finish {len(reqs)} requests in {max_steps} steps")


def output_logprobs(req: Req) -> list[float]:
    return [float(row[t]) for row, t in zip(req.output_rows, req.output_ids)]
