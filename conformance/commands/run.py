"""The pytest front, ``run``: preflight first, then pytest with the selection passed
through, then the summary table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.commands.preflight import preflight_for, refuse
from conformance.commands.report_bug import write_bug_folders
from conformance.commands.selection import Selection
from conformance.matrix.cells import Cell
from conformance.session.options import Options, forward
from conformance.report.run_report import PREFLIGHT_FILE_ENV
from conformance.session.preflight import Preflight, preflight_only
from conformance.report.progress import ProgressPlugin, wanted
from conformance.report.files import write_report
from conformance.report.schema import build_report
from conformance.report.run_report import run_facts
from conformance.report.summary import print_summary
from conformance.matrix.suites import suite
from conformance.targets.registry import target_for


@dataclass(frozen=True)
class RunRequest:
    """What one ``run`` (``fuzz``: through it) is asked, read from its command line once and
    in the order its checks speak: the selection, what pytest gets besides (the options it
    takes, ``-m``, ``-k``, the extra arguments), the workers, the timeout, the report folder."""

    selection: Selection
    forwarded: tuple[str, ...]  # the selection's and the target's own options as pytest takes them
    workers: int
    timeout: int
    markexpr: str | None
    keyword: str | None
    with_pool: bool
    pytest_args: tuple[str, ...]
    report_dir: Path

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunRequest:
        selection = Selection.of(args)
        forwarded = tuple(forward(args))
        return cls(selection, forwarded, selection.workers(args.workers), args.timeout, args.markexpr, args.keyword, args.with_pool,
                   tuple(args.pytest_args), Path(args.report_dir))

    @property
    def options(self) -> Options:
        return self.selection.options

    def pytest_argv(self) -> list[str]:
        target = self.options.target
        argv = [str(suite(s).path) for s in self.selection.suites]
        argv += ["-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={self.report_dir / 'junit.xml'}", f"--report-dir={self.report_dir}"]
        argv += [f"--target={target}", f"--timeout={self.timeout}", *self.forwarded]
        marks = [e for e in (self.markexpr, None if (self.with_pool or not target_for(target).serves_http()) else "not pool") if e]
        if marks:
            argv += ["-m", " and ".join(f"({e})" for e in marks)]
        if self.keyword:
            argv += ["-k", self.keyword]
        if self.workers > 0:
            argv += ["-n", str(self.workers), "--dist", "loadgroup"]
        argv += list(self.pytest_args)
        return argv


def cmd_run(args: argparse.Namespace) -> int:
    return run(RunRequest.of(args))


def run(req: RunRequest) -> int:
    argv = req.pytest_argv()
    cells = list(req.selection.cells)
    report_path = req.report_dir / "report.json"
    if report_path.exists():
        report_path.unlink()
    pre = preflight_for(req.selection, req.workers)
    if not pre.ok:
        write_refused_report(req.options, cells, pre, req.report_dir)
        return refuse(pre)
    if preflight_only():
        print(f"preflight only: {len(cells)} cells selected, nothing started")
        return 0
    req.report_dir.mkdir(parents=True, exist_ok=True)
    (req.report_dir / "preflight.json").write_text(json.dumps(pre.to_json(), indent=2) + "\n")
    os.environ[PREFLIGHT_FILE_ENV] = str((req.report_dir / "preflight.json").resolve())

    code = int(pytest.main(argv, plugins=[ProgressPlugin(cells=[c.id for c in cells])] if wanted() else []))
    if not report_path.exists():
        print(f"hybrid-conformance: error: pytest exited {code} without writing {report_path}", file=sys.stderr)
        return code or 1
    report = json.loads(report_path.read_text())
    print_summary(report, req.report_dir)
    for line in write_bug_folders(report, req.report_dir, req.options):
        print(line)
    if code == 5:
        print("hybrid-conformance: error: no test matched the selection (pytest collected nothing)", file=sys.stderr)
        return 5
    if code == 0 and not report.get("complete", False):
        return 1  # everything that ran passed, but not everything ran
    return code


def write_refused_report(options: Options, cells: list[Cell], pre: Preflight, report_dir: Path) -> None:
    """A run refused at preflight still leaves a report saying so (complete: false)."""
    report = build_report(target=options.target, launches=0, wall_s=0.0, cells=[])
    report.update(run_facts(target=options.target, cells=cells, twins=options.twins))
    report["complete"] = False
    report["incomplete_reasons"] = [f"preflight: {line.text}" for line in pre.failures]
    report["cells_not_run"] = [c.id for c in cells]
    report["preflight"] = pre.to_json()
    try:
        write_report(report, report_dir)
    except OSError:
        pass
