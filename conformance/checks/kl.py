"""KL check: logprobs served on a cache hit against a cold re-prefill of the same tokens.

Two estimators, both reported:

* SGLang's chosen-token estimator ``k3 = mean(exp(r) - 1 - r)``, ``r = ref - served`` on
  the sampled tokens (so numbers compare with SGLang's own thresholds);
* a true top-k KL(reference || served) per position over the union of both top-k sets
  plus one tail bucket (a token missing from one side's top-k gets that side's k-th
  logprob or its remaining tail mass, whichever is smaller; both rows are renormalised),
  which sees the whole distribution move, not only the chosen token.

The threshold on the top-k KL is relative to a measured noise floor:
``limit = min(abs_cap, max(floor_factor * floor, min_limit))``.  The floor is not a rerun of
the reference (on a deterministic server that is exactly 0, and any healthy wobble between
the decode path and a prefill would then fail): it is the KL between the cold reference and
two cold paths that differ from it the way a hit does -- the same inputs generated cold
(prefill, then decode steps, in the batch the hit was served in), compared on the positions
whose history it shares with the served tokens, and the reference prefill again one
sequence at a time.  ``min_limit`` is the stated absolute minimum (:data:`EXACT_MIN_LIMIT`,
:data:`MIN_LIMIT`).
Exact mode (deterministic CPU twins) also demands that every served greedy token is the
one the cold run picks. Statistics are per sequence (the maximum is what fails), not a
mean that dilutes a bug hitting few sequences. The check never passes vacuously: a
disabled radix cache skips, too few prompts hitting the cache fails (or skips when the
caller allows zero hits, e.g. for fault cells).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from conformance.errors import KitError
from conformance.checks.findings import VACUOUS, Finding, failing
from conformance.checks.held import Expected
from conformance.recordings import KLRecording, KLSequence, TopK
from conformance.records import Verdict

CHECK = "kl"
_TINY = 1e-30
#: The limit never goes below these, whatever the floor: exact mode (deterministic CPU
#: float32) and otherwise.  1e-3 is above the batch-composition noise measured on
#: sglang-cpu in bfloat16 (a sequence's mean top-k KL moves by up to 3.7e-4 when its batch
#: changes, a noise the floor's cold paths need not hit in every run), above a 0.02-logit
#: wobble (3.6e-5), and half SGLang's own chosen-token threshold (0.002).
EXACT_MIN_LIMIT = 1e-9
MIN_LIMIT = 1e-3
#: Outside exact mode, limits are this many times the noise measured between healthy cold
#: paths (the suites pass it as ``noise_factor``).  With the models' ``floor_factor`` of 100
#: (sized for exact mode's ~1e-11 floors) a bfloat16 floor of ~1e-3 always gave the absolute
#: cap; at 4 the limit follows the measured noise (recorded bf16 sequences on sglang-cpu sit
#: at up to 1x their floor, a clean token at up to 4x the mean noise: docs/kl-noise.md).
NOISE_FACTOR = 4.0

# ------------------------------------------------------------------ estimators
def k3_terms(reference: Sequence[float], served: Sequence[float]) -> list[float]:
    """SGLang's per-token estimator ``exp(r) - 1 - r`` with ``r = ref - served``."""
    out = []
    for a, b in zip(reference, served):
        r = float(a) - float(b)
        out.append(math.expm1(r) - r)
    return out


def _row(top: TopK, ids: Sequence[int]) -> list[float]:
    given = {int(t): float(lp) for t, lp in top}
    tail = max(1.0 - sum(math.exp(lp) for lp in given.values()), 0.0)
    fill = min(min(given.values()), math.log(max(tail, _TINY)))
    probs = [math.exp(given.get(i, fill)) for i in ids]
    probs.append(max(1.0 - sum(probs), _TINY))
    total = sum(probs)
    return [max(p / total, _TINY) for p in probs]


