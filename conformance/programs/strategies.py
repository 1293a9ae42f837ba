"""The hypothesis generator of request programs for one matrix cell.

A program draws a small prefix forest (roots that may share a trunk), then steps one by
one, each kind from a weighted list whose first entries are the simplest (hypothesis
shrinks towards them).  Lengths are drawn near the cell's grids (``k * chunk`` and
``k * track`` one before, at and one after), so prefill checkpoints, hits and decode
track boundaries land where bugs live.  The generator keeps a model of what it sent
(streamed requests a later arrival can wait on, session turns that may be continued,
sessions still open), so every drawn program is valid and stays valid when shrunk:
references to requests a shrink removed fall back to a forest root.

Costs are bounded per program: total decode tokens (``decode_budget``) and at most one
long decode that crosses several track boundaries (``long_decode``).

**Pressure shapes** (``pressure``, drawn on every cell with weight ``pressure_weight``; the
cell's spec weights it up on small-pool and page-size > 1 cells, 0 switches it off), built
from the ordinary steps so any program file replays them: ``hold`` (streamed decodes of up
to ``hold_new`` tokens that hold KV while gated arrivals come in), ``refuse`` (a request is
stored and answered, holders take the KV, then a follow-up of it arrives gated on a holder:
it matches the stored prefix and, short of room, is refused and waits while the holders'
decodes may evict what it matched (pool-sized holders overflow the pool on purpose in half
the draws); it is admitted once they finish), ``match_burst`` (a
prefix is stored, then a burst of more members than Mamba slots matches it at admission),
``retract`` (holders that do not ignore EOS: SGLang charges a running request only
``new_token_ratio`` x the decode it has left, so it admits the last holder while the others
run, though their prompts and whole decodes overflow the KV pool; it retracts one when
decode runs out of KV).
Where the cell's KV pool size is known (``kv_total``), ``refuse`` and ``retract`` size their
holders from it: a few (2-3) whose prompts fill the pool, so the follow-up reaches SGLang's
prefill adder with request slots free and is refused for KV after its match.
Their decodes come from ``pressure_budget``, not ``decode_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from conformance.programs.program import (
    CUTS, LAND_MAX_NEW, LANDINGS, LOGPROB_STARTS, After, Burst, Close, Flush, Gate, Idle, Open, SendOptions, Program, Root, Send, Step, Stop, Turn, Wait,
)
from conformance.workloads.prompts import extension

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class GenSpec:
    """What a cell allows and what a program may cost."""

    vocab_size: int
    chunk: int
    checkpoint_grid: int
    track_grid: int
    page_size: int
    context_len: int
    max_steps: int = 14
    max_roots: int = 3
    decode_budget: int = 160
    long_decode: bool = False
    max_burst: int = 24
    pressure_new: int = 6  # a burst that decodes this long keeps more requests running than the mamba pool holds
    sessions: bool = True
    streaming_sessions: bool = True  # the cell's server takes streaming sessions (conformance.matrix.axes)
    reasoning_requests: bool = False  # the cell's server keeps only the prompt of a reasoning request (conformance.matrix.axes)
    #: pressure shapes: how often drawn (0: never), a holder's decode, holders per shape, the decode tokens they may spend
    pressure_weight: int = 1
    hold_new: int = 24
    max_holders: int = 3
    pressure_budget: int = 96
    #: the KV pool of a cell that must reach its pressure (tokens; 0: unknown or not a pressure
    #: cell, the shapes then do not size holders from it); at most one pool-sized shape a program
    kv_total: int = 0
    #: a retracting holder's decode (its unreserved share, (1 - ratio) x this, is what overflows the pool)
    retract_new: int = 384

    @property
    def max_root_len(self) -> int:
        return 2 * self.track_grid + self.checkpoint_grid + 2

    def interesting_lengths(self) -> list[int]:
        out = {1, 2, 3, 7, self.page_size}
        for g in {self.chunk, self.checkpoint_grid, self.track_grid}:
            for k in range(1, self.max_root_len // g + 1):
                out.update({k * g - 1, k * g, k * g + 1})
        for k in range(1, self.max_root_len // self.track_grid + 1):  # a short decode from here crosses a track boundary
            out.update(k * self.track_grid - d for d in (2, 3, 5, 9, 17))
        return sorted(n for n in out if 1 <= n <= self.max_root_len)


def tokens(n: int, spec: GenSpec, seed: int | str) -> Tokens:
    return extension(n, vocab_size=spec.vocab_size, seed=seed) if n > 0 else ()


# ------------------------------------------------------------------ the generator's model
@dataclass
class _Model:
    spec: GenSpec
    forest: list[Tokens]
    steps: list[Step] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # every request rid, in order
    streamed: list[str] = field(default_factory=list)  # streamed rids with something to decode
    decode_left: int = 0
    long_used: bool = False
    n: int = 0
    sessions: dict[str, dict] = field(default_factory=dict)  # sid -> {streaming, turns: [rid], open}
    pressure_left: int = 0
    pool_shape_used: bool = False

    def rid(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def take_decode(self, want: int) -> int:
        got = max(1, min(want, self.decode_left))  # every request decodes >= 1 token: its answer is compared
        self.decode_left -= got
        return got


_SUFFIXES = (0, 1, 2, 5, 17, 3, 64, 63, 65)
_MAX_NEW = (2, 1, 4, 8, 3, 16, 33)
_KINDS = (
    "send", "send", "followup", "wait", "idle", "followup", "pair", "arrival", "abort",
    "burst", "session", "session", "session", "options", "options", "overflow", "long", "flush", "burst",
)


#: The pressure shapes (see the module's docstring), simplest first.
PRESSURE_SHAPES = ("hold", "refuse", "match_burst", "retract")
#: SGLang's initial ``new_token_ratio`` (``SGLANG_INIT_NEW_TOKEN_RATIO``): the share of a
#: running request's ``max_new`` the prefill adder reserves when it does not ignore EOS.
RESERVED_RATIO = 0.7
#: the refuse shape's margins (tokens): < 0 a slack that keeps the matched state, > 0 an overflow the
#: holders' decodes must evict (both well below ``(1 - RESERVED_RATIO)`` x the holders' decode, so the follow-up is refused)
REFUSE_MARGINS = (-16, -32, -48, 16, 32, 48)


def kinds(spec: GenSpec) -> tuple[str, ...]:
    """The step kinds a cell draws from: the ordinary ones and ``pressure`` by its weight."""
    return _KINDS + ("pressure",) * spec.pressure_weight


@st.composite
def _holders(draw, m: _Model) -> list[Send]:
    """Streamed requests that decode long on prompts of their own: they hold KV while others arrive."""
    out = []
    for _ in range(draw(st.integers(1, m.spec.max_holders))):
        want = draw(st.sampled_from((m.spec.hold_new, m.spec.hold_new // 2, m.spec.hold_new - 1)))
        got = max(2, min(want, m.pressure_left))
        m.pressure_left = max(0, m.pressure_left - got)
        suffix = tokens(draw(st.sampled_from((64, 130, 17))), m.spec, f"hold:{draw(st.integers(0, 2**16))}")
        rid = m.rid("h")
        out.append(Send(rid, draw(_root_base(m)), suffix, got, SendOptions(return_logprob=True), True))
        m.sent.append(rid)
        m.streamed.append(rid)
    return out


def _holder_count(spec: GenSpec, held: int) -> int:
    """The fewest holders (>= 2) that hold ``held`` tokens with each one's prompt + decode in the context."""
    k = 2
    while held // k + 16 > spec.context_len:
        k += 1
    return k


