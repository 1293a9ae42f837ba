"""The pytest front, ``run``: preflight first, then pytest with the selection passed
through, then the summary table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.commands.preflight import preflight_for, refuse
from conformance.commands.selection import selected_cells, suites_for, workers
from conformance.matrix.cells import Cell
from conformance.session.options import forward
from conformance.report.run_report import PREFLIGHT_FILE_ENV
from conformance.session.preflight import preflight_only
from conformance.report.progress import ProgressPlugin, wanted
from conformance.report import build_report, write_report
from conformance.report.run_report import run_facts
from conformance.report.summary import print_summary
from conformance.matrix.suites import suite
from conformance.targets.registry import target_for

def pytest_argv_for_run(args: argparse.Namespace) -> list[str]:
    suites = suites_for(args)
    selected_cells(args)  # validates the selection with one clear line
    report_dir = Path(args.report_dir)
    argv = [str(suite(s).path) for s in suites]
    argv += ["-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={report_dir / 'junit.xml'}", f"--report-dir={report_dir}"]
    argv += [f"--target={args.target}", f"--timeout={args.timeout}", *forward(args)]
    marks = [e for e in (args.markexpr, None if (args.with_pool or not target_for(args.target).serves_http()) else "not pool") if e]
    if marks:
        argv += ["-m", " and ".join(f"({e})" for e in marks)]
    if args.keyword:
        argv += ["-k", args.keyword]
    n = workers(args)
    if n > 0:
        argv += ["-n", str(n), "--dist", "loadgroup"]
    argv += list(args.pytest_args)
    return argv


def cmd_run(args: argparse.Namespace) -> int:
    argv = pytest_argv_for_run(args)
    suites, cells = suites_for(args), selected_cells(args)
    report_dir = Path(args.report_dir)
    report_path = report_dir / "report.json"
    if report_path.exists():
        report_path.unlink()
    pre = preflight_for(args, cells, suites)
    if not pre.ok:
        write_refused_report(args, cells, pre, report_dir)
        return refuse(pre)
    if preflight_only():
        print(f"preflight only: {len(cells)} cells selected, nothing started")
        return 0
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "preflight.json").write_text(json.dumps(pre.to_json(), indent=2) + "\n")
    os.environ[PREFLIGHT_FILE_ENV] = str((report_dir / "preflight.json").resolve())

    code = int(pytest.main(argv, plugins=[ProgressPlugin(cells=[c.id for c in cells])] if wanted() else []))
    if not report_path.exists():
        print(f"hybrid-conformance: error: pytest exited {code} without writing {report_path}", file=sys.stderr)
        return code or 1
    report = json.loads(report_path.read_text())
    print_summary(report, report_dir)
    if code == 5:
        print("hybrid-conformance: error: no test matched the selection (pytest collected nothing)", file=sys.stderr)
        return 5
    if code == 0 and not report.get("complete", False):
        return 1  # everything that ran passed, but not everything ran
    return code


def write_refused_report(args: argparse.Namespace, cells: list[Cell], pre: Any, report_dir: Path) -> None:
    """A run refused at preflight still leaves a report saying so (complete: false)."""
    report = build_report(target=args.target, launches=0, wall_s=0.0, cells=[])
    report.update(run_facts(target=args.target, cells=cells, twins=args.twins))
    report["complete"] = False
    report["incomplete_reasons"] = [f"preflight: {line.text}" for line in pre.failures]
    report["cells_not_run"] = [c.id for c in cells]
    report["preflight"] = pre.to_json()
    try:
        write_report(report, report_dir)
    except OSError:
        pass
