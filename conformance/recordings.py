"""What the workloads record and the checks judge: one frozen dataclass per recording.

Workloads (``conformance.workloads``), the disagg and agreement suites and the programs
build these from a server's answers; the pure checks (``conformance.checks``) read them and
return a :class:`~conformance.records.Verdict`.  Kept apart from ``records.py`` (the
verdict, what checks give the report) so that the flow reads one way: workloads ->
recordings -> checks -> records -> report, and neither side imports the other for a type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

# ------------------------------------------------------------------ kl
TopK = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at consecutive positions of one sequence: the chosen tokens' and top-k."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[TopK, ...] = ()  # per position: (token_id, logprob), best first


@dataclass(frozen=True)
class KLSequence:
    """One compared sequence: ``served`` came from the cache-hit run; ``reference`` from a
    cold teacher-forced prefill of the same tokens; ``floor`` from a cold path that differs
    from the reference the way a hit does (the inputs generated cold: its tokens may part
    from the served ones, and only the positions before that are compared);
    ``floor_prefill`` the reference prefill in another batch composition; ``start`` is the
    absolute position of the first compared token; ``cold_tokens`` a free-running cold
    generate."""

    scenario: str
    start: int
    cached_tokens: int
    served: TokenLogprobs
    reference: TokenLogprobs
    floor: TokenLogprobs | None = None
    cold_tokens: tuple[int, ...] = ()
    floor_prefill: TokenLogprobs | None = None
    #: the served request's id and input (the server's per-node records say what its tree held for it)
    rid: str = ""
    input_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KLRecording:
    """One cell's KL scenarios: every compared sequence, and whether the radix cache was on."""

    sequences: tuple[KLSequence, ...]
    cache_enabled: bool = True
    top_k: int = 0


# ------------------------------------------------------------------ hicache
@dataclass(frozen=True)
class HostReloadRecording:
    """What the served requests hit, per tier, and their KL recording against cold."""

    stored: tuple[int, ...]  # the hit each served request has with nothing evicted (the prefix oracle's)
    device: tuple[int, ...]  # cached tokens SGLang reports from the device tier, per request
    host: tuple[int, ...]  # ... and from the host tier
    kl: KLRecording
    pressure: tuple[int, int]  # (requests, tokens each)


# ------------------------------------------------------------------ PD transfer failures
@dataclass(frozen=True)
class TransferOutcome:
    """How one request through a PD router ended: ``finish`` is SGLang's finish reason type
    (``length``, ``abort``, ...), ``http`` for a non-200 answer, ``error`` for no answer;
    ``message`` SGLang's error text (or the kit's one line), ``tokens`` the tokens served."""

    status: int
    finish: str
    message: str = ""
    tokens: int = 0


@dataclass(frozen=True)
class TransferFailureRecording:
    """A load sent through a PD unit whose transfers SGLang makes fail at random
    (``SGLANG_TEST_DISAGG_FAILURE_PROB`` = ``failure_prob`` on the decode server), then
    follow-up requests until one is served (``follow_up``: the last one's outcome)."""

    outcomes: tuple[TransferOutcome, ...]
    follow_up: tuple[TransferOutcome, ...]
    failure_prob: float
    new_tokens: int


# ------------------------------------------------------------------ agreement
@dataclass(frozen=True)
class ServedStep:
    """One request as one server answered it (``input_len``: its prompt's length)."""

    cached_tokens: int
    logprobs: TokenLogprobs
    input_len: int = 0


@dataclass(frozen=True)
class AgreementStep:
    """One step of the scripted conversation as real SGLang and the reference engine answered it."""

    name: str
    sglang: ServedStep
    reference: ServedStep


