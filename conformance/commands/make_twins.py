"""``make-twins``: generate the tiny twin models into the cache and print their paths."""

from __future__ import annotations

import argparse

from conformance.reference.twins import make_twins


def cmd_make_twins(args: argparse.Namespace) -> int:
    for path in make_twins(args.names or None, force=args.force):
        print(path)
    return 0
