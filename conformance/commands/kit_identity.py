"""Which kit ran a night's shard: the commit of the kit's checkout and its commit time
(``history --shard`` records it as ``shard.kit``).  The merge lets a newer kit's row of a
(release, check, cell) replace an older kit's, and a fill can plan again what an older kit
failed and no known bug explains."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parents[2]


def kit_identity(root: Path = ROOT) -> dict[str, Any]:
    """``{"commit": sha, "time": unix seconds, "modified": bool}`` of the checkout at
    ``root`` (``modified``: tracked files differ from the commit); commit "" and time 0 when
    it is not a git checkout (an installed kit)."""
    try:
        head = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%H %ct"], capture_output=True, text=True, timeout=60)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {"commit": "", "time": 0, "modified": False}
    sha, _, when = head.stdout.strip().partition(" ")
    if head.returncode != 0 or not when.isdigit():
        return {"commit": "", "time": 0, "modified": False}
    return {"commit": sha, "time": int(when), "modified": bool(status.stdout.strip())}


def kit_of(shard: Mapping[str, Any] | None) -> tuple[int, str]:
    """(commit time, commit) of a shard's ``history.json`` ``shard`` record; (0, "") for a
    shard written before shards recorded their kit."""
    kit = (shard or {}).get("kit") or {}
    return int(kit.get("time") or 0), str(kit.get("commit") or "")
