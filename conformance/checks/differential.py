"""Differential check of one served request against a cold computation of the same tokens.

The cold side is a prefill of ``input + served output`` on a server with the radix cache
disabled (or any cold source), asked for the log-probs of every position from ``start``
on, with its top-k.  So every served position is compared teacher-forced: a greedy flip
at a near-tie does not derail the rest of the comparison.

Per served output token ``t`` at position ``p``:

* greedy: ``cold_logprob(t) >= cold_top1 - tie_eps`` (the served token is the cold argmax,
  up to a tie);
* when the server returned output logprobs: ``|served - cold| <= logprob_atol``;
* when it returned top-k: every token in both top-k lists within ``logprob_atol``
  (exact mode), or the top-k KL under ``kl_cap`` (otherwise);
* served input logprobs (``logprob_start_len >= 0``) against cold at the same positions.

Outside exact mode the KL cap and the greedy tie are not constants: :func:`tolerance_from_noise`
sets them from the noise measured in the same run between healthy cold paths (the cache-off
twin against itself, differently batched: :func:`noise_samples`), times :data:`NOISE_FACTOR`,
and never above the fixed ceilings :data:`KL_CEILING` and :data:`TIE_CEILING` (docs/kl-noise.md).

Pure: records in, problem strings out (empty: the request matches cold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from conformance.checks.kl import MIN_LIMIT, NOISE_FACTOR, topk_kl
from conformance.errors import KitError

Entry = tuple[float | None, int]  # (logprob, token id)


@dataclass(frozen=True)
class Tolerance:
    """Exact mode (deterministic CPU fp32): ties and logprobs within float noise.
    Otherwise (GPU, bf16): greedy within a looser tie and the top-k KL under a cap."""

    exact: bool = True
    tie_eps: float = 1e-4
    logprob_atol: float = 2e-4
    kl_cap: float = 0.005

    @classmethod
    def for_mode(cls, exact: bool, kl_cap: float = 0.005) -> "Tolerance":
        return cls(True) if exact else cls(False, tie_eps=0.05, logprob_atol=float("inf"), kl_cap=kl_cap)


# Non-exact limits are NOISE_FACTOR (checks.kl) times the largest noise seen between healthy
# cold paths.  The calibration sees ~100 tokens, a run thousands: on sglang-cpu in bfloat16 a
# clean token's top-k KL reached 4x the cell's mean noise (7.2e-3 against 1.8e-3, docs/kl-noise.md).
#: Fewer noise tokens than this measure no limit.
MIN_NOISE_TOKENS = 32
#: The greedy tie never goes below this (a bf16 logit step).
MIN_TIE = 0.05
#: The per-token top-k KL cap never goes above this, whatever the noise measured: three real
#: SGLang bugs failed the kl suite at a top-k KL of 0.26-0.34 (docs/known-bugs.md), so a
#: limit above ~0.2 would excuse them (docs/kl-noise.md, "The ceiling").
KL_CEILING = 0.2
#: The greedy tie never goes above this (nats): a served token the cold computation puts more
#: than 2 nats (a probability ratio of e^2, 7.4x) below its best is no tie.  The largest flip
#: margin a clean bf16 program was seen to reach is 1.625 (docs/kl-noise.md).
TIE_CEILING = 2.0


def noise_samples(input_ids: Sequence[int], output_ids: Sequence[int], served: ServedLogprobs, cold: Cold) -> tuple[list[float], list[float]]:
    """Per output token of a served request: the top-k KL (cold || served) and the flip
    margin -- the larger of the greedy gap (cold best logprob - cold logprob of the served
    token; 0 when it is the argmax) and how far the noise moved the difference between the
    cold's top two tokens, ``|(served_1 - served_2) - (cold_1 - cold_2)|``: a greedy flip
    needs exactly that difference to cross zero (a calibration of 128 tokens may see no flip
    at all, this movement it always sees; measured on sglang-cpu in bf16: no flip in
    calibration, then a 0.125 flip in a program).  The difference, not the two deviations
    added (session 5): a shift of every logprob alike (the normalizer of a bf16 softmax
    rounds differently on the two paths) moves no token past another, and the sum counted
    it twice.  When the served top-k lacks one of the two, twice the other's deviation (a
    bound).  Only the top two: a tail token of the top-k moved by 0.9 there, which would have
    put the tie at 7 nats, no greedy check at all."""
    kls, gaps = [], []
    base = len(input_ids)
    for k, tok in enumerate(output_ids):
        got = _at(cold, base + k)
        if got is None or got[0][0] is None or got[0][1] != tok:
            break
        (cold_lp, _), top = got
        served_top = served.output_top[k] if k < len(served.output_top) else ()
        if served_top and top:
            kls.append(topk_kl(tuple((t, lp) for lp, t in top), tuple((t, lp) for lp, t in served_top)))
        gaps.append(flip_margin(cold_lp, top, served_top))
    return kls, gaps


def flip_margin(cold_lp: float, top: Sequence[tuple[float, int]], served_top: Sequence[tuple[float, int]]) -> float:
    """One output token's flip margin (see :func:`noise_samples`): the greedy gap, or how far
    the noise moved the difference between the cold's top two tokens, whichever is larger."""
    margin = max((top[0][0] if top else cold_lp) - cold_lp, 0.0)
    if served_top and top:
        got_lp = {t: lp for lp, t in served_top}
        devs = [got_lp[t] - lp for lp, t in top[:2] if t in got_lp]
        margin = max(margin, abs(devs[0] - devs[1]) if len(devs) == 2 else 2 * max(map(abs, devs), default=0.0))
    return margin