def _pool_holders(m: _Model, seed: int, *, held: int, new: int, ignore_eos: bool) -> list[Send]:
    """Streamed holders (:func:`_holder_count`), each on a fresh prompt of its own, whose
    prompts plus ``new`` decode tokens each sum to ``held`` tokens of the KV pool."""
    k = _holder_count(m.spec, held)
    out = []
    for i in range(k):
        rid = m.rid("h")
        prompt = tokens(held // k - new, m.spec, f"pool:{seed}:{i}")
        out.append(Send(rid, Root(0, 0), prompt, new, SendOptions(return_logprob=False, ignore_eos=ignore_eos), True))
        m.sent.append(rid)
        m.streamed.append(rid)
    return out


@st.composite
def _pressure(draw, m: _Model) -> list[Step]:
    sized = bool(m.spec.kv_total) and not m.pool_shape_used  # pool-sized holders: prefill-heavy, once a program
    # a pressure cell draws its pool-sized shapes more often (they are what its counters need)
    shape = draw(st.sampled_from((*PRESSURE_SHAPES, "refuse", "refuse", "retract") if sized else PRESSURE_SHAPES[:-1]))
    m.pool_shape_used = m.pool_shape_used or (sized and shape in ("refuse", "retract"))
    if shape == "retract":
        # SGLang charges an arriving holder its whole decode and a running one RESERVED_RATIO of
        # what it has left: the last holder is admitted while the others run as long as their
        # unreserved shares cover the overflow; the prompts + whole decodes overflow the pool by
        # half of those shares, so decode runs out of KV and SGLang retracts.
        new = m.spec.retract_new
        k = _holder_count(m.spec, m.spec.kv_total)
        overflow = int((1 - RESERVED_RATIO) * new * (k - 1) / 2)
        holders = _pool_holders(m, draw(st.integers(0, 2**16)), held=m.spec.kv_total + overflow, new=new, ignore_eos=False)
        return [*holders, *(Wait(h.rid) for h in holders)]
    if shape == "match_burst":
        base = draw(_root_base(m))
        seed = Send(m.rid("r"), base, (), m.take_decode(1), SendOptions(return_logprob=True))
        m.sent.append(seed.rid)
        width = draw(st.sampled_from((1, 4, m.spec.chunk + 1)))
        salt = draw(st.integers(0, 2**16))
        burst = Burst(m.rid("b"), base, tuple(tokens(width, m.spec, f"{salt}:{i}") for i in range(m.spec.max_burst)), m.spec.pressure_new)
        m.sent.extend(burst.rids())
        return [seed, Wait(seed.rid), burst]
    if shape == "hold":
        holders = draw(_holders(m))
        arrivals = [draw(_send(m, follow=draw(st.booleans()), gate=Gate(h.rid, draw(st.integers(1, 8)))))
                    for h in holders[: draw(st.integers(1, len(holders)))]]
        return [*holders, *arrivals]
    if sized:
        # a stored prefix past two checkpoints, then holders whose prompts charge all the pool but
        # it and a margin below the follow-up's extend: the follow-up matches it and is refused for
        # KV.  A slack leaves the matched state in place; an overflow makes the holders' decodes
        # outgrow the free pool, so SGLang's eviction walk frees the state the refused follow-up
        # matched before it is admitted again (``matched_then_evicted``).
        stored = Send(m.rid("r"), Root(0, 0), tokens(2 * m.spec.checkpoint_grid + 1, m.spec, f"stored:{draw(st.integers(0, 2**16))}"),
                      m.take_decode(2), SendOptions(return_logprob=True))
        m.sent.append(stored.rid)
        margin = draw(st.sampled_from(REFUSE_MARGINS))
        overflow = margin + _holder_count(m.spec, m.spec.kv_total) * m.spec.page_size if margin > 0 else margin
        held = m.spec.kv_total - (len(stored.suffix) + stored.max_new) + overflow
        # each holder decodes at least the overflow: the prompts and the stored state fit until the follow-up came
        holders = _pool_holders(m, draw(st.integers(0, 2**16)), held=held, new=max(m.spec.hold_new, 64, overflow), ignore_eos=True)
    else:
        stored = draw(_send(m, follow=draw(st.booleans()), stream=False))
        holders = draw(_holders(m))
    gate = Gate(holders[-1].rid, draw(st.integers(1, 4)))
    back = Send(m.rid("r"), After(stored.rid, draw(st.sampled_from(("all", "prompt", "track", "chunk")))),
                tokens(draw(st.sampled_from((64, 65, 130) if sized else (5, 64, 1))), m.spec, draw(st.integers(0, 2**16))),
                m.take_decode(4), draw(_options(m, False)), gate=gate)
    m.sent.append(back.rid)
    return [stored, Wait(stored.rid), *holders, back]


@st.composite
def _root_base(draw, m: _Model) -> Root:
    r = draw(st.integers(0, len(m.forest) - 1))
    lengths = [n for n in m.spec.interesting_lengths() if n <= len(m.forest[r])] or [len(m.forest[r])]
    pick = draw(st.sampled_from([len(m.forest[r]), *lengths]))
    return Root(r, pick)


@st.composite
def _base(draw, m: _Model, follow: bool):
    if follow and m.sent:
        rid = draw(st.sampled_from(m.sent[::-1]))
        return After(rid, draw(st.sampled_from(CUTS)))
    return draw(_root_base(m))


@st.composite
def _options(draw, m: _Model, rich: bool) -> SendOptions:
    if not rich:
        return SendOptions(return_logprob=draw(st.sampled_from((True, True, True, False))),
                       reasoning=draw(st.booleans()) if m.spec.reasoning_requests else False)
    stop = None
    if m.sent and draw(st.integers(0, 2)) == 0:
        stop = Stop(draw(st.sampled_from(m.sent[::-1])), draw(st.integers(0, 7)), draw(st.sampled_from(("token", "text"))))
    return SendOptions(
        return_logprob=draw(st.sampled_from((True, True, True, False))),
        logprob_start=draw(st.sampled_from(LOGPROB_STARTS)),
        top_logprobs_num=draw(st.sampled_from((0, 1, 3))),
        ignore_eos=stop is None and draw(st.booleans()),
        stop=stop,
        reasoning=draw(st.booleans()) if m.spec.reasoning_requests else False,
    )


@st.composite
def _send(draw, m: _Model, *, follow: bool = False, rich: bool = False, stream: bool | None = None, gate: Gate | None = None,
          abort: bool = False, long: bool = False) -> Send:
    options = draw(_options(m, rich))
    if options.stop is not None and draw(st.booleans()):  # the stop request's own prompt: the stop condition fires
        base, suffix = After(options.stop.rid, "prompt"), ()
    else:
        base = draw(_base(m, follow))
        suffix = tokens(draw(st.sampled_from(_SUFFIXES)), m.spec, draw(st.integers(0, 2**16)))
    if long and not m.long_used:
        m.long_used = True
        max_new = 2 * m.spec.track_grid + draw(st.integers(1, 9))
    else:
        max_new = m.take_decode(draw(st.sampled_from(_MAX_NEW)))
    streamed = draw(st.booleans()) if stream is None else stream
    abort_at = None
    if abort:
        max_new = max(max_new, m.take_decode(12))
        abort_at = draw(st.sampled_from((1, 0, 2, 3, max(1, max_new // 2))))
        streamed = True
    land = None if abort or long else draw(st.sampled_from((None, None, None, *LANDINGS)))
    if land:
        m.take_decode(LAND_MAX_NEW // 2)
    rid = m.rid("r")
    step = Send(rid, base, suffix, max_new, options, streamed, abort_at, gate, land=land)
    m.sent.append(rid)
    if streamed and max_new >= 2 and abort_at is None:
        m.streamed.append(rid)
    return step


@st.composite
def _burst(draw, m: _Model) -> Burst:
    base = draw(_root_base(m))
    big = draw(st.booleans())  # more requests than the mamba pool can run at once
    n = m.spec.max_burst if big else draw(st.integers(2, 8))
    width = draw(st.sampled_from((1, 4, m.spec.chunk + 1)))
    seed = draw(st.integers(0, 2**16))
    max_new = m.spec.pressure_new if draw(st.booleans()) else draw(st.sampled_from((1, 2, 3)))
    rid = m.rid("b")
    step = Burst(rid, base, tuple(tokens(width, m.spec, f"{seed}:{i}") for i in range(n)), max_new)
    m.sent.extend(step.rids())
    return step


@st.composite
def _session_step(draw, m: _Model) -> list[Step]:
    live = [sid for sid, s in m.sessions.items() if s["open"]]
    if not live or (len(live) < 2 and draw(st.integers(0, 3)) == 0):
        sid = f"s{len(m.sessions) + 1}"
        streaming = draw(st.booleans()) if m.spec.streaming_sessions else False
        m.sessions[sid] = {"streaming": streaming, "turns": [], "open": True}
        if draw(st.integers(0, 2)) == 0:  # a turn, a turn aborted mid-decode, and the turn after it
            return [Open(sid, streaming), draw(_turn(m, sid, abort=None)), draw(_turn(m, sid, abort=2)), draw(_turn(m, sid, abort=None))]
        return [Open(sid, streaming), draw(_turn(m, sid))]
    sid = draw(st.sampled_from(live))
    if draw(st.integers(0, 4)) == 0:
        m.sessions[sid]["open"] = False
        return [Close(sid)]
    return [draw(_turn(m, sid))]


@st.composite
def _turn(draw, m: _Model, sid: str, abort: int | None | str = "draw") -> Turn:
    s = m.sessions[sid]
    suffix = tokens(draw(st.sampled_from((5, 1, 17, 64, 130))), m.spec, draw(st.integers(0, 2**16)))
    max_new = m.take_decode(draw(st.sampled_from((3, 1, 8, 16))))
    abort_at = draw(st.sampled_from((None, None, 1, 0, 3))) if abort == "draw" else abort
    if abort_at is not None:
        max_new = max(max_new, m.take_decode(12), abort_at + 8)
    rid = m.rid("t")
    stream = draw(st.booleans()) or abort_at is not None
    if s["streaming"]:
        turn = Turn(sid, rid, suffix, max(max_new, 1), stream=stream, abort_at=abort_at)
    else:
        parent = draw(st.sampled_from(s["turns"][::-1])) if s["turns"] else None
        replace = parent is not None and draw(st.integers(0, 5)) == 0
        offset = draw(st.sampled_from((None, None, "half", "track", "prompt"))) if parent else None
        drop = parent is not None and draw(st.integers(0, 5)) == 0
        turn = Turn(sid, rid, suffix, max(max_new, 1), parent, replace, offset, drop, stream, abort_at)
        children = s.setdefault("children", {})
        if replace:  # SGLang clears the parent's subtree: those turns can no longer be continued
            gone = _descendants(children, parent)
            s["turns"] = [t for t in s["turns"] if t not in gone]
            children[parent] = []
        children.setdefault(parent, []).append(rid)
    if abort_at is None:
        s["turns"].append(rid)
    m.sent.append(rid)
    return turn


def _descendants(children: dict, rid: str | None) -> set[str]:
    out, stack = set(), list(children.get(rid, ()))
    while stack:
        r = stack.pop()
        if r not in out:
            out.add(r)
            stack.extend(children.get(r, ()))
    return out


@st.composite
def _step(draw, m: _Model) -> list[Step]:
    kind = draw(st.sampled_from(kinds(m.spec)))
    if kind == "pressure":
        return draw(_pressure(m))
    if kind == "send":
        return [draw(_send(m))]
    if kind == "followup":
        return [draw(_send(m, follow=True))]
    if kind == "options":
        lead = draw(_send(m, follow=draw(st.booleans()), rich=True))
        if lead.options.stop is None or not draw(st.booleans()):
            return [lead]
        follow = Send(m.rid("r"), After(lead.rid, "all"), tokens(draw(st.sampled_from((5, 1, 17))), m.spec, draw(st.integers(0, 2**16))),
                      m.take_decode(4), draw(_options(m, False)))
        m.sent.append(follow.rid)
        return [lead, follow]
    if kind == "wait" and m.sent:
        return [Wait(draw(st.sampled_from(m.sent[::-1])))]
    if kind == "idle":
        return [Idle()]
    if kind == "pair":  # two in flight at once over one prefix (identical when the suffix is empty)
        first = draw(_send(m, stream=False))
        twin = Send(m.rid("r"), first.base, first.suffix if draw(st.booleans()) else (), first.max_new, first.options)
        m.sent.append(twin.rid)
        return [first, twin]
    if kind == "arrival":
        if not m.streamed:
            lead = draw(_send(m, stream=True))
            lead = Send(lead.rid, lead.base, lead.suffix, max(lead.max_new, m.take_decode(8), 2), lead.options, True)
            m.streamed.append(lead.rid)
            return [lead, draw(_send(m, follow=draw(st.booleans()), gate=Gate(lead.rid, draw(st.integers(1, 3)))))]
        gate = Gate(draw(st.sampled_from(m.streamed[::-1])), draw(st.integers(1, 3)))
        return [draw(_send(m, follow=draw(st.booleans()), gate=gate))]
    if kind == "abort":
        return [draw(_send(m, follow=draw(st.booleans()), abort=True))]
    if kind == "burst":  # and, half the time, a request that comes back to one member's prefix once all answered
        burst = draw(_burst(m))
        if not draw(st.booleans()):
            return [burst]
        follow = Send(m.rid("r"), After(draw(st.sampled_from(burst.rids())), draw(st.sampled_from(("prompt", "all", "chunk+1", "track")))),
                      tokens(draw(st.sampled_from((5, 1, 64))), m.spec, draw(st.integers(0, 2**16))), m.take_decode(4), draw(_options(m, False)))
        m.sent.append(follow.rid)
        return [burst, follow]
    if kind == "session" and m.spec.sessions:
        return draw(_session_step(m))
    if kind == "overflow":
        base = draw(_root_base(m))
        rid = m.rid("r")
        m.sent.append(rid)
        return [Send(rid, base, (), 1, SendOptions(), overflow=True)]
    if kind == "long":  # a decode across two track boundaries (large programs), then a follow-up at its last track
        lead = draw(_send(m, follow=draw(st.booleans()), long=m.spec.long_decode))
        follow = Send(m.rid("r"), After(lead.rid, draw(st.sampled_from(("track", "all", "track+1", "track-1")))),
                      tokens(draw(st.sampled_from((5, 1, 64))), m.spec, draw(st.integers(0, 2**16))), m.take_decode(4), draw(_options(m, False)))
        m.sent.append(follow.rid)
        return [lead, follow]
    if kind == "flush":
        # A flush resets the tree and the free lists under an open streaming session, whose
        # held slots are then counted twice (SGLang 0.5.23's flush_cache checks only running
        # and waiting requests): programs flush only with no streaming session open.
        if any(s["open"] and s["streaming"] for s in m.sessions.values()):
            return [Idle()]
        return [Flush()]
    return [draw(_send(m))]


@st.composite
def programs(draw, spec: GenSpec) -> Program:
    """A random program for a cell described by ``spec``."""
    roots: list[Tokens] = []
    lengths = spec.interesting_lengths()
    for i in range(draw(st.integers(1, spec.max_roots))):
        n = draw(st.sampled_from([spec.max_root_len, *lengths[::-1]]))
        seed = draw(st.integers(0, 2**16))
        share = 0
        if roots and draw(st.booleans()):
            share = min(draw(st.sampled_from(lengths)), len(roots[0]), n - 1)
        head = (3 + i,)  # distinct first tokens: roots share nothing unless they share a trunk
        fresh = head + tokens(n - share - 1, spec, f"root:{seed}")
        roots.append(roots[0][:share] + fresh if share else fresh)
    m = _Model(spec, roots, decode_left=spec.decode_budget, pressure_left=spec.pressure_budget)
    while len(m.steps) < spec.max_steps and draw(st.integers(0, 5)) != 0:
        m.steps.extend(draw(_step(m)))
    return Program(tuple(roots), tuple(m.steps[: spec.max_steps + 1]))