# ------------------------------------------------------------------ leaks
@dataclass(frozen=True)
class IdleProbe:
    """SGLang's idle invariant after one scenario: ``values`` read BEFORE any flush (what
    the leak check judges), ``after_flush`` read after one; ``reached`` is True when both
    held, ``problems`` says what did not; ``fresh`` when the sample was provably
    published while idle (kit observe gauge)."""

    scenario: str
    reached: bool
    values: Mapping[str, float]
    waited_s: float
    requests: int = 1
    after_flush: Mapping[str, float] = field(default_factory=dict)
    fresh: bool = False
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class OccupancySample:
    """The pool gauges read at ``t_s`` seconds into a load (one point of the occupancy timeline)."""

    t_s: float
    values: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TurnResult:
    """One session turn as served.  Abort turns also carry ``decoding_seen`` (the stream had
    delivered ``tokens_at_abort`` >= 2 output tokens when the abort was sent) and the turn's
    ``max_new_tokens``."""

    session: str
    turn: int
    rid: str
    finish: str  # the finish reason type ("length", "abort", ...) or "error"
    cached_tokens: int
    output_len: int
    error: str = ""
    decoding_seen: bool | None = None
    tokens_at_abort: int | None = None
    max_new_tokens: int | None = None
    aborted: bool = False  # the kit sent an abort for this turn


@dataclass(frozen=True)
class SessionRecording:
    """Every turn of the session scenarios, the errors met and how many requests were sent."""

    turns: tuple[TurnResult, ...]
    errors: tuple[str, ...]
    requests: int


# ------------------------------------------------------------------ prefix_branching
@dataclass(frozen=True)
class TreeRequestRecord:
    """One request of a tree run: what was sent, what came back, and the cold answer."""

    path: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    cached_tokens: int
    group: int
    cold_output: tuple[int, ...] = ()
    first_top: TopK = ()
    cold_first_top: TopK = ()
    output_logprobs: tuple[float, ...] = ()  # the served tokens' logprobs (exact mode compares them)
    cold_output_logprobs: tuple[float, ...] = ()
    flushed_before: bool = False  # the cache was flushed right before this request's group
    after_pressure: bool = False  # eviction pressure ran since the last flush


@dataclass(frozen=True)
class TreeRecording:
    """One branching tree's requests in the order they were sent."""

    requests: tuple[TreeRequestRecord, ...]
    cache_enabled: bool = True
    tree: str = ""


# ------------------------------------------------------------------ perf
@dataclass(frozen=True)
class RequestTiming:
    """One timed request.  ``ttft_s`` / ``decode_tok_s`` come from the source the recording
    names (SGLang's own ``meta_info`` timings when the server reports them, else the
    client's stream); both sources are kept for the client-overhead benchmark."""

    phase: str
    rep: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    client_ttft_s: float | None = None
    client_total_s: float | None = None
    server_ttft_s: float | None = None
    server_e2e_s: float | None = None


@dataclass(frozen=True)
class PerfRecording:
    """Everything the perf workload measured on one cell."""

    requests: tuple[RequestTiming, ...]
    repeats: int
    concurrency: int
    concurrent_decode_tok_s: tuple[float, ...]  # aggregate decode tok/s of the N requests, per repetition
    timing_source: str  # "server" (SGLang meta_info) or "client" (stream arrival times)
    engine: str  # what served it: SGLang's version, or the kit's reference engine
    pools: Mapping[str, float | None] = field(default_factory=dict)  # mamba_peak_used, kv_peak_used, track_slots_*
    cache_enabled: bool = True
    quiet: bool | None = None  # True: measured while the run's other tests were held back
    errors: tuple[str, ...] = ()
    hit_na: str | None = None  # why no prefix-hit request was sent (the cell stores no prefill state), else None


# ------------------------------------------------------------------ gsm8k
@dataclass(frozen=True)
class GSM8KAnswer:
    """One test item as lm-eval scored it."""

    index: int  # lm-eval's doc_id: the item's index in the test split
    completion: str  # lm-eval's raw response (cut at the task's stop sequences)
    strict: bool  # exact_match under lm-eval's strict-match filter
    flexible: bool  # exact_match under lm-eval's flexible-extract filter


@dataclass(frozen=True)
class GSM8KRecording:
    """One cell's GSM8K answers as lm-eval scored them."""

    answers: tuple[GSM8KAnswer, ...]
    shots: int = 0
    label: str = ""
    engine: str = ""  # "lm-eval 0.4.13": who prompted, filtered and scored
