"""The ``history`` verb: one of its forms per call (``--merge``, ``--bisect``, ``--peer-kits``,
else the release x check table of ``conformance/commands/history.py``)."""

from __future__ import annotations

import argparse

from conformance.commands.bisect import run_bisect
from conformance.commands.history import run_history
from conformance.commands.history_merge import run_merge
from conformance.commands.peer_kits import run_peer_kits


def cmd_history(args: argparse.Namespace) -> int:
    """``--merge DIR...`` merges a night's shards, ``--bisect ID`` bisects one known bug,
    ``--peer-kits`` plays SGLang's own kits on the known bugs; otherwise the table."""
    if args.merge:
        return run_merge(args)
    if args.peer_kits:
        return run_peer_kits(args)
    return run_bisect(args) if args.bisect else run_history(args)
