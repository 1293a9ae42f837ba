"""When the kit's code inside SGLang is active, and how it proves that it ran.

The kit's launcher sets these env vars for the servers it starts; the entry points
read them and do nothing without them.  Each plugin appends one JSON line per process
to ``$HYBRID_CONFORMANCE_PLUGIN_REPORT``: which plugin, in which SGLang process role,
what it installed, and any error.  :func:`read_report` is what the kit checks after a
server is healthy (``conformance.targets.plugin_proof``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from conformance.matrix.faults import SGLANG_FAULT_ENV

CPU_ENV = "HYBRID_CONFORMANCE_SGLANG_CPU"
OBSERVE_ENV = "HYBRID_CONFORMANCE_SGLANG_OBSERVE"
#: Set for the prefill and decode servers of a PD cell: the CPU plugin bridges SGLang's PD code.
PD_ENV = "HYBRID_CONFORMANCE_SGLANG_PD"
REPORT_ENV = "HYBRID_CONFORMANCE_PLUGIN_REPORT"

PLATFORM_NAME = "hybrid_conformance_cpu"
CPU_PLUGIN = "hybrid_conformance_cpu"
FAULT_PLUGIN = "hybrid_conformance_faults"
OBSERVE_PLUGIN = "hybrid_conformance_observe"

#: SGLang functions that call ``load_plugins()``, by the role of the process they run in.
_ROLE_BY_CALLER = {
    "run_scheduler_process": "scheduler",
    "run_detokenizer_process": "detokenizer",
    "run_data_parallel_controller_process": "dp_controller",
}


def cpu_enabled() -> bool:
    return os.environ.get(CPU_ENV, "") == "1"


def observe_enabled() -> bool:
    return os.environ.get(OBSERVE_ENV, "") == "1"


def pd_enabled() -> bool:
    return os.environ.get(PD_ENV, "") == "1"


def fault_name() -> str | None:
    return os.environ.get(SGLANG_FAULT_ENV) or None


def process_role() -> str:
    """The SGLang process this runs in, read from the caller of ``load_plugins()``."""
    frame = sys._getframe(1)
    while frame is not None:
        role = _ROLE_BY_CALLER.get(frame.f_code.co_name)
        if role:
            return role
        frame = frame.f_back
    return "main"


def write_report(plugin: str, status: str, **fields: Any) -> None:
    """Append this process's record; silently nothing when the kit gave no report path."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    record = {"plugin": plugin, "status": status, "pid": os.getpid(), "role": process_role(), "t": time.time(), **fields}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")


def read_report(path: Path) -> list[dict[str, Any]]:
    """Every record written so far (an unreadable line is kept as an error record)."""
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            out.append({"plugin": "?", "status": "error", "error": f"unreadable report line: {line[:120]}"})
    return out
