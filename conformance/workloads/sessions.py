"""Session scripts for the leak check: the workload that exposed SGLang's session leaks
(PR 26941, issue 23496). A streaming and a non-streaming session each run several turns
whose context crosses track boundaries; one turn is aborted mid-decode (the runner streams
it and aborts once the stream has delivered decoded tokens, ``runners.record_sessions``),
and the non-streaming session branches from an earlier turn by ``rid`` and replaces one
(``replace`` is refused in streaming sessions, so that script only appends).
:func:`first_turn_abort_script` is a streaming session whose FIRST turn is aborted
mid-decode (no saved turn yet: SGLang builds a throwaway slot to release it), then a turn
that re-prefills: 0.5.11 and 0.5.12 left that turn's mamba slots out of the throwaway slot
and leaked them (PR 26941's abort path; the scheduler's idle check then kills the server).
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.errors import KitError
from conformance.workloads.prompts import extension


@dataclass(frozen=True)
class SessionTurn:
    """One turn: ``tokens`` appended to the context of turn ``parent`` (None: the latest
    finished turn); ``abort_after_s`` aborts it mid-decode, no earlier than that delay and
    only once it is seen decoding."""

    tokens: tuple[int, ...]
    max_new_tokens: int
    parent: int | None = None
    replace: bool = False
    abort_after_s: float | None = None


@dataclass(frozen=True)
class SessionScript:
    name: str
    streaming: bool
    turns: tuple[SessionTurn, ...]
    capacity_of_str_len: int = 65536


def leak_session_scripts(
    *,
    vocab_size: int,
    track_interval: int = 256,
    turns: int = 4,
    new_tokens: int = 16,
    abort_new_tokens: int = 1024,
    abort_after_s: float = 0.3,
    seed: int = 0,
) -> tuple[SessionScript, SessionScript]:
    """(streaming, non-streaming) scripts; turn lengths make the context cross a track
    boundary by the second turn. ``abort_new_tokens`` keeps the aborted turn decoding
    long enough to be aborted mid-decode; keep context + it under the context length."""
    if turns < 3:
        raise KitError(f"leak_session_scripts: need at least 3 turns (one aborted, one branched), got {turns}")
    turn_len = max(8, track_interval // 2 + 7)

    def turn(i: int, who: str, **kw) -> SessionTurn:
        toks = extension(turn_len, vocab_size=vocab_size, seed=f"{seed}:{who}:{i}")
        return SessionTurn(toks, kw.pop("max_new_tokens", new_tokens), **kw)

    abort_at = turns // 2
    streaming = tuple(
        turn(i, "s", max_new_tokens=abort_new_tokens, abort_after_s=abort_after_s) if i == abort_at else turn(i, "s") for i in range(turns)
    )
    plain = [turn(i, "n") for i in range(turns)]
    plain[abort_at] = turn(abort_at, "n", max_new_tokens=abort_new_tokens, abort_after_s=abort_after_s)
    plain.append(turn(turns, "n", parent=0))  # branch from the first turn by rid
    done = next(i for i in range(turns) if i not in (0, abort_at))  # a completed turn, not the aborted one
    plain.append(turn(turns + 1, "n", parent=done, replace=True))  # replace that turn's subtree
    return (
        SessionScript(f"streaming-s{seed}", True, streaming),
        SessionScript(f"non-streaming-s{seed}", False, tuple(plain)),
    )


def first_turn_abort_script(
    *,
    vocab_size: int,
    track_interval: int = 256,
    new_tokens: int = 16,
    abort_new_tokens: int = 1024,
    abort_after_s: float = 0.3,
    seed: int = 0,
) -> SessionScript:
    """A streaming session: its first turn aborted mid-decode, then one complete turn."""
    turn_len = max(8, track_interval // 2 + 7)

    def toks(i: int) -> tuple[int, ...]:
        return extension(turn_len, vocab_size=vocab_size, seed=f"{seed}:first-abort:{i}")

    return SessionScript(
        f"streaming-first-abort-s{seed}",
        True,
        (SessionTurn(toks(0), abort_new_tokens, abort_after_s=abort_after_s), SessionTurn(toks(1), new_tokens)),
    )
