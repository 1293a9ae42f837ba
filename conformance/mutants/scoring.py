"""Honest scoring: which line of a fault's run counts as catching it.

A seeded fault is caught only when a **named check** reports it (a failing check of
report.json, the cell teardown's idle check, the pool tier's invariants, ``compare``'s
perf rows), or SGLang's own invariant does, named as such (its strict idle check:
"memory leak detected", found in the log of the server it killed; one of its own ``assert``
statements, the death's last traceback raised in SGLang's code: ``conformance.server_log``).  Everything else a
fault run can end in is its own category, reported and never scored as caught:

* ``start-up death`` -- the server died before serving, and its log names no invariant;
* ``server death`` -- the server died (or stopped serving) later, unexplained;
* ``timeout`` -- the run hit its time limit (proves nothing);
* ``crash`` -- a check errored (did not complete) or pytest failed without a finding;
* ``not reached`` -- a real-SGLang fault whose hooks never fired;
* ``missed`` -- the run passed.

Pure: lines in (``runs._caught_by``'s), a category and the catching checks out.
"""

from __future__ import annotations

from typing import Iterable

from conformance.server_log import SGLANG_ASSERTION

#: SGLang's own invariant, as the score names it.
SGLANG_IDLE_CHECK = "SGLang's idle check"
CAUGHT = "caught"
UNSCORED = ("start-up death", "server death", "timeout", "crash", "not reached", "missed")
_DEATH = ("server died", "server is not serving", "not serving at teardown", "exited during start-up", "server not serving")


def catcher(line: str) -> str | None:
    """The named check (or SGLang invariant) a run's line says caught the fault; None when
    the line is a death, a timeout or a crash."""
    head, _, rest = line.partition(": ")
    if "memory leak detected" in line or SGLANG_IDLE_CHECK in line:
        return f"{SGLANG_IDLE_CHECK} (strict, in the server)" if head.startswith("server died") else f"{head} ({SGLANG_IDLE_CHECK})"
    if SGLANG_ASSERTION in line:  # the death's traceback ends in an assert of SGLang's own code
        return f"{SGLANG_ASSERTION.removesuffix(' failed')} (in the server)"
    if head in ("error", "pytest exit") or head.startswith(("pytest exit", "timed out", "never reached", "no test selected")) or head.endswith(" error"):
        return None
    if any(d in line for d in _DEATH):
        return None
    if head == "cell teardown":
        return "teardown (pools not idle)"
    if head.startswith("perf (compare)"):
        return "perf (compare)"
    return head if rest or head == "pool invariants" else None


def category(lines: Iterable[str], *, timed_out: bool = False, fired: int | None = None) -> tuple[str, list[str]]:
    """(category, the catching checks) of a fault run's lines."""
    lines = list(lines)
    if fired == 0:  # whatever failed, the fault did not cause it
        return "not reached", []
    if timed_out:
        return "timeout", []
    checks = list(dict.fromkeys(c for c in map(catcher, lines) if c))
    if checks:
        return CAUGHT, checks
    if any("start-up" in ln or "exited during start-up" in ln for ln in lines):
        return "start-up death", []
    if any(d in ln for ln in lines for d in _DEATH):
        return "server death", []
    if lines:
        return "crash", []
    return "missed", []
