"""Prefix-branching check: observed ``meta_info.cached_tokens`` per request of a branching
tree against the prefix oracle, and outputs on a hit against cold outputs.

Requests are replayed through a :class:`~conformance.checks.prefix_oracle.PrefixOracle`
in the order they were sent. A group of requests sent together (concurrent siblings) may
be admitted together or one after another, so each member accepts either prediction.
After eviction pressure the oracle is an upper bound, so a request accepts any length
that was ever stored for its prefix (``candidate_hits``). Outputs on a hit must equal the
cold outputs exactly (CPU twins: the same tokens, and each served token's logprob within
float noise of the cold one, so a wrong state that leaves a tiny model's argmax alone is
still seen) or, outside exact mode, keep the first token's top-k KL under a cap. A
mismatch fails with the request's path in the tree.
"""

from __future__ import annotations

from typing import TypeVar

import copy
from typing import Sequence

from conformance.checks.differential import Tolerance
from conformance.checks.kl import topk_kl
from conformance.checks.prefix_oracle import PrefixOracle
from conformance.errors import KitError
from conformance.recordings import TreeRecording, TreeRequestRecord
from conformance.checks.findings import Finding, failing
from conformance.records import Verdict

T = TypeVar("T")
CHECK = "prefix_branching"


def consecutive_groups(reqs: Sequence[T]) -> list[list[T]]:
    """Runs of requests sharing ``.group`` (sent together), in order."""
    out: list[list[T]] = []
    for r in reqs:
        if out and out[-1][0].group == r.group:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _record(oracle: PrefixOracle, members: Sequence[TreeRequestRecord], *, concurrent: bool, lookahead: int, chunked_prefill_size: int | None) -> None:
    if not concurrent:
        for m in members:
            oracle.record_request(m.prompt, m.output, chunked_prefill_size=chunked_prefill_size, lookahead=lookahead)
        return
    plans = [oracle.prefill_plan(m.prompt, chunked_prefill_size=chunked_prefill_size) for m in members]
    for m, plan in zip(members, plans):
        for _end, stored in plan:
            oracle.store(m.prompt, stored)
    for m in members:
        oracle.record_finished(m.prompt, m.output, lookahead=lookahead)


def _accepted(oracle: PrefixOracle, group: list[TreeRequestRecord], j: int, *, lookahead: int, chunked_prefill_size: int | None) -> tuple[int, set[int]]:
    """(prediction if admitted together, every acceptable value) for member j."""
    together = oracle.expected_hit(group[j].prompt)
    ok = {together}
    if j:
        seq = copy.deepcopy(oracle)
        _record(seq, group[:j], concurrent=False, lookahead=lookahead, chunked_prefill_size=chunked_prefill_size)
        ok.add(seq.expected_hit(group[j].prompt))
    if group[j].after_pressure:
        ok |= oracle.candidate_hits(group[j].prompt)
    return together, ok


def _outputs_match(r: TreeRequestRecord, exact: bool, kl_cap: float) -> tuple[bool, str]:
    if exact:
        if not r.cold_output:
            raise KitError(f"prefix_branching: request {r.path} has no cold output to compare")
        if tuple(r.output) != tuple(r.cold_output):
            first = next((i for i, (a, b) in enumerate(zip(r.output, r.cold_output)) if a != b), min(len(r.output), len(r.cold_output)))
            return False, f"output differs from the cold output at token {first}"
        atol = Tolerance().logprob_atol
        gaps = [abs(a - b) for a, b in zip(r.output_logprobs, r.cold_output_logprobs)]
        worst = max(range(len(gaps)), key=gaps.__getitem__, default=None)
        if worst is not None and gaps[worst] > atol:
            return False, f"output token {worst} logprob {r.output_logprobs[worst]:.6f} vs cold {r.cold_output_logprobs[worst]:.6f} (|diff| {gaps[worst]:.2e} > {atol:g})"
        return True, ""
    if not r.first_top or not r.cold_first_top:
        raise KitError(f"prefix_branching: request {r.path} has no first-token top-k to compare (non-exact mode)")
    kl = topk_kl(r.cold_first_top, r.first_top)
    return (kl <= kl_cap, "" if kl <= kl_cap else f"first-token top-k KL {kl:.3g} > {kl_cap:.3g}")