def topk_kl(reference: TopK, served: TopK) -> float:
    """KL(reference || served) over the union of both top-k sets plus a tail bucket."""
    if not reference or not served:
        raise KitError("topk_kl: a position has no top-k logprobs (record with top_logprobs_num >= 1)")
    ids = list(dict.fromkeys([int(t) for t, _ in reference] + [int(t) for t, _ in served]))
    p, q = _row(reference, ids), _row(served, ids)
    return max(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q)), 0.0)


def tail_mass(top: TopK) -> float:
    return max(1.0 - sum(math.exp(float(lp)) for _, lp in top), 0.0)


@dataclass(frozen=True)
class _SeqStats:
    k3: float
    topk_mean: float
    topk_max: float
    per_token: tuple[float, ...]
    argmax_mismatches: int
    cold_mismatches: int
    floor_mean: float | None
    floor_max: float | None
    tail_max: float


def _validate(seq: KLSequence, where: str) -> None:
    n = len(seq.served.token_ids)
    for name, tl in (("served", seq.served), ("reference", seq.reference), ("floor", seq.floor), ("floor_prefill", seq.floor_prefill)):
        if tl is None:
            continue
        if len(tl.logprobs) != n or len(tl.token_ids) != n or len(tl.top) != n:
            raise KitError(f"kl: {where}: {name} has {len(tl.logprobs)} logprobs/{len(tl.top)} top-k rows for {n} tokens")
    for name, tl in (("reference", seq.reference), ("floor_prefill", seq.floor_prefill)):
        if tl is not None and tuple(tl.token_ids) != tuple(seq.served.token_ids):
            raise KitError(f"kl: {where}: the {name} was not prefilled with the served tokens")


def shared_history(a: Sequence[int], b: Sequence[int]) -> int:
    """How many positions of two generations are conditioned on the same tokens: up to and
    including the first position where they pick different tokens."""
    for j, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return j + 1
    return min(len(a), len(b))


def floor_paths(seq: KLSequence) -> list[list[float]]:
    """Per-position KL between the reference and each cold floor path, on the positions
    each path shares with the served tokens' history (no list without a floor)."""
    paths = []
    if seq.floor is not None:
        n = shared_history(seq.served.token_ids, seq.floor.token_ids)
        paths.append([topk_kl(r, f) for r, f in zip(seq.reference.top[:n], seq.floor.top[:n])])
    if seq.floor_prefill is not None:
        paths.append([topk_kl(r, f) for r, f in zip(seq.reference.top, seq.floor_prefill.top)])
    return paths


def _floor_mean(paths: list[list[float]]) -> float | None:
    """The sequence's floor: the noisier of its cold paths (mean over compared positions)."""
    return max((sum(p) / len(p) if p else 0.0 for p in paths), default=None)


def _sequence_stats(seq: KLSequence) -> _SeqStats:
    per_token = tuple(topk_kl(r, s) for r, s in zip(seq.reference.top, seq.served.top))
    k3 = k3_terms(seq.reference.logprobs, seq.served.logprobs)
    argmax = sum(1 for tok, top in zip(seq.served.token_ids, seq.reference.top) if top and int(top[0][0]) != int(tok))
    cold = sum(1 for a, b in zip(seq.served.token_ids, seq.cold_tokens) if int(a) != int(b))
    cold += max(0, len(seq.served.token_ids) - len(seq.cold_tokens)) if seq.cold_tokens else 0
    paths = floor_paths(seq)
    floor_mean = _floor_mean(paths)
    floor_max = max((v for p in paths for v in p), default=0.0) if paths else None
    tails = [tail_mass(t) for t in (*seq.reference.top, *seq.served.top)]
    return _SeqStats(
        k3=sum(k3) / len(k3) if k3 else 0.0,
        topk_mean=sum(per_token) / len(per_token) if per_token else 0.0,
        topk_max=max(per_token, default=0.0),
        per_token=per_token,
        argmax_mismatches=argmax,
        cold_mismatches=cold,
        floor_mean=floor_mean,
        floor_max=floor_max,
        tail_max=max(tails, default=0.0),
    )


