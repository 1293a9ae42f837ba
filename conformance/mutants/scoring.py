"""Honest scoring: which line of a fault's run counts as catching it.

A seeded fault is caught only when a **named check** reports it (a failing check of
report.json, the cell teardown's idle check, the pool tier's invariants, ``compare``'s
perf rows), or SGLang's own invariant does, named as such (its strict idle check:
"memory leak detected", found in the log of the server it killed; one of its own ``assert``
statements, the death's last traceback raised in SGLang's code: ``conformance.server_log``).  Everything else a
fault run can end in is its own category, reported and never scored as caught:

* ``start-up death`` -- the server died before serving, and its log names no invariant;
* ``server death`` -- the server died (or stopped serving) later, unexplained (a plain
  ``TypeError`` in the leaks suite is a death, not a leak the suite found);
* ``timeout`` -- the run hit its time limit (proves nothing);
* ``hang`` -- a request did not answer (a finding of kind ``hung``);
* ``vacuous`` -- a check failed for having compared nothing ("no program ran", "only 0/4
  prompts hit", gauges that never moved);
* ``known bug`` -- a failure a known SGLang bug explains (an xfail): not this fault's catch;
* ``crash`` -- a check errored (did not complete) or pytest failed without a finding;
* ``not reached`` -- a real-SGLang fault whose hooks never fired;
* ``missed`` -- the run passed.

A failing check of report.json is read per finding (``details.findings``, each with its kind,
:data:`conformance.checks.findings.KINDS`): a line ``<check> [<kind>]: <line>`` per finding, caught
only when the kind names a fault's effect or SGLang's own invariant (``Kind.catch``).

Pure: lines in (``runs._caught_by``'s, :func:`verdict_lines`), a category and the catching checks out.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from conformance.checks.findings import DEATH, HANG, KINDS, KIT, VACUOUS, findings_of
from conformance.server_log import SGLANG_ASSERTION

#: SGLang's own invariant, as the score names it.
SGLANG_IDLE_CHECK = "SGLang's idle check"
CAUGHT = "caught"
KNOWN_BUG = "known bug"
UNSCORED = ("start-up death", DEATH, "timeout", HANG, VACUOUS, KNOWN_BUG, KIT, "not reached", "missed")
_DEATH = ("server died", "server is not serving", "not serving at teardown", "exited during start-up", "server not serving")
#: ``<check> [<kind>]``: the head of a finding's line (:func:`verdict_lines`)
_KINDED = re.compile(r"(?P<check>[^\[]+?) \[(?P<kind>[^\]]+)\]$")


def verdict_lines(check: str, verdict: Mapping[str, Any]) -> list[str]:
    """A failing check of report.json as scoring lines, one per finding: ``<check> [<kind>]:
    <line>`` (SGLang's strict idle check named where a death's leak report came from it); a
    known SGLang bug's xfail ``<check> [known bug <id>]: <reason>``."""
    if verdict.get("status") != "fail":
        return []
    known = (verdict.get("details") or {}).get("known_bug")
    if known:
        return [f"{check} [{KNOWN_BUG} {known.get('id', '?')}]: {(verdict.get('reason') or '')[:110]}"]
    if not (verdict.get("details") or {}).get("findings"):  # a check that names no kinds yet: its reason, as before
        return [f"{check}: {(verdict.get('reason') or '')[:110]}"]
    return [f"{check} [{f.kind}]: {f.line[:110]}" + (f" ({SGLANG_IDLE_CHECK})" if f.facts.get("by") == "sglang_idle_check" else "")
            for f in findings_of(verdict)]


def _kinded(head: str, line: str) -> tuple[bool, str | None]:
    """A finding's line (``<check> [<kind>]``): (True, its catcher or None); (False, None) otherwise."""
    m = _KINDED.match(head)
    if m is None:
        return False, None
    kind, check = m["kind"], m["check"]
    if kind.startswith(KNOWN_BUG) or kind not in KINDS or not KINDS[kind].catch:
        return True, None
    if SGLANG_IDLE_CHECK in line:
        died = any(d in line for d in ("server died", "not alive", "exited"))
        return True, f"{SGLANG_IDLE_CHECK} (strict, in the server)" if died else f"{check} ({SGLANG_IDLE_CHECK})"
    if kind == "server_died:assertion":
        return True, f"{SGLANG_ASSERTION.removesuffix(' failed')} (in the server)"
    return True, check


def column(line: str) -> str | None:
    """The column of a finding's line that is not a catch (its kind's, or ``known bug``); None otherwise."""
    m = _KINDED.match(line.partition(": ")[0])
    if m is None:
        return None
    kind = m["kind"]
    if kind.startswith(KNOWN_BUG):
        return KNOWN_BUG
    return KINDS[kind].column if kind in KINDS else KIT


def catcher(line: str) -> str | None:
    """The named check (or SGLang invariant) a run's line says caught the fault; None when
    the line is a death, a timeout, a hang, a vacuity, a known bug or a crash."""
    head, _, rest = line.partition(": ")
    kinded, named = _kinded(head, line)
    if kinded:
        return named
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
    columns = {c for c in map(column, lines) if c}
    for col in (KNOWN_BUG, DEATH, HANG, VACUOUS, KIT):  # a finding that is no catch files the run in its own column
        if col in columns:
            return col, []
    if any("start-up" in ln or "exited during start-up" in ln for ln in lines):
        return "start-up death", []
    if any(d in ln for ln in lines for d in _DEATH):
        return "server death", []
    if lines:
        return "crash", []
    return "missed", []
