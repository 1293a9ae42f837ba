"""What a server's log says about how it crashed: the last Python traceback in it, the
exception it ended with and the frame that raised it.

SGLang logs a scheduler's death as ``Scheduler hit an exception: Traceback ...`` followed by
the frames and the exception line (a bare ``AssertionError`` when one of SGLang's own
``assert`` statements failed).  :func:`last_crash` reads that back, so a death is reported
as "SGLang's own assertion failed at logprob_result_processor.py:296: assert len(...)"
instead of the log's last lines (SGLang's crash-diagnostics chatter after the traceback).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_START = re.compile(r"Traceback \(most recent call last\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(?P<name>\w*(?:Error|Exception|Exit|Interrupt)|AssertionError)\b(?::\s*(?P<msg>.*))?$")
#: The phrase a death line carries when one of SGLang's own assertions killed the server
#: (``conformance.mutants.scoring`` counts it as SGLang's invariant catching a fault).
SGLANG_ASSERTION = "SGLang's own assertion failed"


@dataclass(frozen=True)
class Crash:
    """The last traceback of a log: its exception line and the frame that raised it."""

    exception: str  # "AssertionError", "ValueError: pool memory leak detected! ..."
    path: str  # the raising frame's file
    line: int
    source: str  # the raising frame's source line ("assert len(...) == ...")
    at_line: int = 0  # the exception line's index in the log text (what came after it came later)

    @property
    def in_sglang(self) -> bool:
        """Raised in SGLang's own code (not in the kit's plugins or faults, not in a library)."""
        return "/sglang/" in self.path and "/conformance/" not in self.path

    @property
    def sglang_assertion(self) -> bool:
        return self.in_sglang and self.exception.split(":", 1)[0].rsplit(".", 1)[-1] == "AssertionError"

    def describe(self) -> str:
        where = f"{self.path.rsplit('/', 1)[-1]}:{self.line}"
        if self.sglang_assertion:
            detail = self.exception.partition(":")[2].strip()
            return f"{SGLANG_ASSERTION} at {where}: {self.source}{f' ({detail})' if detail else ''}"[:400]
        return f"{self.exception} (raised at {where}{': ' + self.source if self.source else ''})"[:400]


def last_crash(text: str) -> Crash | None:
    """The last complete traceback in ``text`` (frames then an exception line), or None."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if _START.search(ln)]
    for start in reversed(starts):
        frame: tuple[str, int, str] | None = None
        for j in range(start + 1, len(lines)):
            ln = lines[j]
            if m := _FRAME.match(ln):
                nxt = lines[j + 1] if j + 1 < len(lines) else ""
                frame = (m["path"], int(m["line"]), "" if _FRAME.match(nxt) else nxt.strip())  # a frame without source: none
                continue
            if ln.startswith(" ") or not ln.strip():
                continue
            if frame and (e := _EXCEPTION.match(ln.strip())):
                return Crash(ln.strip()[:300], frame[0], frame[1], frame[2][:200], j)
            break
    return None