def boundaries_in(lo: int, hi: int, grids: Sequence[int]) -> list[int]:
    """Every multiple of any of ``grids`` in ``[lo, hi]``, sorted."""
    out: set[int] = set()
    for g in grids:
        if g > 0:
            out.update(range(-(-lo // g) * g, hi + 1, g))
    return sorted(out)


# ------------------------------------------------------------------ verdict
def _lost_states(seqs: Sequence[KLSequence], owed: Sequence[Expected], modelled: Sequence[int] | None) -> list[tuple[int, Finding]]:
    """The sequences that missed the hit the storage rule owes them (``modelled``) while
    SGLang's tree, by its per-node records, never took that state (it held nothing that
    long and freed nothing that long before the admission): each with its
    ``state_not_stored`` finding."""
    out = []
    for i, (seq, e, want) in enumerate(zip(seqs, owed, modelled or ())):
        if e.exact and want > max(seq.cached_tokens, e.owed) and not any(n >= want for n in e.freed):
            out.append((i, Finding("state_not_stored", f"sequence {i} ({seq.scenario}): cached_tokens {seq.cached_tokens}, the "
                                   f"prefix model owes {want} (input {len(seq.input_ids)} tokens; SGLang's tree never took the state "
                                   f"for the prefix of {want} tokens before it admitted the request (per-node records))",
                                   {**_sequence_facts(i, seq), "modelled": want})))
    return out


def _freed_by(owed: Sequence[Expected]) -> str:
    """What freed the states of the prompts no hit was owed, as per-node records say."""
    by: dict[str, int] = {}
    for e in owed:
        if e.exact and e.owed == 0:
            for why in e.freed.values():
                for w in why:
                    by[w] = by.get(w, 0) + 1
    return ", ".join(f"{n} freed by {w}" for w, n in sorted(by.items())) or "none stored"


def kl_verdict(
    rec: KLRecording,
    *,
    chunk: int,
    track_interval: int,
    k3_max: float = 0.002,
    floor_factor: float = 100.0,
    abs_cap: float = 0.005,
    hit_fraction_min: float = 0.9,
    exact: bool = False,
    min_limit: float | None = None,
    noise_factor: float | None = None,
    owed: Sequence[Expected] | None = None,
    may_store_nothing: bool = False,
    modelled: Sequence[int] | None = None,
) -> Verdict:
    """Judge a KL recording.  ``min_limit`` (the stated absolute minimum of the limit)
    defaults to :data:`EXACT_MIN_LIMIT` in exact mode, :data:`MIN_LIMIT` otherwise.
    ``noise_factor`` (outside exact mode) replaces ``floor_factor``: the limit is that many
    times the measured floor, ``abs_cap`` only bounding it.  ``owed``: per sequence, the hit
    SGLang's tree owed its served request (``checks.held``): a hit below it is
    ``hit_below_held``, and a sequence whose states the tree took and freed before the
    admission (exact: nothing held) is owed no hit, so it does not count against
    ``hit_fraction_min``; with ``may_store_nothing`` (a reasoning turn on a strip-thinking
    server: SGLang keeps only states at or below its prompt) so is one the tree never took a
    state for.  ``modelled``: per sequence, the hit the prefix model's storage rule owes it
    (``checks.prefix_oracle``); a sequence that missed it while SGLang's tree never took that
    state (per-node records) is ``state_not_stored``, named as such rather than counted
    against ``hit_fraction_min``."""
    if not rec.sequences:
        return Verdict(CHECK, "skip", _empty_metrics(), "no sequence was recorded")
    if not rec.cache_enabled:
        return Verdict(CHECK, "skip", _empty_metrics(), "radix cache disabled on the server: no cache hit to compare")
    for i, seq in enumerate(rec.sequences):
        _validate(seq, f"sequence {i} ({seq.scenario})")
    owed = list(owed) if owed is not None else [Expected(False, why="not asked")] * len(rec.sequences)
    held = [f for s, e in zip(rec.sequences, owed) if (f := e.finding(s.cached_tokens, s.start)) is not None]
    # owed no hit: the tree took a state for the prompt and freed it before the admission (pressure),
    # or took none where the cell's contract lets it keep none
    unowed = [i for i, (s, e) in enumerate(zip(rec.sequences, owed))
              if e.exact and e.owed == 0 and (e.freed or may_store_nothing) and s.cached_tokens == 0]
    lost = [] if may_store_nothing else [(i, f) for i, f in _lost_states(rec.sequences, owed, modelled) if i not in unowed]
    held += [f for _, f in lost]  # a typed miss: not also a shortfall of the hit fraction
    hits = [(i, s) for i, s in enumerate(rec.sequences) if s.cached_tokens > 0]
    hit_fraction = len(hits) / len(rec.sequences)
    if not hits:
        if held:
            return failing(CHECK, held, {**_empty_metrics(), "hit_fraction": 0.0})
        if len(unowed) == len(rec.sequences):
            return Verdict(CHECK, "skip", {**_empty_metrics(), "hit_fraction": 0.0},
                           f"not applicable on this cell: SGLang's tree held no state for any of the {len(unowed)} prompts when it "
                           f"admitted them ({_freed_by(owed)}; per-node records): nothing to compare")
        status = "skip" if hit_fraction_min <= 0 else "fail"
        return Verdict(CHECK, status, {**_empty_metrics(), "hit_fraction": 0.0}, f"no prompt hit the cache (0/{len(rec.sequences)}): nothing was compared")

    stats = {i: _sequence_stats(s) for i, s in hits}
    tokens = sum(len(s.served.token_ids) for _, s in hits)
    floors = [st.floor_mean for st in stats.values() if st.floor_mean is not None]
    floor_token_maxes = [st.floor_max for st in stats.values() if st.floor_max is not None]
    noise_floor = max(floors) if floors else None
    lim_floor = min_limit if min_limit is not None else (EXACT_MIN_LIMIT if exact else MIN_LIMIT)
    if noise_factor is not None and not exact:
        floor_factor = noise_factor
    limit = min(abs_cap, max(floor_factor * (noise_floor or 0.0), lim_floor))
    token_limit = min(abs_cap, max(floor_factor * max(floor_token_maxes, default=0.0), lim_floor)) if exact else None

    k3_mean = sum(st.k3 for st in stats.values()) / len(stats)
    topk_mean = sum(st.topk_mean for st in stats.values()) / len(stats)
    seq_max_i = max(stats, key=lambda i: stats[i].topk_mean)
    max_token = max(st.topk_max for st in stats.values())
    argmax_mism = sum(st.argmax_mismatches for st in stats.values())
    cold_recorded = any(s.cold_tokens for _, s in hits)
    cold_mism = sum(st.cold_mismatches for st in stats.values())

    metrics = {
        "tokens": tokens,
        "k3_mean": k3_mean,
        "topk_kl_mean": topk_mean,
        "max_token_kl": max_token,
        "hit_fraction": hit_fraction,
        "noise_floor": noise_floor,
        "sequences": len(rec.sequences),
        "k3_seq_max": max(st.k3 for st in stats.values()),
        "topk_kl_seq_max": stats[seq_max_i].topk_mean,
        "topk_limit": limit,
        "k3_threshold": k3_max,
        "noise_floor_max_token": max(floor_token_maxes, default=None),
        "argmax_mismatch_fraction": argmax_mism / tokens if tokens else 0.0,
        "greedy_mismatch_fraction": cold_mism / tokens if cold_recorded and tokens else None,
        "tail_mass_max": max(st.tail_max for st in stats.values()),
        "exact": exact,
        "topk_min_limit": lim_floor,
        "floor_factor": floor_factor,
        "not_owed": len(unowed),
        "states_not_stored": len(lost),
    }
    fails: list[Finding] = list(held)
    owed_n = len(rec.sequences) - len(unowed) - len(lost)
    if len(hits) < hit_fraction_min * owed_n:
        fails.append(Finding(VACUOUS, f"only {len(hits)}/{owed_n} prompts hit the cache (need {hit_fraction_min:.0%})"
                             + (f"; {len(unowed)} more were owed no hit: SGLang's tree held no state for them ({_freed_by(owed)})" if unowed else "")))
    if noise_floor is None:
        fails.append(Finding(VACUOUS, "no noise floor was measured (record the cold generate and the one-by-one prefill)"))
    elif noise_floor > abs_cap:
        fails.append(Finding(VACUOUS, f"noise floor {noise_floor:.3g} exceeds the absolute cap {abs_cap:.3g}: the target is too noisy to judge"))
    for i in sorted(stats, key=lambda i: -stats[i].topk_mean):  # each hit sequence judged on its own, the worst first
        fails += _sequence_findings(i, rec.sequences[i], stats[i], limit, token_limit)
    if k3_mean > k3_max:
        worst = max(stats, key=lambda i: stats[i].k3)
        fails.append(Finding("answer_differs_on_hit", f"k3 mean {k3_mean:.3g} > SGLang threshold {k3_max:.3g}",
                             {**_sequence_facts(worst, rec.sequences[worst]), "k3_mean": k3_mean}))

    details = _details(rec, stats, limit, chunk, track_interval)
    if modelled is not None:  # per sequence: the hit the storage rule owes, and the hit served
        details["modelled"] = [{"index": i, "modelled": m, "cached_tokens": s.cached_tokens} for i, (m, s) in enumerate(zip(modelled, rec.sequences))]
    if fails:
        return failing(CHECK, fails, metrics, details)
    return Verdict(CHECK, "pass", metrics, "", details)


def _sequence_facts(i: int, seq: KLSequence) -> dict:
    return {"sequence": i, "scenario": seq.scenario, "start": seq.start, "cached_tokens": seq.cached_tokens}


def _sequence_findings(i: int, seq: KLSequence, st: _SeqStats, limit: float, token_limit: float | None) -> list[Finding]:
    """One hit sequence against the limits: each way it differs from the cold run, a finding."""
    where = f"on sequence {i} ({seq.scenario}, start {seq.start}, cached {seq.cached_tokens})"
    facts = _sequence_facts(i, seq)
    tokens = len(seq.served.token_ids)
    out = []
    if st.topk_mean > limit:
        out.append(Finding("answer_differs_on_hit", f"top-k KL {st.topk_mean:.3g} > limit {limit:.3g} {where}", {**facts, "topk_kl": st.topk_mean}))
    if token_limit is not None and st.topk_max > token_limit:
        out.append(Finding("answer_differs_on_hit", f"exact mode: max per-token KL {st.topk_max:.3g} > {token_limit:.3g} {where}", facts))
    if token_limit is not None and st.argmax_mismatches:
        out.append(Finding("answer_differs_on_hit", f"exact mode: {st.argmax_mismatches}/{tokens} served greedy tokens differ from the cold argmax {where}", facts))
    if token_limit is not None and st.cold_mismatches:
        out.append(Finding("answer_differs_on_hit", f"exact mode: {st.cold_mismatches}/{tokens} served tokens differ from the cold generate {where}", facts))
    return out


def _empty_metrics() -> dict[str, float | int | None]:
    return {"tokens": 0, "k3_mean": None, "topk_kl_mean": None, "max_token_kl": None, "hit_fraction": None, "noise_floor": None}


def _details(rec: KLRecording, stats: dict[int, _SeqStats], limit: float, chunk: int, track_interval: int) -> dict:
    by_pos: dict[int, list[float]] = {}
    rows = []
    for i, st in stats.items():
        seq = rec.sequences[i]
        for j, v in enumerate(st.per_token):
            by_pos.setdefault(seq.start + j, []).append(v)
        first_over = next((seq.start + j for j, v in enumerate(st.per_token) if v > limit), None)
        rows.append(
            {
                "index": i,
                "scenario": seq.scenario,
                "start": seq.start,
                "cached_tokens": seq.cached_tokens,
                "k3": st.k3,
                "topk_kl_mean": st.topk_mean,
                "topk_kl_max": st.topk_max,
                "noise_floor": st.floor_mean,
                "first_position_over_limit": first_over,
            }
        )
    per_position = [[p, sum(v) / len(v)] for p, v in sorted(by_pos.items())]
    lo, hi = (per_position[0][0], per_position[-1][0]) if per_position else (0, 0)
    return {"per_position": per_position, "boundaries": boundaries_in(lo, hi, (chunk, track_interval)), "sequences": rows}
