"""Cross-target agreement: real SGLang on CPU against the kit's reference engine, same twin,
same requests in the same order.

Both serve the same weights in float32; SGLang runs its own model classes over the kit's
torch stand-ins for its GPU kernels, the engine runs transformers' classes.  They must
pick the same greedy tokens, give the same chosen-token and top-k logprobs within
``logprob_tol`` (SGLang computes the head in float32, the engine in float64: the measured
gap is ~1e-5), and report the same ``cached_tokens`` (both follow SGLang's snapshot
rules).  Where they differ the engine is wrong until shown otherwise.  Where SGLang's
per-node records say what its tree held for a step's prompt (``owed``,
``conformance.checks.held``), SGLang's hit is also judged against that, whatever the engine
reported: a lower one is ``hit_below_held`` (a stored state not reused, turn after turn of
the multi-turn chains).  The check refuses to pass vacuously: nothing compared, or no step
hit the cache on either side.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from conformance.recordings import AgreementStep, TokenLogprobs
from conformance.checks.findings import VACUOUS, Finding, failing
from conformance.checks.held import Expected, summary, tally
from conformance.records import Verdict

CHECK = "agreement"
DEFAULT_LOGPROB_TOL = 1e-4


def _top_gap(a: TokenLogprobs, b: TokenLogprobs) -> float:
    gap = 0.0
    for ta, tb in zip(a.top, b.top):
        db = dict(tb)
        for tok, lp in ta:
            if tok in db:
                gap = max(gap, abs(lp - db[tok]))
    return gap


def _differs(s: AgreementStep) -> str:
    """The kind of an answer that differs from the reference engine's on this step."""
    return "answer_differs_on_hit" if s.sglang.cached_tokens > 0 else "answer_differs_on_miss"


def agreement_verdict(steps: Sequence[AgreementStep], *, logprob_tol: float = DEFAULT_LOGPROB_TOL,
                      owed: Mapping[str, Expected] | None = None) -> Verdict:
    """``owed``: per step name, the hit SGLang owed it from its per-node records (exact or
    bounded, ``checks.held``); absent: no judgement against what its tree held."""
    owed = owed or {}
    rows, fails = [], []
    tokens = mismatched_tokens = cached_mismatches = hits = 0
    max_lp = max_top = 0.0
    for s in steps:
        a, b = s.sglang.logprobs, s.reference.logprobs
        n = min(len(a.token_ids), len(b.token_ids))
        first_diff = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), None)
        same = n if first_diff is None else first_diff
        lp_gap = max((abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])), default=0.0)
        top_gap = _top_gap(TokenLogprobs(a.token_ids[:same], a.logprobs[:same], a.top[:same]), TokenLogprobs(b.token_ids[:same], b.logprobs[:same], b.top[:same]))
        tokens += n
        mismatched_tokens += (n - same) + abs(len(a.token_ids) - len(b.token_ids))
        max_lp, max_top = max(max_lp, lp_gap), max(max_top, top_gap)
        hits += int(s.sglang.cached_tokens > 0 or s.reference.cached_tokens > 0)
        if s.sglang.cached_tokens != s.reference.cached_tokens:
            cached_mismatches += 1
            fails.append(Finding("hit_not_expected", f"{s.name}: cached_tokens sglang {s.sglang.cached_tokens} vs reference {s.reference.cached_tokens}",
                                 {"step": s.name, "cached_tokens": s.sglang.cached_tokens, "expected": s.reference.cached_tokens}))
        if first_diff is not None or len(a.token_ids) != len(b.token_ids):
            fails.append(Finding(_differs(s), f"{s.name}: greedy tokens differ from position {same} (sglang {a.token_ids[same:same + 3]} vs reference {b.token_ids[same:same + 3]})",
                                 {"step": s.name, "cached_tokens": s.sglang.cached_tokens, "position": same}))
        if max(lp_gap, top_gap) > logprob_tol:
            fails.append(Finding(_differs(s), f"{s.name}: logprobs differ by {max(lp_gap, top_gap):.3g} > {logprob_tol:g}",
                                 {"step": s.name, "cached_tokens": s.sglang.cached_tokens}))
        held = owed.get(s.name)
        below = held.finding(s.sglang.cached_tokens, s.sglang.input_len) if held is not None else None
        if below is not None:
            fails.append(Finding(below.kind, f"{s.name}: {below.line}", {**below.facts, "step": s.name}))
        rows.append({"step": s.name, "cached_sglang": s.sglang.cached_tokens, "cached_reference": s.reference.cached_tokens,
                     "tokens": n, "first_token_diff": first_diff, "max_logprob_gap": lp_gap, "max_top_logprob_gap": top_gap,
                     **({"held": held.owed} if held is not None and held.exact else {})})
    metrics = {"steps": len(steps), "tokens": tokens, "token_mismatches": mismatched_tokens, "cached_mismatches": cached_mismatches,
               "steps_with_hits": hits, "max_logprob_gap": max_lp, "max_top_logprob_gap": max_top, "logprob_tol": logprob_tol}
    details: dict = {"steps": rows}
    if owed:
        exact, bounded = tally(owed.values())
        metrics["held_exact"] = exact
        details["expected_hit"] = summary(exact, bounded)
    if fails:
        return failing(CHECK, fails, metrics, details, reason="; ".join(f.line for f in fails[:6]))
    if not tokens:
        return failing(CHECK, [Finding(VACUOUS, "vacuous: no token was compared")], metrics, details)
    if not hits:
        return failing(CHECK, [Finding(VACUOUS, "vacuous: no step hit the cache on either target, so no cached path was compared")], metrics, details)
    return Verdict(CHECK, "pass", metrics, "", details)