def tolerance_from_noise(kls: Sequence[float], gaps: Sequence[float], *, factor: float = NOISE_FACTOR) -> Tolerance:
    """The non-exact tolerance from measured noise: KL cap and greedy tie at ``factor`` x the
    largest noise seen, never below :data:`~conformance.checks.kl.MIN_LIMIT` / :data:`MIN_TIE`
    and never above :data:`KL_CEILING` / :data:`TIE_CEILING`."""
    if len(kls) < MIN_NOISE_TOKENS:
        raise KitError(f"noise calibration: {len(kls)} tokens with top-k logprobs (need {MIN_NOISE_TOKENS}): no limit can be measured")
    return Tolerance(False, tie_eps=min(TIE_CEILING, max(MIN_TIE, factor * max(gaps, default=0.0))), logprob_atol=float("inf"),
                     kl_cap=min(KL_CEILING, max(MIN_LIMIT, factor * max(kls))))


@dataclass(frozen=True)
class Cold:
    """Cold log-probs from absolute position ``start``: ``entries[i]`` is (logprob of the
    token at ``start + i``, that token); ``top[i]`` the cold top-k there, best first."""

    start: int
    entries: tuple[Entry, ...]
    top: tuple[tuple[tuple[float, int], ...], ...]


@dataclass(frozen=True)
class ServedLogprobs:
    """What the server returned besides the tokens (empty when not asked)."""

    output: tuple[float, ...] = ()
    output_top: tuple[tuple[tuple[float, int], ...], ...] = ()
    input_start: int | None = None
    input: tuple[Entry, ...] = ()


def parse_entries(rows: Any) -> tuple[Entry, ...]:
    return tuple((None if r is None or r[0] is None else float(r[0]), int(r[1])) for r in (rows or []) if r is not None)


def parse_top(rows: Any) -> tuple[tuple[tuple[float, int], ...], ...]:
    out = []
    for pos in rows or []:
        out.append(tuple((float(e[0]), int(e[1])) for e in (pos or []) if e is not None and e[0] is not None))
    return tuple(out)


def cold_from_meta(meta: dict[str, Any], start: int) -> Cold:
    return Cold(start, parse_entries(meta.get("input_token_logprobs")), parse_top(meta.get("input_top_logprobs")))


def served_logprobs(meta: dict[str, Any], input_start: int | None) -> ServedLogprobs:
    out = parse_entries(meta.get("output_token_logprobs"))
    return ServedLogprobs(
        tuple(lp for lp, _ in out if lp is not None),
        parse_top(meta.get("output_top_logprobs")),
        input_start,
        parse_entries(meta.get("input_token_logprobs")) if input_start is not None else (),
    )


def _at(cold: Cold, pos: int) -> tuple[Entry, tuple[tuple[float, int], ...]] | None:
    i = pos - cold.start
    if i < 0 or i >= len(cold.entries):
        return None
    return cold.entries[i], (cold.top[i] if i < len(cold.top) else ())


def _top_problem(served: Sequence[tuple[float, int]], cold: Sequence[tuple[float, int]], tol: Tolerance, kl: float) -> str | None:
    """The served top-k against the cold one: exact logprobs, or (non-exact) their KL ``kl``."""
    if tol.exact:
        ref = {tok: lp for lp, tok in cold}
        worst = max((abs(lp - ref[tok]) for lp, tok in served if tok in ref), default=0.0)
        return None if worst <= tol.logprob_atol else f"top-k logprob off by {worst:.3g}"
    return None if kl <= tol.kl_cap else f"top-k KL {kl:.3g} > {tol.kl_cap:.3g}"


@dataclass(frozen=True)
class Difference:
    """One way a served request differs from its cold computation: which part of the answer
    (:data:`PARTS`), the line, the served token's facts (position, token, cold token)."""

    part: str
    line: str
    facts: tuple[tuple[str, int], ...] = ()


