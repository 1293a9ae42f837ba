"""The kit's side of the reaper (``conformance.targets.reaper``): one watchdog process per kit
process, told which process groups and pids to kill if the kit dies without cleaning up.

Used by the launcher (each server's group, the forkserver) and by the pre-imported
launcher (``conformance.targets.preimport``: the zygote's group).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading


class Reaper:
    """This process's reaper (started on first use): told which groups/pids to kill if we die."""

    proc: "subprocess.Popen[str] | None" = None
    lock = threading.Lock()
    told_forkserver: int | None = None

    @classmethod
    def tell(cls, kind: str, ident: int, *, forget: bool = False) -> None:
        with cls.lock:
            try:
                if cls.proc is None or cls.proc.poll() is not None:
                    if forget:
                        return
                    cls.proc = subprocess.Popen(
                        [sys.executable, "-m", "conformance.targets.reaper"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL, text=True, start_new_session=True, close_fds=True,
                    )
                assert cls.proc.stdin is not None
                cls.proc.stdin.write(f"{'forget ' if forget else ''}{kind} {ident}\n")
                cls.proc.stdin.flush()
            except (OSError, ValueError):  # no reaper: PDEATHSIG and the handlers remain
                pass

    @classmethod
    def pid(cls) -> int | None:
        return cls.proc.pid if cls.proc is not None else None


def register_with_reaper(kind: str, ident: int, *, forget: bool = False) -> None:
    """Tell this process's reaper to kill ``kind`` (``group`` or ``pid``) ``ident`` if we die
    (``forget``: we stopped it ourselves)."""
    Reaper.tell(kind, ident, forget=forget)


def pid_exists(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie included; one we may not signal too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
