"""What a failing check found, as records: a :class:`Finding` has a **kind** (one of
:data:`KINDS`, the one registry of them), its facts (cell-independent numbers: lengths,
positions, the pool, the sequence) and its line (what a user reads).

Every failing verdict carries its findings in ``details.findings`` (:func:`failing`), one
per failing request, sequence or pool, so each is judged on its own: a known-bug entry
excuses a finding by its kind and facts (``conformance.session.known_bugs``), never a
``"; "``-joined reason; the mutants' scoring counts a finding as a catch only when its
kind names a fault's effect or SGLang's own invariant (:attr:`Kind.catch`), and files the
others in their own columns (:attr:`Kind.column`).  Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from conformance.errors import KitError
from conformance.records import Verdict

#: The column of a finding that is not a catch: why it proves nothing about a fault.
VACUOUS, HANG, DEATH, KIT = "vacuous", "hang", "server death", "crash"


@dataclass(frozen=True)
class Kind:
    """One kind of finding: what it means, and whether it names a fault's effect (or
    SGLang's own invariant), i.e. counts as a catch (``column`` None), or is its own column."""

    name: str
    summary: str
    column: str | None = None

    @property
    def catch(self) -> bool:
        return self.column is None


KINDS: dict[str, Kind] = {k.name: k for k in (
    # answers against the cache-off computation
    Kind("answer_differs_on_hit", "an answer served on a cache hit (cached_tokens > 0) differs from the cache-off computation"),
    Kind("answer_differs_on_miss", "an answer served without a hit differs from the cache-off computation"),
    Kind("answers_differ", "answers differ from the cache-off baseline, counted over a set (GSM8K completions)"),
    Kind("accuracy_below", "accuracy significantly below its threshold or the cache-off baseline"),
    Kind("logprobs_missing", "fewer output logprobs than output tokens, although the request asked for them"),
    Kind("input_logprobs_differ", "served input logprobs differ from the cache-off ones (value or the token they name)"),
    Kind("cold_misaligned", "the cache-off computation does not line up with the served tokens: a position of its "
                            "logprobs names another token (the ids SGLang returns), or holds none"),
    # cached_tokens against what SGLang's tree held
    Kind("hit_below_held", "cached_tokens below a state SGLang's tree held for the prompt at its admission (per-node "
                           "records: stored before, not freed since, or freed outside SGLang's eviction walk)"),
    Kind("hit_above_stored", "cached_tokens names a state SGLang's tree never took before the admission (per-node records)"),
    Kind("state_not_stored", "a state the release's storage rule stores for sure was never taken by SGLang's tree "
                             "(per-node records), so a later hit fell short of it"),
    Kind("hit_below_certain", "cached_tokens below a state stored for sure, with no eviction seen (no per-node record answers)"),
    Kind("hit_above_allowed", "cached_tokens above every state that may have been stored"),
    Kind("hit_not_expected", "cached_tokens other than the scripted scenario's prefix oracle predicts"),
    Kind("reuse_counter_mismatch", "the server's own reuse counters disagree with the cached_tokens it reported"),
    # pools at idle
    Kind("leak_mamba", "the Mamba pool's idle invariant broke: slots leaked, locked, counted twice or missing from its terms"),
    Kind("leak_kv", "the KV pool's idle invariant broke: tokens leaked, locked, counted twice or missing from its terms"),
    Kind("leak_host", "a HiCache host pool's idle invariant broke"),
    Kind("stuck_at_idle", "a gauge that must read 0 at idle does not (a PD queue, a request still held)"),
    Kind("tree_structure", "SGLang's radix tree broke a rule of the kit's tree audit or SGLang's own sanity check "
                           "(the rule and the node's path: key lengths from the root)"),
    Kind("track_slots", "resident ping-pong track slots are not what the strategy promises"),
    Kind("session_abort", "an aborted session turn was not cleaned up as SGLang promises"),
    # answers as asked
    Kind("prompt_mismatch", "prompt_tokens is not the input the request meant"),
    Kind("refused_fits", "a request that fits was refused"),
    Kind("served_unfit", "a request that does not fit was served"),
    Kind("finish_wrong", "a request finished otherwise than asked (length, reason, too many tokens)"),
    Kind("session_refused", "SGLang refused to open or close a session"),
    # deaths: SGLang's own invariants are catches, an unexplained death is not
    Kind("server_died:assertion", "the server died on one of SGLang's own assert statements"),
    Kind("server_died:idle_check", "SGLang's strict idle check killed the server; its report names no pool"),
    Kind("server_died:exception", "the server died on an exception raised in its code (not an assertion of SGLang's)", DEATH),
    Kind("server_died:unexplained", "the server stopped serving and its log names no cause", DEATH),
    Kind("server_died:startup", "the server died before it served", DEATH),
    # what proves nothing
    Kind("hung", "a request did not answer in time", HANG),
    Kind("vacuous", "nothing was compared (no program, too few hits, no noise floor, gauges that never moved)", VACUOUS),
    Kind("kit_error", "the kit could not judge (a gauge missing, a scenario that raised)", KIT),
    Kind("unclassified", "a failing verdict of a check that names no kinds yet (its reason is the finding)"),
)}


def kind_named(name: str, where: str = "kind") -> Kind:
    """The registered kind ``name``; a one-line KitError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise KitError(f"{where}: unknown finding kind {name!r}; known: {', '.join(KINDS)}") from None


@dataclass(frozen=True)
class Finding:
    """One failing thing a check saw: its kind, the line a user reads, its facts."""

    kind: str
    line: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kind_named(self.kind)

    @property
    def catch(self) -> bool:
        return KINDS[self.kind].catch

    def __str__(self) -> str:
        return self.line

    def __contains__(self, text: str) -> bool:
        """A finding holds a text where its line does (``"cached_tokens 0" in finding``)."""
        return text in self.line

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "line": self.line, "facts": dict(self.facts)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Finding:
        return cls(str(raw["kind"]), str(raw.get("line", "")), dict(raw.get("facts") or {}))


def failing(check: str, findings: Iterable[Finding], metrics: Mapping[str, Any] | None = None,
            details: Mapping[str, Any] | None = None, *, shown: int | None = None, reason: str | None = None) -> Verdict:
    """A failing verdict with its findings in ``details.findings``; its reason joins the
    findings' lines (the first ``shown``) unless given."""
    found = list(findings)
    if not found:
        raise ValueError("a failing verdict needs a finding")
    lines = [f.line for f in found]
    if reason is None:
        more = f" (+{len(lines) - shown} more)" if shown is not None and len(lines) > shown else ""
        reason = "; ".join(lines[:shown]) + more
    return Verdict(check, "fail", dict(metrics or {}), reason, {**(details or {}), "findings": [f.to_json() for f in found]})


def findings_of(verdict: Verdict | Mapping[str, Any]) -> list[Finding]:
    """A failing verdict's findings (a verdict or its report.json form); one ``unclassified``
    finding (its reason) where the check names none; none for a verdict that did not fail."""
    status = verdict.status if isinstance(verdict, Verdict) else verdict.get("status")
    details = (verdict.details if isinstance(verdict, Verdict) else verdict.get("details")) or {}
    reason = (verdict.reason if isinstance(verdict, Verdict) else verdict.get("reason")) or ""
    if status != "fail":
        return []
    raw = details.get("findings")
    if raw:
        return [Finding.from_json(r) for r in raw]
    return [Finding("unclassified", reason)]