#: Where a difference is: the served output (tokens, logprobs, top-k), output logprobs the
#: request asked for and did not get, the cold side not lining up with the served tokens,
#: the served input logprobs.
PARTS = ("output", "logprobs_missing", "cold_misaligned", "input")


@dataclass(frozen=True)
class Comparison:
    """One served request against its cold computation, in one walk: the differences (first
    few), and what a passing request measured -- each compared output token's top-k KL
    (cold || served) and the largest |served - cold| logprob (the noise an exact-mode tolerance must stay above)."""

    differences: list[Difference]
    topk_kls: list[float]
    logprob_gap: float
    flip_margin: float = 0.0  # the largest flip margin of a compared token (:func:`flip_margin`; the greedy tie's noise)

    @property
    def problems(self) -> list[str]:
        return [d.line for d in self.differences]


def differential_problems(
    input_ids: Sequence[int], output_ids: Sequence[int], served: ServedLogprobs, cold: Cold, tol: Tolerance, *, expect_logprobs: bool = False
) -> list[str]:
    """Every way the served request differs from the cold computation (first few)."""
    return compare_served(input_ids, output_ids, served, cold, tol, expect_logprobs=expect_logprobs).problems


def compare_served(
    input_ids: Sequence[int], output_ids: Sequence[int], served: ServedLogprobs, cold: Cold, tol: Tolerance, *, expect_logprobs: bool = False
) -> Comparison:
    """The served request against the cold computation (:class:`Comparison`).
    ``expect_logprobs``: the request asked for output logprobs, so fewer than one per
    output token is itself a finding (nothing would be compared)."""
    problems: list[Difference] = []
    kls: list[float] = []
    gaps = [0.0]
    margins = [0.0]
    if expect_logprobs and len(served.output) < len(output_ids):
        problems.append(Difference("logprobs_missing", f"served {len(served.output)} output logprobs for {len(output_ids)} output tokens, although the request asked for them"))
    base = len(input_ids)
    for k, tok in enumerate(output_ids):
        got = _at(cold, base + k)
        if got is None:
            problems.append(Difference("cold_misaligned", f"cold side has no logprob for output token {k} (position {base + k})", (("position", base + k),)))
            break
        (cold_lp, cold_tok), top = got
        if cold_tok != tok:
            problems.append(Difference("cold_misaligned", f"cold side misaligned at output token {k}: its position {base + k} holds token {cold_tok}, the served token is {tok}",
                                       (("position", base + k), ("token", tok), ("cold_token", cold_tok))))
            break
        if cold_lp is None:
            problems.append(Difference("cold_misaligned", f"cold side misaligned at output token {k}: no logprob (null) for token {tok} at position {base + k}",
                                       (("position", base + k), ("token", tok))))
            break
        best = top[0][0] if top else cold_lp
        if cold_lp < best - tol.tie_eps:
            problems.append(Difference("output",
                f"output token {k} (position {base + k}) = {tok} is not the cold argmax "
                f"{top[0][1] if top else '?'}: cold logprob {cold_lp:.5g} vs best {best:.5g}", (("position", base + k), ("token", tok))))
            break
        if k < len(served.output):
            gaps.append(abs(served.output[k] - cold_lp))
            if gaps[-1] > tol.logprob_atol:
                problems.append(Difference("output", f"output logprob {k} (position {base + k}): served {served.output[k]:.6g}, cold {cold_lp:.6g}",
                                           (("position", base + k), ("token", tok))))
                break
        if k < len(served.output_top) and served.output_top[k] and top:
            kls.append(topk_kl(tuple((t, lp) for lp, t in top), tuple((t, lp) for lp, t in served.output_top[k])))
            margins.append(flip_margin(cold_lp, top, served.output_top[k]))
            why = _top_problem(served.output_top[k], top, tol, kls[-1])
            if why:
                problems.append(Difference("output", f"output token {k} (position {base + k}): {why}", (("position", base + k), ("token", tok))))
                break
    if served.input_start is not None:
        for j, (lp, tok) in enumerate(served.input):
            pos = served.input_start + j
            if lp is None:
                continue
            got = _at(cold, pos)
            if got is None or got[0][0] is None:
                problems.append(Difference("cold_misaligned", f"cold side has no input logprob at position {pos}", (("position", pos),)))
                break
            if got[0][1] != tok:
                problems.append(Difference("input", f"input logprob at position {pos} names token {tok}, the input has {got[0][1]}",
                                           (("position", pos), ("token", tok))))
                break
            gaps.append(abs(lp - got[0][0]))
            if gaps[-1] > tol.logprob_atol:
                problems.append(Difference("input", f"input logprob at position {pos}: served {lp:.6g}, cold {got[0][0]:.6g}", (("position", pos),)))
                break
    return Comparison(problems, kls, max(gaps), max(margins))
