"""``step_slowdown``: every forward step of the model gets a graded fraction slower -- the
step runs unchanged, then the scheduler keeps the CPU busy for ``grade`` x the time the step
took -- while every output, hit and slot stays exactly as it was.

Busy, not asleep: extra work holds the core it runs on, and a sleep on a loaded machine
costs the OS's wake-up delay on top of what it asked for (measured on sglang-cpu at load 9:
a +20% sleep moved decode time per token x3.8, a +5% one x1.15), which would overstate every
grade.

Models a small, uniform performance regression of the kind SGLang PR 20522 removed (a
device-to-host copy per step; its author measured TTFT +6% by hand): the grade is "+X% of a
step's work", so +5%, +10% and +20% are the sizes a paired A/B run must see
(``conformance/suites/perf/ab.py``, ``docs/perf.md``).  No correctness check can see it.

The grade comes from ``HYBRID_CONFORMANCE_STEP_SLOWDOWN`` in the server's environment: a
fraction (``0.1`` = +10%), or ``@<file>`` holding one, read again whenever the file changes
(the A/B bench grades one pair of servers in turn without restarting them).  Unset: +10%,
which ``hybrid-conformance mutants --target sglang-cpu`` scores through the paired A/B
(``seen_by``): a pair with the fault on one drawn side must be flagged, a clean pair not.

Hook (AROUND, arguments and result unchanged): ``ModelRunner.forward`` (one call per
prefill or decode batch).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from conformance.matrix.faults import PAIRED_AB, STEP_SLOWDOWN_ENV as GRADE_ENV
from conformance.sglang_plugins.faults.spec import FaultInstallError, Hook, fired, sglang_fault

NAME = "step_slowdown"
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
DEFAULT_GRADE = 0.10
#: (file, its mtime_ns, its grade) of the last ``@file`` read.
_FILE_CACHE: list = [None, None, 0.0]


def parse_grade(text: str, where: str) -> float:
    """A grade (a fraction >= 0) from ``text``; a one-line FaultInstallError otherwise."""
    try:
        grade = float(text.strip())
    except ValueError:
        raise FaultInstallError(f"{where}: {text.strip()!r} is not a fraction (e.g. 0.1 for +10% of a step's work)") from None
    if not 0.0 <= grade <= 100.0:
        raise FaultInstallError(f"{where}: {grade:g} is outside 0..100 (a fraction of a step's work)")
    return grade


def grade() -> float:
    """The current grade: the environment's fraction, or the ``@file``'s (re-read when it changes)."""
    value = os.environ.get(GRADE_ENV, "").strip()
    if not value:
        return DEFAULT_GRADE
    if not value.startswith("@"):
        return parse_grade(value, GRADE_ENV)
    path = Path(value[1:])
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return 0.0  # the bench removed it: no slowdown
    if _FILE_CACHE[0] != path or _FILE_CACHE[1] != mtime:
        _FILE_CACHE[:] = [path, mtime, parse_grade(path.read_text(), f"{GRADE_ENV} file {path}")]
    return _FILE_CACHE[2]


def busy(seconds: float) -> None:
    """Keep this thread on the CPU for ``seconds`` (extra work, not a sleep)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def slow_step(original, *args, **kwargs):
    start = time.perf_counter()
    out = original(*args, **kwargs)
    work = time.perf_counter() - start
    g = grade()
    if g > 0.0:
        busy(g * work)
        fired(NAME, grade=g, work_s=round(work, 6))
    return out


FAULT = sglang_fault(
    NAME,
    "Every forward step of the model is followed by busy work of a graded fraction of the time the step "
    f"took (HYBRID_CONFORMANCE_STEP_SLOWDOWN, +{DEFAULT_GRADE:.0%} unset): prefill and decode get "
    "uniformly slower by a few percent; outputs, hits and slots are unchanged.",
    "a small performance regression per step (class of SGLang PR 20522, whose device-to-host copy "
    "of mamba_track_mask cost TTFT +6%)",
    "TTFT and decode time of the slowed server against a clean one in the same run; the paired A/B "
    "test (conformance/suites/perf/ab.py) flags them, compare's thresholds do not",
    (Hook(TARGET, "around", slow_step),),
    suites=(),
    seen_by=(PAIRED_AB,),
)
