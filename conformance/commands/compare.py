"""``compare``: what got worse between two report.json files; exit 1 when something did."""

from __future__ import annotations

import argparse
from pathlib import Path

from conformance.errors import KitError
from conformance.report.compare import compare_reports, load_report_file, render_compare


def cmd_compare(args: argparse.Namespace) -> int:
    if args.perf_threshold is not None and not args.perf_threshold >= 0:
        raise KitError(f"--perf-threshold: expected a fraction >= 0 (e.g. 0.3), got {args.perf_threshold}")
    result = compare_reports(load_report_file(Path(args.old)), load_report_file(Path(args.new)), perf_threshold=args.perf_threshold)
    print(render_compare(result))
    return 1 if result.regressed else 0
