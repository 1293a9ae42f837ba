"""Paired A/B perf runs: two servers of one cell in one run, requests interleaved.

Both servers load the seeded fault ``step_slowdown`` (``conformance/sglang_plugins/faults``)
with its grade read from a file per server (``HYBRID_CONFORMANCE_STEP_SLOWDOWN=@file``), so
one started pair is graded in turn without a restart: grade 0 on both is a clean pair (the
hook only times the step), grade g on one side slows every forward step of that server by
g x the step's own time.  Which side is slowed is drawn at random per graded run, so a
difference between the two processes themselves cannot pass for a slowdown.

:func:`measure_pairs` sends the same fresh prompt to both servers, back to back, in a random
order per pair, and keeps each side's TTFT and decode time per token (SGLang's own
``first_token_latency`` / ``e2e_latency`` when it reports them, else the client's stream
times); :func:`conformance.checks.perf_ab.ab_verdict` judges them.  Every request has a
timeout; both servers are stopped when the ``with`` block ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from conformance.checks.perf_ab import PairTiming
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.faults import SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV
from conformance.matrix import Cell
from conformance.workloads.perf import _Streamed, stream_one
from conformance.workloads.prompts import token_prompts

FAULT = "step_slowdown"
SIDES = ("a", "b")


@dataclass(frozen=True)
class AbPlan:
    """Sizes of one paired run (tiny twins on CPU: a pair takes ~0.2-0.4 s)."""

    pairs: int = 30
    prompt_len: int = 200
    new_tokens: int = 16
    warmup: int = 3
    request_timeout_s: float = 60.0


def side_timing(s: _Streamed) -> tuple[float, float]:
    """(TTFT, decode seconds per output token after the first) of one streamed answer."""
    out = len(s.output_ids) or int(s.meta.get("completion_tokens") or 0)
    if out < 2:
        raise KitError(f"perf A/B: an answer had {out} output tokens (need 2 or more to time decode)")
    ttft, e2e = s.meta.get("first_token_latency"), s.meta.get("e2e_latency")
    if isinstance(ttft, (int, float)) and isinstance(e2e, (int, float)) and 0 < ttft < e2e:
        return float(ttft), (float(e2e) - float(ttft)) / (out - 1)
    if s.client_ttft_s is None or s.client_total_s <= s.client_ttft_s:
        raise KitError("perf A/B: an answer streamed no timed first token")
    return s.client_ttft_s, (s.client_total_s - s.client_ttft_s) / (out - 1)


def measure_pairs(a: SGLangClient, b: SGLangClient, plan: AbPlan, *, vocab_size: int, seed: int | str) -> list[PairTiming]:
    """``plan.pairs`` pairs: each a fresh prompt sent to A and B, in a random order."""
    rng = random.Random(f"ab-order:{seed}")
    for i, p in enumerate(token_prompts([plan.prompt_len] * plan.warmup, vocab_size=vocab_size, seed=f"ab-warm:{seed}")):
        for client in (a, b):
            stream_one(client, p, plan.new_tokens, timeout=plan.request_timeout_s)
    out = []
    for p in token_prompts([plan.prompt_len] * plan.pairs, vocab_size=vocab_size, seed=f"ab:{seed}"):
        order = [("a", a), ("b", b)]
        rng.shuffle(order)
        got = {side: side_timing(stream_one(client, p, plan.new_tokens, timeout=plan.request_timeout_s)) for side, client in order}
        out.append(PairTiming(got["a"][0], got["b"][0], got["a"][1], got["b"][1]))
    return out


def oriented(pairs: list[PairTiming], slowed: str) -> list[PairTiming]:
    """The pairs with the slowed side as B (``slowed`` = "a" swaps the sides)."""
    if slowed == "b":
        return pairs
    return [PairTiming(p.ttft_b, p.ttft_a, p.decode_per_token_b, p.decode_per_token_a) for p in pairs]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class GradedPair:
    """Two started servers of one cell and their grade files."""

    endpoints: dict[str, Any]
    grade_files: dict[str, Path]

    def grade(self, slowed: str, grade: float) -> None:
        """Slow side ``slowed`` by ``grade`` of a step's work; the other side runs clean."""
        for side, path in self.grade_files.items():
            path.write_text(f"{grade if side == slowed else 0.0!r}\n")

    @property
    def clients(self) -> tuple[SGLangClient, SGLangClient]:
        return self.endpoints["a"].client, self.endpoints["b"].client


@contextlib.contextmanager
def graded_pair(cell: Cell, options: Any, *, work_dir: Path) -> Iterator[GradedPair]:
    """Start A then B (both with ``step_slowdown`` at grade 0); stop both on exit."""
    from conformance.targets.serving import serve_cell

    work_dir.mkdir(parents=True, exist_ok=True)
    files = {side: work_dir / f"{side}.grade" for side in SIDES}
    for path in files.values():
        path.write_text("0.0\n")
    with contextlib.ExitStack() as stack:
        endpoints = {}
        for side in SIDES:
            with _environ({SGLANG_FAULT_ENV: FAULT, STEP_SLOWDOWN_ENV: f"@{files[side]}"}):
                endpoints[side] = stack.enter_context(serve_cell(cell, options, log_dir=work_dir / side))
        yield GradedPair(endpoints, files)


@dataclass(frozen=True)
class GradedRun:
    """One paired run of a started pair: the grade, the side it slowed, the verdict."""

    repeat: int
    grade: float
    slowed: str
    verdict: Any  # checks.perf_ab.AbVerdict
    seconds: float

    @property
    def right(self) -> bool:
        """The verdict says what was done: flagged exactly when a side was slowed."""
        return self.verdict.flagged == (self.grade > 0)

    def row(self) -> dict[str, Any]:
        return {"repeat": self.repeat, "grade": self.grade, "slowed": self.slowed, "flagged": self.verdict.flagged, "seconds": round(self.seconds, 1),
                **{f"{t.metric}_ratio": t.median_ratio for t in self.verdict.tests}, **{f"{t.metric}_p": t.p_value for t in self.verdict.tests}}


def graded_runs(cell: Cell, options: Any, *, grades: list[float], repeats: int, plan: AbPlan, alpha: float, seed: int,
                work_dir: Path) -> Iterator[GradedRun]:
    """Per repeat a fresh pair of servers, then one paired run per grade in a random order,
    each slowing a randomly drawn side (grade 0: the clean pair)."""
    import time

    from conformance.checks.perf_ab import ab_verdict
    from conformance.suites import vocab_size

    rng = random.Random(seed)
    for r in range(repeats):
        with graded_pair(cell, options, work_dir=work_dir / f"r{r}") as pair:
            vocab = vocab_size(pair.endpoints["a"])
            for g in rng.sample(grades, len(grades)):
                slowed = rng.choice(SIDES)
                pair.grade(slowed, g)
                t0 = time.monotonic()
                pairs = measure_pairs(*pair.clients, plan, vocab_size=vocab, seed=f"{seed}:{r}:{g}")
                yield GradedRun(r, g, slowed, ab_verdict(oriented(pairs, slowed), alpha=alpha), time.monotonic() - t0)
