"""``--sglang-source PATH``: a local SGLang git checkout treated as a release.

The checkout's ``python/`` folder is installed without dependencies into its own venv
under the history venv folder, named by the checkout's commit
(``sglang-src-<commit 12>``, made once by ``history.ensure_source_venv`` through
``ci/setup-cpu.sh``; the release pins follow the version in ``python/pyproject.toml``).
``history`` runs it as one more column (``src-<commit 12>``); ``run``, ``fuzz`` and
``mutants`` re-run themselves inside that venv (``history.rerun_in_source``) with
:data:`conformance.report.versions.SOURCE_ENV` set, so the report's ``versions`` records the checkout's path and
commit.  This module imports nothing of the kit but its errors.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from conformance.errors import KitError

FLAG = "--sglang-source"


@dataclass(frozen=True)
class Checkout:
    path: Path
    commit: str
    version: str

    @property
    def label(self) -> str:
        return f"src-{self.commit[:12]}"

    @property
    def venv_name(self) -> str:
        return f"sglang-{self.label}"


def checkout(path: str | Path) -> Checkout:
    """The checkout at ``path`` (its commit and SGLang version); KitError naming what is wrong."""
    root = Path(path).expanduser().resolve()
    pyproject = root / "python" / "pyproject.toml"
    if not pyproject.is_file():
        raise KitError(f"{FLAG} {path}: not an SGLang checkout (no python/pyproject.toml)")
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KitError(f"{FLAG} {path}: git rev-parse failed: {e}") from None
    if out.returncode:
        raise KitError(f"{FLAG} {path}: not a git checkout with a commit ({' '.join(out.stderr.split())[:200]})")
    m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
    if not m:
        raise KitError(f"{FLAG} {path}: python/pyproject.toml names no version")
    return Checkout(root, out.stdout.strip(), m.group(1))




def without_flag(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--sglang-source PATH`` / ``--sglang-source=PATH`` removed."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == FLAG:
            skip = True
        elif not a.startswith(f"{FLAG}="):
            out.append(a)
    return out
