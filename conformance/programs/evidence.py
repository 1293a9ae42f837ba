"""What SGLang was seen doing during a program, for the oracle's relaxations to rest on.

The oracle allows a hit below the best stored prefix only where something in the same run
shows why: an eviction counted on SGLang's eviction path, a prefill that SGLang's
scheduler cut.  Both are cumulative counters on ``/metrics`` (exported by the kit's
observe plugin inside real SGLang, ``conformance/sglang_plugins/observe.py``, and by the
reference server under the same names).  The runner scrapes them whenever answers
arrive, stamped with the program clock (the sequence numbers of requests' send and
answer), so a relaxation asks "did the counter grow between these two moments?".
Per request (real SGLang: the observe plugin's ``<log>.requests.jsonl``), the
:class:`RequestLog` says where each prefill was cut and its mamba checkpoint tracked, and
which requests' kept checkpoint a failed lazy allocation dropped: the oracle's cut and
lazy-drop relaxations are then granted to those requests only, at those places.  It also
places each eviction walk among the prefills, which orders an eviction after a store the
client's clock cannot place (a burst member's).  Per node (every release 0.5.11 on, where
the plugin's start line says ``state_evictions``): which mamba states
SGLang's tree took and which of them a tree step freed, each named by its prefix's
length and digest (``conformance/sglang_plugins/token_digest.py``) and each free by what
freed it (``by``: SGLang's eviction ``walk``, an ``insert``'s per-path cap, ``other``), so
"was THIS stored prefix evicted" has an answer (:meth:`RequestLog.state_evicted_between`),
not only "did any eviction run", and the states the tree held at a request's admission are
known (:meth:`RequestLog.held_at_admission`): the hit SGLang owed it.
Pure bookkeeping apart from :meth:`RequestLog.refresh` (a file read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from conformance.checks.held import Expected
from conformance.checks.hit_bounds import key_limit
from conformance.sglang_contract.metric_names import KIT_EVICTIONS_TOTAL, KIT_MAMBA_TOTAL, KIT_PREFILL_CUTS_TOTAL
from conformance.sglang_plugins.token_digest import token_digest
from conformance.errors import KitError
from conformance.targets.registry import target_for

#: evidence name -> the counter on /metrics it is read from
COUNTERS: dict[str, str] = {
    "evictions": KIT_EVICTIONS_TOTAL,
    "prefill_cuts": KIT_PREFILL_CUTS_TOTAL,
}


def missing_counters(values: Mapping[str, float]) -> list[str]:
    """The evidence counters a ``/metrics`` scrape lacks."""
    return [metric for metric in COUNTERS.values() if metric not in values]


@dataclass(frozen=True)
class Prefill:
    """One prefill (chunk) of a request as SGLang's scheduler ran it."""

    prefix: int
    extend: int
    cut: bool  # SGLang cut the prefill at prefix + extend (more chunks follow)
    track: int | None  # the length its mamba checkpoint is tracked at (None: none)
    at: int = field(default=0, compare=False)  # its record number in the evidence file (not part of what it was)
    admitted: bool = field(default=True, compare=False)  # it starts an admission (it does not continue an earlier chunk)


@dataclass(frozen=True)
class RecordedAdmission:
    """One admission of a request as SGLang's records show it: the prefix its prefill started
    from, where its prefill ended, and the match of a refusal just before it (0: none)."""

    prefix: int
    end: int
    refused_match: int = 0


@dataclass(frozen=True)
class Held:
    """What SGLang's tree held for a prompt when it admitted the request (per-node records)."""

    held: tuple[int, ...]  # lengths of the states taken before the admission and not freed since
    freed: Mapping[int, set[str]]  # length -> what freed it (taken before the admission, freed before it)
    admissions: int = 1  # how often SGLang admitted the request (a retracted one is admitted again)

    @property
    def owed(self) -> int:
        """The hit SGLang's match owed: its longest held state (0: none)."""
        return max(self.held, default=0)


