"""A request program: what the generator draws, the runner plays and a failure file holds.

A program is plain data: a prefix forest (root token sequences) and steps.  Steps name
requests by ``rid`` and sessions by ``sid``.  What depends on the server's answers (a
follow-up that cuts a finished request's prompt + output at a track boundary, a stop
token taken from an earlier output) stays symbolic here and is resolved by the runner
when the step is played, so the same file replays on any target.

Step kinds (``op``):

``send``   one request: ``base`` (a forest root cut to ``length``, or ``after`` a finished
           request cut at ``cut``) + ``suffix`` tokens; ``max_new`` tokens (or ``land``: as
           many as make its last decode step land at the next track boundary); user options;
           ``stream``; ``abort_at`` (abort once that many output tokens streamed; 0: at
           once); ``gate`` (send only once another streamed request has that many output
           tokens: an arrival while others decode); ``overflow`` (max_new set past the
           context: a request that cannot fit).
``burst``  ``len(suffixes)`` requests sharing one root prefix in a single batched call
           (pool pressure: more live prefixes than slots).
``wait``   until ``rid`` finished.   ``idle``: until nothing is in flight.
``open`` / ``turn`` / ``close``  a session (``streaming`` or not) and its turns
           (``parent`` rid, ``replace``, ``offset`` cut, ``drop_output``).
``flush``  ``/flush_cache`` once idle (the only flush a program does besides its start).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from conformance.errors import KitError

VERSION = 1
#: Where a follow-up cuts a finished request's prompt + output (resolved by the runner).
CUTS = ("all", "prompt", "track", "track-1", "track+1", "chunk", "chunk+1", "half")
#: logprob_start_len choices, resolved against the request's input length.
LOGPROB_STARTS = ("none", "zero", "half", "last")
#: Where a request's last decode step lands relative to the next track boundary (its
#: max_new_tokens is resolved from its input length; at most LAND_MAX_NEW tokens).
LANDINGS = ("boundary", "boundary-1", "boundary+1")
LAND_MAX_NEW = 48

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class Root:
    """The first ``length`` tokens of forest root ``root``."""

    root: int
    length: int


@dataclass(frozen=True)
class After:
    """The prompt + output of finished request ``rid``, cut at ``cut`` (see :data:`CUTS`)."""

    rid: str
    cut: str = "all"


@dataclass(frozen=True)
class Gate:
    """Send only once streamed request ``rid`` has ``tokens`` output tokens (or finished)."""

    rid: str
    tokens: int


@dataclass(frozen=True)
class Stop:
    """A stop condition taken from finished request ``rid``'s output: its ``at``-th output
    token (``kind="token"``: ``stop_token_ids``) or the text of its tokens
    ``[at, at + 2)`` (``kind="text"``: ``stop``)."""

    rid: str
    at: int
    kind: str = "token"


@dataclass(frozen=True)
class SendOptions:
    """The sampling and logprob options a user sends (greedy always: the oracle needs it)."""

    return_logprob: bool = False
    logprob_start: str = "none"
    top_logprobs_num: int = 0
    ignore_eos: bool = True
    stop: Stop | None = None
    reasoning: bool = False  # asks for reasoning (``require_reasoning``; drawn only where the cell strips thinking)


class Step:
    op: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **_plain(asdict(self))}


@dataclass(frozen=True)
class Send(Step):
    op: ClassVar[str] = "send"
    rid: str
    base: Root | After
    suffix: Tokens = ()
    max_new: int = 4
    options: SendOptions = SendOptions()
    stream: bool = False
    abort_at: int | None = None
    gate: Gate | None = None
    overflow: bool = False
    land: str | None = None  # finish one before / at / one after the next track boundary (LANDINGS)


@dataclass(frozen=True)
class Burst(Step):
    op: ClassVar[str] = "burst"
    rid: str
    base: Root
    suffixes: tuple[Tokens, ...]
    max_new: int = 1

    def rids(self) -> list[str]:
        return [f"{self.rid}.{i}" for i in range(len(self.suffixes))]


@dataclass(frozen=True)
class Wait(Step):
    op: ClassVar[str] = "wait"
    rid: str


@dataclass(frozen=True)
class Idle(Step):
    op: ClassVar[str] = "idle"


@dataclass(frozen=True)
class Open(Step):
    op: ClassVar[str] = "open"
    sid: str
    streaming: bool = False


@dataclass(frozen=True)
class Turn(Step):
    op: ClassVar[str] = "turn"
    sid: str
    rid: str
    suffix: Tokens
    max_new: int = 4
    parent: str | None = None  # non-streaming: the turn this one continues (None: a first turn)
    replace: bool = False
    offset: str | None = None  # non-streaming: cut the parent's tokens (a CUTS name)
    drop_output: bool = False
    stream: bool = False
    abort_at: int | None = None


@dataclass(frozen=True)
class Close(Step):
    op: ClassVar[str] = "close"
    sid: str


@dataclass(frozen=True)
class Flush(Step):
    op: ClassVar[str] = "flush"


STEP_TYPES: dict[str, type] = {t.op: t for t in (Send, Burst, Wait, Idle, Open, Turn, Close, Flush)}


@dataclass(frozen=True)
class Program:
    """A forest and steps; ``cell`` (``Cell.describe()``) and ``env`` (the seeded-fault
    environment of the server it ran on) say where it was found."""

    forest: tuple[Tokens, ...]
    steps: tuple[Step, ...]
    cell: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "cell": dict(self.cell),
            "env": dict(self.env),
            "note": self.note,
            "forest": [list(r) for r in self.forest],
            "steps": [s.to_json() for s in self.steps],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    def summary(self) -> str:
        """One line per step, tokens as lengths (what a reader wants first)."""
        lines = [f"forest: {len(self.forest)} roots of lengths {[len(r) for r in self.forest]}"]
        for i, s in enumerate(self.steps):
            lines.append(f"{i:>3} {describe_step(s)}")
        return "\n".join(lines)

    def request_count(self) -> int:
        return sum(len(s.suffixes) if isinstance(s, Burst) else 1 for s in self.steps if isinstance(s, (Send, Burst, Turn)))


def describe_step(s: Step) -> str:
    data = s.to_json()
    parts = [data.pop("op")]
    for key, value in data.items():
        if value in (None, False, (), [], "") and key not in ("rid", "sid"):
            continue
        if key in ("suffix",):
            value = f"<{len(value)} tokens>"
        elif key == "suffixes":
            value = f"<{len(value)} x {len(value[0]) if value else 0} tokens>"
        elif key == "options":
            default = _plain(asdict(SendOptions()))
            value = {k: v for k, v in value.items() if v != default[k]}
            if not value:
                continue
        parts.append(f"{key}={value}")
    return " ".join(str(p) for p in parts)


# ------------------------------------------------------------------ JSON

def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tokens(value: Any, where: str) -> Tokens:
    if not isinstance(value, list) or not all(isinstance(t, int) and t >= 0 for t in value):
        raise KitError(f"program file: {where}: expected a list of token ids")
    return tuple(value)


def _base(value: Any, where: str) -> Root | After:
    if isinstance(value, dict) and set(value) == {"root", "length"}:
        return Root(int(value["root"]), int(value["length"]))
    if isinstance(value, dict) and set(value) == {"rid", "cut"}:
        if value["cut"] not in CUTS:
            raise KitError(f"program file: {where}: unknown cut {value['cut']!r}; known: {', '.join(CUTS)}")
        return After(str(value["rid"]), value["cut"])
    raise KitError(f"program file: {where}: base must be {{root, length}} or {{rid, cut}}")


def _options(value: Any, where: str) -> SendOptions:
    if value is None:
        return SendOptions()
    stop = value.get("stop")
    if value.get("logprob_start", "none") not in LOGPROB_STARTS:
        raise KitError(f"program file: {where}: unknown logprob_start {value.get('logprob_start')!r}")
    return SendOptions(
        return_logprob=bool(value.get("return_logprob", False)),
        logprob_start=value.get("logprob_start", "none"),
        top_logprobs_num=int(value.get("top_logprobs_num", 0)),
        ignore_eos=bool(value.get("ignore_eos", True)),
        stop=Stop(str(stop["rid"]), int(stop["at"]), str(stop.get("kind", "token"))) if stop else None,
        reasoning=bool(value.get("reasoning", False)),
    )


def step_from_json(data: Any, where: str) -> Step:
    if not isinstance(data, dict) or data.get("op") not in STEP_TYPES:
        raise KitError(f"program file: {where}: unknown step {str(data)[:80]}; ops: {', '.join(STEP_TYPES)}")
    data = dict(data)
    op = data.pop("op")
    try:
        if op == "send":
            gate = data.get("gate")
            return Send(
                str(data["rid"]), _base(data["base"], where), _tokens(data.get("suffix", []), where),
                int(data.get("max_new", 4)), _options(data.get("options"), where), bool(data.get("stream", False)),
                data.get("abort_at"), Gate(str(gate["rid"]), int(gate["tokens"])) if gate else None,
                bool(data.get("overflow", False)), data.get("land"),
            )
        if op == "burst":
            base = _base(data["base"], where)
            if not isinstance(base, Root):
                raise KitError(f"program file: {where}: a burst's base is a forest root")
            return Burst(str(data["rid"]), base, tuple(_tokens(s, where) for s in data["suffixes"]), int(data.get("max_new", 1)))
        if op == "turn":
            return Turn(
                str(data["sid"]), str(data["rid"]), _tokens(data.get("suffix", []), where), int(data.get("max_new", 4)),
                data.get("parent"), bool(data.get("replace", False)), data.get("offset"), bool(data.get("drop_output", False)),
                bool(data.get("stream", False)), data.get("abort_at"),
            )
        return STEP_TYPES[op](**data)
    except (KeyError, TypeError, ValueError) as e:
        raise KitError(f"program file: {where}: bad {op} step: {type(e).__name__}: {e}") from None


def program_from_json(data: Any, source: str = "program") -> Program:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise KitError(f"{source}: not a version-{VERSION} request program (missing or wrong 'version')")
    forest = tuple(_tokens(r, f"forest[{i}]") for i, r in enumerate(data.get("forest", [])))
    steps = tuple(step_from_json(s, f"steps[{i}]") for i, s in enumerate(data.get("steps", [])))
    return Program(forest, steps, dict(data.get("cell") or {}), {str(k): str(v) for k, v in (data.get("env") or {}).items()}, str(data.get("note", "")))


def load_program(path: str | Path) -> Program:
    p = Path(path)
    if not p.exists():
        raise KitError(f"program file {p} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise KitError(f"program file {p}: not JSON: {e}") from None
    return program_from_json(data, str(p))
