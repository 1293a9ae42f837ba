"""The reaper: a tiny watchdog process that kills the kit's servers when the process that
started them dies without cleaning up (``kill -9`` of an xdist worker, an OOM kill).

The launcher starts one per process, in its own session, and writes to its stdin
``group <pgid>`` / ``pid <pid>`` when it starts a server (or the forkserver) and
``forget <kind> <id>`` when it has stopped one itself. When stdin reaches EOF -- the
parent exited, however -- every id still registered gets SIGTERM, a grace period, then
SIGKILL (whole process groups, so grandchildren go too). Run as
``python -m conformance.targets.reaper``; it imports nothing of the kit.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 3.0


def _send(kind: str, ident: int, sig: int) -> bool:
    try:
        if kind == "group":
            os.killpg(ident, sig)
        else:
            os.kill(ident, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _alive(kind: str, ident: int) -> bool:
    return _send(kind, ident, 0)


def reap(registered: set[tuple[str, int]], grace_s: float = GRACE_S) -> None:
    """SIGTERM every registered group/pid, wait up to ``grace_s``, SIGKILL what is left."""
    live = {r for r in registered if _send(r[0], r[1], signal.SIGTERM)}
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = {r for r in live if _alive(*r)}
    for kind, ident in live:
        _send(kind, ident, signal.SIGKILL)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    registered: set[tuple[str, int]] = set()
    for line in sys.stdin:
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("group", "pid") and parts[1].isdigit():
            registered.add((parts[0], int(parts[1])))
        elif len(parts) == 3 and parts[0] == "forget" and parts[2].isdigit():
            registered.discard((parts[1], int(parts[2])))
    reap(registered)
    return 0


if __name__ == "__main__":  # pragma: no cover - the reaper process
    sys.exit(main())