@dataclass
class RequestLog:
    """The per-request evidence file the observe plugin appends to, read incrementally."""

    path: Path
    prefills: dict[str, list[Prefill]] = field(default_factory=dict)
    drops: dict[str, list[int]] = field(default_factory=dict)  # rid -> lengths whose kept checkpoint was dropped
    #: where in the file (record number) each request's first prefill and each eviction walk are
    first_prefill_at: dict[str, int] = field(default_factory=dict)
    #: where each request was last admitted: its prefill record that does not continue an
    #: earlier chunk of it (a request retracted and prefilled again is admitted twice)
    admitted_at: dict[str, int] = field(default_factory=dict)
    evictions_at: list[int] = field(default_factory=list)
    #: per node: (prefix length, digest) -> record numbers where the tree took / freed that state
    states_stored: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    states_evicted: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    #: record number of a ``state_evicted`` -> what freed it (``walk``, ``insert``, ``other``)
    freed_by: dict[int, str] = field(default_factory=dict)
    #: every admission of each request (a retracted request is admitted again)
    admissions: dict[str, int] = field(default_factory=dict)
    #: where the tree was reset (a flush): every state it took before is gone
    resets_at: list[int] = field(default_factory=list)
    #: the tree audit's records (``conformance/sglang_plugins/tree_audit.py``): each violation
    #: (rule, path, line), the rules that ran per tree, and why an audit could not run
    tree_violations: list[dict[str, str]] = field(default_factory=list)
    tree_rules: dict[str, list[str]] = field(default_factory=dict)
    tree_audit_errors: list[str] = field(default_factory=list)
    #: pressure evidence (the coverage counters): record number of each refusal after a match ->
    #: (rid, matched length, digest); retracted rids; how many records of each event were read
    refused: dict[int, tuple[str, int, str]] = field(default_factory=dict)
    #: the eviction walks over the whole tree the kit asked for, by request id (``conformance/sglang_plugins/evict_all.py``)
    evict_alls: dict[str, dict[str, Any]] = field(default_factory=dict)
    retracted: list[str] = field(default_factory=list)
    #: per request, the lengths its decode steps reached riding a mixed prefill's forward
    #: (the observer's ``mixed_decode`` records), where SGLang tracks no decode boundary
    mixed_decodes: dict[str, set[int]] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    #: the pressure hooks the server's plugin has in place (None: a start line without the field)
    pressure: tuple[str, ...] | None = None
    #: pressure hooks whose observer failed on this server (hook -> its error): their counters are not recorded
    observer_errors: dict[str, str] = field(default_factory=dict)
    #: the unified tree's core class (None: not recorded; a release without one)
    tree_core: str | None = None
    started: bool = False
    #: the server records per-node state evictions (its start line says the hooks are in place)
    per_node: bool = False
    _offset: int = 0
    _records: int = 0

    def refresh(self) -> None:
        """Read what the server appended since the last read (whole lines only)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self.add(json.loads(line))

    def add(self, rec: Mapping[str, Any]) -> None:
        ev = rec.get("ev")
        self._records += 1
        self.events[str(ev)] = self.events.get(str(ev), 0) + 1
        if ev == "start":
            self.started = True
            self.per_node = bool(rec.get("state_evictions"))
            self.pressure = tuple(rec["pressure"]) if "pressure" in rec else None
        elif ev == "refused":
            self.refused[self._records] = (str(rec["rid"]), int(rec["matched"]), str(rec["key"]))
        elif ev == "tree_core":
            self.tree_core = str(rec.get("core", ""))
        elif ev == "retract":
            self.retracted.extend(str(r) for r in rec.get("rids", ()))
        elif ev == "mixed_decode":
            if rec.get("seq_len") is not None:
                self.mixed_decodes.setdefault(str(rec["rid"]), set()).add(int(rec["seq_len"]))
        elif ev == "prefill":
            rid = str(rec["rid"])
            before = self.prefills.setdefault(rid, [])
            prefix = int(rec["prefix"])
            admitted = not before or prefix != before[-1].prefix + before[-1].extend
            chunk = Prefill(prefix, int(rec["extend"]), bool(rec["cut"]), rec.get("track"), self._records, admitted)
            if admitted:
                self.admitted_at[rid] = self._records
                self.admissions[rid] = self.admissions.get(rid, 0) + 1
            before.append(chunk)
            self.first_prefill_at.setdefault(rid, self._records)
        elif ev == "evict":
            self.evictions_at.append(self._records)
        elif ev in ("state_stored", "state_evicted"):
            book = self.states_stored if ev == "state_stored" else self.states_evicted
            book.setdefault((int(rec["len"]), str(rec["key"])), []).append(self._records)
            if ev == "state_evicted":
                self.freed_by[self._records] = str(rec.get("by", "walk"))  # a record before ``by``: the plugin recorded walks only
        elif ev == "evict_all":
            self.evict_alls[str(rec.get("id"))] = dict(rec)
        elif ev == "tree_reset":
            self.resets_at.append(self._records)
        elif ev == "tree_violation":
            self.tree_violations.append({k: str(rec.get(k, "")) for k in ("rule", "path", "line")})
        elif ev == "tree_audit_rules":
            self.tree_rules[str(rec.get("tree"))] = [str(r) for r in rec.get("rules") or ()]
        elif ev == "observer_error":
            self.observer_errors[str(rec.get("hook"))] = str(rec.get("error"))
        elif ev == "tree_audit_error":
            self.tree_audit_errors.append(str(rec.get("error")))
        elif ev == "lazy_drop":
            self.drops.setdefault(str(rec["rid"]), []).append(int(rec["was"]))

    def computed_by(self, rid: str, position: int) -> RecordedAdmission | None:
        """The admission of request ``rid`` whose prefill or decode computed the output at
        ``position`` (the last admission whose prefill ended at or before it: a retracted
        request prefilled again computes its later tokens anew), with the match a refusal
        gave it just before (SGLang's ``refused`` records); None without a prefill record."""
        chunks = self.prefills.get(rid, [])
        starts = [i for i, c in enumerate(chunks) if c.admitted]
        best: RecordedAdmission | None = None
        for n, i in enumerate(starts):
            last = chunks[(starts[n + 1] if n + 1 < len(starts) else len(chunks)) - 1]
            if last.prefix + last.extend > position:
                continue
            before = chunks[starts[n - 1]].at if n else 0
            refused = [m for at, (r, m, _) in self.refused.items() if r == rid and before < at < chunks[i].at]
            best = RecordedAdmission(chunks[i].prefix, last.prefix + last.extend, refused[-1] if refused else 0)
        return best

    def cut(self, rid: str) -> bool:
        """Was this request's prefill cut by SGLang's scheduler?"""
        return any(p.cut for p in self.prefills.get(rid, ()))

    def chunks(self, rid: str) -> list[Prefill]:
        return list(self.prefills.get(rid, ()))

    def evicted_between(self, storers: list[str], rid: str) -> bool:
        """Did SGLang's eviction walk run after the first prefill of every one of ``storers``
        (none of them can have stored before it) and before the first prefill of ``rid``
        (its admission, where its hit was matched)?  False when any of them has no prefill
        record.  The client's clock cannot say this for a burst: its members answer together,
        when the last finishes, long after SGLang stored and maybe evicted the first ones."""
        window = self._window(storers, rid)
        return window is not None and any(window[0] < e < window[1] for e in self.evictions_at)

    def _window(self, storers: list[str], rid: str) -> tuple[int, int] | None:
        """(after every storer's first prefill, before ``rid``'s), in record numbers; None when one is unrecorded."""
        starts = [self.first_prefill_at.get(s) for s in storers]
        end = self.first_prefill_at.get(rid)
        if not starts or end is None or any(a is None for a in starts):
            return None
        return max(starts), end

    def state_evicted_between(self, key: Sequence[int], storers: list[str], rid: str, by: Sequence[str] = ("walk",)) -> bool | None:
        """Per node: did SGLang's eviction walk (``by``: what may have freed it; with a per-path
        cap also an ``insert``) free the mamba state SGLang's tree held for exactly the prefix
        ``key`` (token ids) after the first prefill of every one of ``storers`` and before
        ``rid``'s first prefill?  A free by anything else is no eviction.  None: no per-node answer -- this server records no
        per-node evidence (a release whose tree lacks a hook point, or the hooks were not applied), its tree never
        took a state for exactly ``key`` before ``rid``'s first prefill (the oracle's key is not
        SGLang's: a different length or tokens; or the state was lost), or a storer or ``rid``
        has no prefill record: ask
        :meth:`evicted_between` instead.  What the oracle's "may have evicted" should
        rest on: the stored prefix a hit fell short of was evicted, not "some eviction ran"."""
        named = (len(key), token_digest(key))
        if not self.per_node or named not in self.states_stored:
            return None
        window = self._window(storers, rid)
        if window is None or not any(self._reset_before(window[1]) < n < window[1] for n in self.states_stored[named]):
            return None  # taken only later (by ``rid`` itself, say): nothing it held could have been freed
        return any(window[0] < e < window[1] and self.freed_by.get(e) in by for e in self.states_evicted.get(named, ()))

    def held_at_admission(self, tokens: Sequence[int], limit: int, rid: str) -> Held | None:
        """Per node: the states of prefixes of ``tokens`` (up to ``limit`` tokens, the match
        limit) SGLang's tree held when it last admitted ``rid`` -- taken before it and not
        freed since -- and those it took and then freed (with what freed them).  None: no
        per-node evidence on this server, or no prefill record of ``rid``."""
        at = self.admitted_at.get(rid)
        if not self.per_node or at is None:
            return None
        since = self._reset_before(at)
        held: list[int] = []
        freed: dict[int, set[str]] = {}
        t = tuple(tokens)
        for n in sorted({n for n, _ in self.states_stored if 0 < n <= min(limit, len(t))}):
            stores = [k for k in self.states_stored.get((n, token_digest(t[:n])), ()) if since < k < at]
            if not stores:
                continue
            frees = [e for e in self.states_evicted.get((n, token_digest(t[:n])), ()) if stores[-1] < e < at]
            if frees:
                freed[n] = {self.freed_by.get(e, "walk") for e in frees}
            else:
                held.append(n)
        return Held(tuple(held), freed, self.admissions.get(rid, 0))

    def stored_before_admission(self, key: Sequence[int], rid: str) -> bool | None:
        """Per node: had SGLang's tree taken a mamba state for exactly the prefix ``key``
        before ``rid`` was (last) admitted, where its hit was matched?  None: no per-node
        evidence on this server, or no prefill record of ``rid``.  A hit of ``len(key)``
        tokens needs such a state: the hybrid tree matches only up to a node holding one."""
        at = self.admitted_at.get(rid)
        if not self.per_node or at is None:
            return None
        since = self._reset_before(at)
        return any(since < n < at for n in self.states_stored.get((len(key), token_digest(key)), ()))

    def _reset_before(self, at: int) -> int:
        """The record number of the last tree reset (a flush) before record ``at`` (0: none)."""
        return max((r for r in self.resets_at if r < at), default=0)

    def state_stored(self, key: Sequence[int]) -> bool | None:
        """Per node: did SGLang's tree ever take a mamba state for exactly the prefix ``key``
        (None: no per-node evidence recorded)?"""
        return (len(key), token_digest(key)) in self.states_stored if self.per_node else None

    def untracked_decodes(self, rid: str) -> frozenset[int]:
        """The lengths ``rid``'s decode steps reached in a mixed forward: a track boundary
        among them was not tracked (SGLang 0.5.23: "Decode tails are not tracked in a mixed step")."""
        return frozenset(self.mixed_decodes.get(rid, ()))

    def dropped(self, rid: str) -> bool:
        """Did a failed lazy allocation drop this request's kept checkpoint?"""
        return bool(self.drops.get(rid))


def owed_hit(log: RequestLog | None, tokens: Sequence[int], limit: int, rid: str) -> Expected:
    """The hit SGLang owed request ``rid`` (its input ``tokens``, the match limit ``limit``):
    exact from its per-node records (what its tree held at the admission), else bounded and why."""
    if log is None:
        return Expected(False, why="no per-node records on this target")
    if not log.per_node:
        return Expected(False, why="the server records no per-node states")
    held = log.held_at_admission(tokens, limit, rid)
    if held is None:
        return Expected(False, why="no prefill record of it (aborted before SGLang admitted it)")
    if held.admissions > 1:
        return Expected(False, why="retracted and admitted again")
    return Expected(True, held.owed, freed=held.freed)


def owed_hits(log_path: Path | None, target: str, page_size: int, requests: Sequence[tuple[str, Sequence[int], str]]) -> dict[str, Expected]:
    """Per (label, input tokens, request id) a scripted suite sent to the server whose log is
    ``log_path``: the hit SGLang owed it from the server's per-node records (exact), or why
    they cannot say (bounded)."""
    log = request_log(log_path, target=target)
    if log is not None:
        log.refresh()
    return {label: owed_hit(log, tokens, key_limit(len(tokens), page_size, None), rid) for label, tokens, rid in requests}


class Evidence:
    """Scrapes of the evidence counters since the last flush, in program-clock order, and
    (where the server writes one) the per-request log."""

    def __init__(self, requests: RequestLog | None = None) -> None:
        self.scrapes: list[tuple[int, dict[str, float | None]]] = []
        self.requests = requests

    def reset(self, seq: int, values: Mapping[str, float]) -> None:
        """A flush (or the program's start): the baseline every window starts from."""
        self.scrapes = []
        self.note(seq, values)

    def note(self, seq: int, values: Mapping[str, float]) -> None:
        if self.requests is not None:
            self.requests.refresh()
        self.scrapes.append((seq, {name: values.get(metric) for name, metric in COUNTERS.items()}))

    def stale(self, seq: int) -> bool:
        """No scrape was taken at or after clock ``seq`` (a window ending there would be
        read against an older scrape: scrape again before judging it)."""
        return not any(s >= seq for s, _ in self.scrapes)

    def grew(self, name: str, lo: int, hi: int) -> bool | None:
        """Did counter ``name`` grow between clock ``lo`` and clock ``hi``?  Read at the last
        scrape at or before ``lo`` (else the baseline) and the first at or after ``hi``
        (else the latest).  None: the counter is not exported (no evidence either way)."""
        if not self.scrapes:
            return None
        before = [v for s, v in self.scrapes if s <= lo] or [self.scrapes[0][1]]
        after = [v for s, v in self.scrapes if s >= hi] or [self.scrapes[-1][1]]
        a, b = before[-1].get(name), after[0].get(name)
        if a is None or b is None:
            return None
        return b > a


#: The gauges the hit oracle sizes its eviction bound by (besides the evidence counters).
ORACLE_GAUGES = (KIT_MAMBA_TOTAL,)


#: ``<log>.log`` -> the observe plugin's per-request file (``observe.REQUESTS_SUFFIX``)
REQUESTS_SUFFIX = ".requests.jsonl"


def request_log(log_path: Path | None, *, target: str, attempts: int = 25, pause_s: float = 0.2) -> RequestLog | None:
    """The per-request evidence of a server whose log is ``log_path`` on a target that loads
    the kit's plugins (real SGLang), else None.  A file without the plugin's start line is a
    KitError: the oracle would otherwise grant no cut and no lazy drop, or guess."""
    import time

    plugin_log = target_for(target).engine.plugin_log(log_path)
    if plugin_log is None:
        return None
    log = RequestLog(plugin_log.with_suffix(REQUESTS_SUFFIX))
    for _ in range(attempts):
        log.refresh()
        if log.started:
            return log
        time.sleep(pause_s)
    raise KitError(f"no per-request evidence from the observe plugin in {log.path}: the programs' oracle depends on it "
                   "(is the observe plugin loaded? see its <log>.plugins.jsonl)")


def refuse_missing(values: Mapping[str, float], *, target: str, attempts: Any = None) -> None:
    """On a target whose servers load the kit's plugins (real SGLang), a gauge or counter
    the oracle depends on that ``/metrics`` lacks is a KitError, not a silently permissive
    oracle.  ``attempts``: more scrapes to try first (the observe plugin publishes at the
    first idle moment)."""
    if not target_for(target).loads_kit_plugins():
        return
    for more in [None, *(attempts or ())]:
        values = more() if more is not None else values
        missing = [m for m in (*ORACLE_GAUGES, *COUNTERS.values()) if m not in values]
        if not missing:
            return
    raise KitError(f"the server's /metrics lacks {', '.join(missing)}: the programs' oracle depends on it "
                   "(is the observe plugin loaded? see its <log>.plugins.jsonl)")