def prefix_branching_verdict(
    rec: TreeRecording,
    oracle: PrefixOracle,
    *,
    lookahead: int = 0,
    chunked_prefill_size: int | None = None,
    exact: bool = True,
    kl_cap: float = 0.005,
) -> Verdict:
    """Judge a tree run; ``oracle`` must be fresh (it is copied, never mutated)."""
    empty = {"requests": len(rec.requests), "hits_expected": 0, "hits_observed": 0, "mismatches": 0}
    if not rec.requests:
        return Verdict(CHECK, "skip", empty, "no request was recorded")
    if not rec.cache_enabled:
        return Verdict(CHECK, "skip", empty, "radix cache disabled on the server: no cache hit to predict")
    oracle = copy.deepcopy(oracle)
    rows, problems = [], []
    hits_expected = hits_observed = hit_mism = out_mism = exp_tokens = obs_tokens = 0
    for group in consecutive_groups(rec.requests):
        if any(m.flushed_before for m in group):
            oracle.flush()
        verdicts = []
        for j, r in enumerate(group):
            together, ok = _accepted(oracle, group, j, lookahead=lookahead, chunked_prefill_size=chunked_prefill_size)
            hit_ok = r.cached_tokens in ok
            expected = r.cached_tokens if hit_ok else together  # the prediction that applies
            out_ok, why = _outputs_match(r, exact, kl_cap) if r.cached_tokens > 0 else (True, "")
            verdicts.append((r, expected, ok, hit_ok, out_ok, why))
        admitted_together = all(r.cached_tokens == oracle.expected_hit(r.prompt) for r in group)
        _record(oracle, group, concurrent=admitted_together, lookahead=lookahead, chunked_prefill_size=chunked_prefill_size)
        for r, expected, ok, hit_ok, out_ok, why in verdicts:
            hits_expected += expected > 0
            hits_observed += r.cached_tokens > 0
            exp_tokens += expected
            obs_tokens += r.cached_tokens
            if not hit_ok:
                hit_mism += 1
                problems.append(Finding("hit_below_certain" if r.cached_tokens < min(ok) else "hit_not_expected",
                                        f"{r.path}: cached_tokens {r.cached_tokens}, expected {'/'.join(map(str, sorted(ok)))}",
                                        {"path": r.path, "cached_tokens": r.cached_tokens, "expected": sorted(ok)}))
            if not out_ok:
                out_mism += 1
                problems.append(Finding("answer_differs_on_hit", f"{r.path}: {why} (cached {r.cached_tokens})",
                                        {"path": r.path, "cached_tokens": r.cached_tokens}))
            rows.append(
                {
                    "path": r.path,
                    "prompt_len": len(r.prompt),
                    "group": r.group,
                    "expected": expected,
                    "accepted": sorted(ok),
                    "observed": r.cached_tokens,
                    "output_matches_cold": out_ok,
                }
            )
    mismatches = sum(1 for row in rows if row["observed"] not in row["accepted"] or not row["output_matches_cold"])
    metrics = {
        "requests": len(rec.requests),
        "hits_expected": hits_expected,
        "hits_observed": hits_observed,
        "mismatches": mismatches,
        "hit_mismatches": hit_mism,
        "output_mismatches": out_mism,
        "cached_tokens_expected": exp_tokens,
        "cached_tokens_observed": obs_tokens,
    }
    details = {"requests": rows, "tree": rec.tree}
    if problems:
        return failing(CHECK, problems, metrics, details, shown=5)
    if hits_expected == 0:
        return Verdict(CHECK, "skip", metrics, "vacuous workload: the oracle expects no cache hit in this tree", details)
    return Verdict(CHECK, "pass", metrics, "", details)
