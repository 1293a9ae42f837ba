"""Start the reference server as a child process (for tests and the benchmark) with the
kit's launcher: free port on 127.0.0.1, /health polled with a deadline, group kill on stop.
It lives with the targets (the launching side), so the engine package never imports them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from conformance.targets.launcher import ServerProcess, free_port
from conformance.targets.reference import PRELOAD


def start_reference(log_dir: Path, *args: str, env: dict | None = None,
                    start_timeout_s: float = 90.0) -> tuple[ServerProcess, str]:
    """A healthy server started with ``args`` (e.g. ``--model toy``); returns (process, base URL).
    The caller must ``stop()`` the process (a failed start is already stopped)."""
    port = free_port()
    argv = [sys.executable, "-m", "conformance.reference.server", *args, "--port", str(port)]
    sp = ServerProcess(name="reference", argv=argv, health_url=f"http://127.0.0.1:{port}/health",
                       log_path=Path(log_dir) / f"reference-{port}.log",
                       env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                       start_timeout_s=start_timeout_s,
                       entry="conformance.reference.server:main", entry_argv=argv[3:], preload=PRELOAD)
    sp.start()
    return sp, f"http://127.0.0.1:{port}"


def read_metric(text: str, name: str) -> float | None:
    """The value of one Prometheus sample (any labels), or None when absent."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None
