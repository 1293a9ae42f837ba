"""Paired A/B perf runs: two servers of one cell in one run, requests interleaved.

Both servers load the seeded fault ``step_slowdown`` (``conformance/sglang_plugins/faults``)
with its grade read from a file per server (``HYBRID_CONFORMANCE_STEP_SLOWDOWN=@file``), so
one started pair is graded in turn without a restart: grade 0 on both is a clean pair (the
hook only times the step), grade g on one side slows every forward step of that server by
g x the step's own time.  Which side is slowed is drawn at random per graded run, so a
difference between the two processes themselves cannot pass for a slowdown.

:func:`measure_pairs` sends the same fresh prompt to both servers back to back in a random
order per pair (or, ``AbPlan.together``, at the same moment), and keeps each side's TTFT and decode time per token (SGLang's own
``first_token_latency`` / ``e2e_latency`` when it reports them, else the client's stream
times) and the CPU time its server's processes spent on it (``/proc`` schedstat of every
thread: the server's own work, which the other tenants of a shared host do not move);
:func:`conformance.checks.perf_ab.ab_verdict` judges them.  Every request has a
timeout; both servers are stopped when the ``with`` block ends, however it ends.

:func:`fault_runs` is the same paired run with any seeded SGLang fault on one drawn side
(its own switches, at its defaults) and none on the other: how ``mutants`` scores a fault
whose record names the paired A/B among the checks that can see it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from conformance.checks.perf_ab import PairTiming
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.matrix.faults import SGLANG_FAULT_ENV, STEP_SLOWDOWN_ENV
from conformance.matrix.cells import Cell
from conformance.workloads.perf import _Streamed, stream_one
from conformance.workloads.prompts import token_prompts
from conformance.targets.serving import serve_cell
from conformance.checks.perf_ab import ab_verdict
from conformance.session import suite_support

FAULT = "step_slowdown"
SIDES = ("a", "b")
#: ``GradedRun.slowed`` of a crossover run: each side in turn.
CROSSOVER = "a,b in turn"


@dataclass(frozen=True)
class AbPlan:
    """Sizes of one paired run (tiny twins on CPU: a pair takes ~0.2-0.4 s)."""

    pairs: int = 40
    prompt_len: int = 200
    new_tokens: int = 16
    warmup: int = 5
    request_timeout_s: float = 60.0
    #: Both sides of a pair sent at the same moment (False, the default: back to back in a random
    #: order). Measured on sglang-cpu at load 8-10 (docs/perf.md): at once, the two requests
    #: compete with each other for the cores and their wall times differ by ~2x per pair.
    together: bool = False
    #: Graded runs: each block of two pairs slows each server once, in a random order, and the
    #: test runs on the blocks (``checks.perf_ab``, ``block=2``), so a difference between the two
    #: server processes cancels (False: one drawn side slowed for the whole run).
    crossover: bool = True


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


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of a server's processes (``pid`` and its children, every thread,
    ns-exact from ``/proc/<pid>/task/<tid>/schedstat``); 0.0 when unreadable."""
    import psutil

    try:
        root = psutil.Process(pid)
        pids = [pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return 0.0
    total = 0
    for p in pids:
        for stat in Path(f"/proc/{p}/task").glob("*/schedstat"):
            try:
                total += int(stat.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1e9


def measure_pairs(a: SGLangClient, b: SGLangClient, plan: AbPlan, *, vocab_size: int, seed: int | str,
                  before: Callable[[int], None] | None = None, pids: dict[str, int | None] | None = None) -> list[PairTiming]:
    """``plan.pairs`` pairs: each a fresh prompt sent to A and B -- at the same moment
    (``plan.together``, submitted in a random order) or back to back in a random order.
    ``before(i)`` runs before measured pair i (a crossover moves the slowdown there);
    ``pids``: each side's server pid, whose processes' CPU time per request is kept too."""
    rng = random.Random(f"ab-order:{seed}")
    clients = {"a": a, "b": b}
    pids = pids or {}

    def one(side: str, p: list[int]) -> tuple[_Streamed, float]:
        pid = pids.get(side)
        cpu0 = tree_cpu_s(pid) if pid else 0.0
        s = stream_one(clients[side], p, plan.new_tokens, timeout=plan.request_timeout_s)
        return s, (tree_cpu_s(pid) - cpu0 if pid else 0.0)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="perf-ab") as pool:

        def pair(p: list[int]) -> dict[str, tuple[_Streamed, float]]:
            order = rng.sample(SIDES, 2)
            if not plan.together:
                return {side: one(side, p) for side in order}
            futures = {side: pool.submit(one, side, p) for side in order}
            return {side: f.result(timeout=2 * plan.request_timeout_s) for side, f in futures.items()}

        for p in token_prompts([plan.prompt_len] * plan.warmup, vocab_size=vocab_size, seed=f"ab-warm:{seed}"):
            pair(p)
        out = []
        for i, p in enumerate(token_prompts([plan.prompt_len] * plan.pairs, vocab_size=vocab_size, seed=f"ab:{seed}")):
            if before is not None:
                before(i)
            got = {side: (*side_timing(s), cpu) for side, (s, cpu) in pair(p).items()}
            out.append(PairTiming(got["a"][0], got["b"][0], got["a"][1], got["b"][1], max(got["a"][2], 0.0), max(got["b"][2], 0.0)))
    return out


def oriented(pairs: list[PairTiming], slowed: str | list[str]) -> list[PairTiming]:
    """The pairs with the slowed side as B (``slowed`` = "a" swaps the sides; a list: per pair)."""
    sides = [slowed] * len(pairs) if isinstance(slowed, str) else slowed
    return [p if s == "b" else PairTiming(p.ttft_b, p.ttft_a, p.decode_per_token_b, p.decode_per_token_a, p.cpu_b, p.cpu_a)
            for p, s in zip(pairs, sides)]


def crossover_sides(blocks: int, rng: random.Random) -> list[str]:
    """The slowed side per pair of a crossover: each block of two slows A once and B once, in a random order."""
    out: list[str] = []
    for _ in range(blocks):
        out += rng.sample(SIDES, 2)
    return out


def _set(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """``values`` in the environment (None: unset) for the block."""
    saved = {k: os.environ.get(k) for k in values}
    _set(values)
    try:
        yield
    finally:
        _set(saved)


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

    @property
    def pids(self) -> dict[str, int | None]:
        return server_pids(self.endpoints)


def server_pids(endpoints: dict[str, Any]) -> dict[str, int | None]:
    """Each side's server pid (None when its process does not say)."""
    return {side: getattr(getattr(e, "process", None), "pid", None) for side, e in endpoints.items()}


@contextlib.contextmanager
def graded_pair(cell: Cell, options: Any, *, work_dir: Path) -> Iterator[GradedPair]:
    """Start A then B (both with ``step_slowdown`` at grade 0); stop both on exit."""
    work_dir.mkdir(parents=True, exist_ok=True)
    files = {side: work_dir / f"{side}.grade" for side in SIDES}
    for path in files.values():
        path.write_text("0.0\n")
    with started_pair(cell, options, {side: {SGLANG_FAULT_ENV: FAULT, STEP_SLOWDOWN_ENV: f"@{files[side]}"} for side in SIDES},
                      work_dir=work_dir) as endpoints:
        yield GradedPair(endpoints, files)


@contextlib.contextmanager
def started_pair(cell: Cell, options: Any, envs: dict[str, dict[str, str | None]], *, work_dir: Path) -> Iterator[dict[str, Any]]:
    """Start A then B, each with its own fault switches (``envs[side]``; None: unset), logs
    under ``work_dir/<side>``; stop both on exit."""
    with contextlib.ExitStack() as stack:
        endpoints = {}
        for side in SIDES:
            with _environ(envs[side]):
                endpoints[side] = stack.enter_context(serve_cell(cell, options, log_dir=work_dir / side))
        yield endpoints


@dataclass(frozen=True)
class GradedRun:
    """One paired run of a started pair: the grade, the side it slowed, the verdict."""

    repeat: int
    grade: float
    slowed: str
    verdict: Any  # checks.perf_ab.AbVerdict
    seconds: float
    fault: str = ""  # a run of :func:`fault_runs`: the seeded fault on side ``slowed`` ("": a clean pair)
    pairs: tuple[PairTiming, ...] = ()  # the timings judged (slowed side as B)

    @property
    def changed(self) -> bool:
        """A side was slowed (a grade above 0, or a seeded fault on it)."""
        return self.grade > 0 or bool(self.fault)

    @property
    def right(self) -> bool:
        """The verdict says what was done: flagged exactly when a side was slowed."""
        return self.verdict.flagged == self.changed

    @property
    def what(self) -> str:
        """What was done to side ``slowed``, in words."""
        where = "each side in turn (crossover)" if self.slowed == CROSSOVER else f"side {self.slowed}"
        return f"{self.fault} on {where}" if self.fault else f"+{self.grade:.0%} on {where}"

    def row(self) -> dict[str, Any]:
        return {"repeat": self.repeat, "grade": self.grade, "fault": self.fault, "slowed": self.slowed, "flagged": self.verdict.flagged,
                "line": self.verdict.line(), "seconds": round(self.seconds, 1),
                **{f"{t.metric}_ratio": t.median_ratio for t in self.verdict.tests}, **{f"{t.metric}_p": t.p_value for t in self.verdict.tests},
                "pairs": [[float(f"{x:.5g}") for x in (p.ttft_a, p.ttft_b, p.decode_per_token_a, p.decode_per_token_b, p.cpu_a, p.cpu_b)]
                          for p in self.pairs]}


def graded_runs(cell: Cell, options: Any, *, grades: list[float], repeats: int, plan: AbPlan, alpha: float, seed: int,
                work_dir: Path) -> Iterator[GradedRun]:
    """Per repeat a fresh pair of servers, then one paired run per grade in a random order,
    each slowing a randomly drawn side (grade 0: the clean pair)."""
    import time

    rng = random.Random(seed)
    for r in range(repeats):
        with graded_pair(cell, options, work_dir=work_dir / f"r{r}") as pair:
            vocab = suite_support.vocab_size(pair.endpoints["a"])
            for g in rng.sample(grades, len(grades)):
                t0 = time.monotonic()
                if plan.crossover:
                    sides = crossover_sides(plan.pairs // 2, rng)
                    run_plan = dataclasses.replace(plan, pairs=len(sides))
                    raw = measure_pairs(*pair.clients, run_plan, vocab_size=vocab, seed=f"{seed}:{r}:{g}", before=lambda i: pair.grade(sides[i], g),
                                        pids=pair.pids)
                    pairs, slowed, block = oriented(raw, sides), CROSSOVER, 2
                else:
                    slowed, block = rng.choice(SIDES), 1
                    pair.grade(slowed, g)
                    pairs = oriented(measure_pairs(*pair.clients, plan, vocab_size=vocab, seed=f"{seed}:{r}:{g}", pids=pair.pids), slowed)
                yield GradedRun(r, g, slowed, ab_verdict(pairs, alpha=alpha, block=block), time.monotonic() - t0, pairs=tuple(pairs))


def fault_runs(cell: Cell, options: Any, *, fault: str | None, repeats: int, plan: AbPlan, alpha: float, seed: int,
               work_dir: Path) -> Iterator[GradedRun]:
    """Per repeat a fresh pair of servers, a randomly drawn side with the seeded SGLang fault
    ``fault`` at its defaults (its own switches only; the other side has no fault), one paired
    run.  ``fault`` None: both sides clean (the run must not be flagged).  A seeded fault
    cannot move between the servers, so no crossover (the CPU time is judged, as always).  How ``mutants`` scores a fault whose record names the
    paired A/B among the checks that see it."""
    import time

    rng = random.Random(seed)
    clean: dict[str, str | None] = {SGLANG_FAULT_ENV: None, STEP_SLOWDOWN_ENV: None}
    for r in range(repeats):
        slowed = rng.choice(SIDES)
        envs = {side: {**clean, SGLANG_FAULT_ENV: fault} if fault and side == slowed else clean for side in SIDES}
        with started_pair(cell, options, envs, work_dir=work_dir / f"r{r}") as endpoints:
            t0 = time.monotonic()
            pairs = oriented(measure_pairs(endpoints["a"].client, endpoints["b"].client, plan, vocab_size=suite_support.vocab_size(endpoints["a"]),
                                           seed=f"{seed}:{r}:{fault}", pids=server_pids(endpoints)), slowed)
            yield GradedRun(r, 0.0, slowed, ab_verdict(pairs, alpha=alpha), time.monotonic() - t0, fault or "", tuple(pairs))
