"""The ``hybrid-conformance`` command: run | preflight | plan | serve | make-twins | mutants | compare | history | fuzz | replay.

Bad arguments exit 2 with one line naming the bad value and the allowed ones;
a :class:`KitError` anywhere exits 2 with its one line; no traceback walls.
``run`` checks every need first (``conformance.preflight``, one line each on stdout):
a selection that matches no cell exits 5, a run this machine cannot do exits 3, each
with at most three lines on stderr and before any server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from conformance import __version__
from conformance.errors import KitError
from conformance.matrix import DEFAULT_TARGET, DEFAULT_TIER, STRATEGIES, TARGETS, TIERS, Cell, load_matrix

SUITES = ("leaks", "kl", "prefix_branching", "gsm8k", "disagg", "agreement", "perf", "programs")
DEFAULT_SUITES = ("kl", "prefix_branching", "gsm8k", "leaks")  # leaks last: it judges every scenario's idle probe
#: Suites that only mean something on some targets, added to their default set (perf: from
#: the standard tier up, see ``conformance.perf.not_selected``).
TARGET_SUITES = {"sglang-cpu": ("agreement", "perf"), "sglang": ("perf",)}
PKG_DIR = Path(__file__).resolve().parent


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"hybrid-conformance: error: {message}\n")


def _add_selection(p: argparse.ArgumentParser, *, default_target: str) -> None:
    p.add_argument("--target", choices=TARGETS, default=default_target, help="who answers (default: %(default)s)")
    p.add_argument("--models", help="comma list of model ids, families or twin names")
    p.add_argument("--strategies", help=f"comma list of strategies ({', '.join(STRATEGIES)})")
    p.add_argument("--faults", help="comma list of faults (e.g. none,lazy_alloc_fail)")
    p.add_argument("--page-sizes", help="comma list of page sizes")
    p.add_argument("--tier", choices=TIERS, help=f"premerge < standard < nightly (default {DEFAULT_TIER})")
    p.add_argument("--matrix", help="matrix file (default: fixtures/matrix.toml)")
    p.add_argument("--sglang-launcher", default="python -m sglang.launch_server", help="command that starts SGLang")
    p.add_argument("--gpus-per-worker", type=int, default=1, help="GPUs each xdist worker owns")
    p.add_argument("--twins", action="store_true", help="with --target sglang: serve the tiny twins")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --target sglang-cpu: SGLang's --dtype (default float32)")
    p.add_argument("--suite", help=f"comma list of suites ({', '.join(SUITES)}; default: {', '.join(DEFAULT_SUITES)})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybrid-conformance", description="Conformance kit for Mamba state caching in SGLang hybrid models")
    parser.add_argument("--version", action="version", version=f"hybrid-conformance {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    run = sub.add_parser("run", help="run the suites through pytest and print a summary table")
    _add_selection(run, default_target=DEFAULT_TARGET)
    run.add_argument("--report-dir", default="reports/latest", help="where report.json, junit.xml, report.md/html go")
    run.add_argument("-m", dest="markexpr", help="pytest marker expression, e.g. lazy_alloc_fail")
    run.add_argument("-k", dest="keyword", help="pytest -k expression")
    run.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers, 0 for none; a cell's tests stay on one worker "
                     "(default: min(2, cores); with --target sglang, the visible GPUs / --gpus-per-worker)")
    run.add_argument("--timeout", type=int, default=900, help="per-test timeout in seconds (pytest-timeout)")
    run.add_argument("--gsm8k-dir", help="local GSM8K folder (else env HYBRID_CONFORMANCE_GSM8K_DIR)")
    run.add_argument("--with-pool", action="store_true", help="also run the pool tier with a server target")
    run.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest after --")

    pre = sub.add_parser("preflight", help="check what a run needs (data, GPUs, SGLang and its features, ports) and start nothing")
    _add_selection(pre, default_target=DEFAULT_TARGET)
    pre.add_argument("-n", dest="workers", default=None, help="pytest-xdist workers the run would use (default: as `run` picks them)")
    pre.add_argument("--gsm8k-dir", help="local GSM8K folder (else env HYBRID_CONFORMANCE_GSM8K_DIR)")

    plan = sub.add_parser("plan", help="print the cells and, for --target sglang, each exact command and env")
    _add_selection(plan, default_target=DEFAULT_TARGET)
    plan.add_argument("--format", choices=("table", "json"), default="table")
    plan.add_argument("--validate", action="store_true", help="check every sglang command with SGLang's own parser (CPU)")

    # `serve` hands its arguments to the reference server's own parser (see main()); this
    # entry only lists it in --help.
    sub.add_parser("serve", help="start the embedded reference server (serve --help for its options)", add_help=False)

    twins = sub.add_parser("make-twins", help="generate the tiny twin models into the cache")
    twins.add_argument("names", nargs="*", help="twin names (default: all)")
    twins.add_argument("--force", action="store_true")

    mut = sub.add_parser("mutants", help="run the suites clean and once per seeded fault; print the mutation score")
    mut.add_argument("--target", choices=("reference", "pool", "sglang-cpu"), default="reference", help="whose faults: the reference engine, the pool tier, or real SGLang on CPU")
    mut.add_argument("--only", help="comma list of fault names")
    mut.add_argument("--report-dir", default="reports/mutants")
    mut.add_argument("--fast", action="store_true", help="the CI subset")
    mut.add_argument("--programs", metavar="BUDGET", help="also run the request programs per fault with this budget (premerge, nightly, N, Ns)")
    mut.add_argument("--programs-only", action="store_true", help="only the request programs (no scripted suites)")
    mut.add_argument("--seed", type=int, default=0, help="request-program seed (default: %(default)s)")
    mut.add_argument("--shrink-budget", type=float, default=None, help="seconds of shrinking after a program finds a fault (default: the budget's own)")

    fuzz = sub.add_parser("fuzz", help="randomized request programs per cell (the programs suite) under a budget")
    _add_selection(fuzz, default_target="reference")
    fuzz.add_argument("--budget", default="premerge", help="per cell: premerge, nightly, N examples or Ns/Nm seconds (default: %(default)s)")
    fuzz.add_argument("--seed", type=int, default=0, help="generator seed (default: %(default)s)")
    fuzz.add_argument("--shrink-budget", type=float, help="seconds of shrinking after a finding")
    fuzz.add_argument("--program-db", help="hypothesis database root (default .hypothesis/hybrid-conformance)")
    fuzz.add_argument("--report-dir", default="reports/fuzz", help="report.json and programs/ (failure files) go here")
    fuzz.add_argument("-n", dest="workers", default=str(min(2, os.cpu_count() or 1)), help="pytest-xdist workers (default: %(default)s)")
    fuzz.add_argument("--timeout", type=int, default=3600, help="per-cell timeout in seconds (pytest-timeout)")
    fuzz.add_argument("pytest_args", nargs="*", help="extra arguments passed to pytest after --")

    from conformance.programs.replay import add_arguments as add_replay_arguments

    add_replay_arguments(sub.add_parser("replay", help="play one program file (a shrunk finding) against a target"))

    from conformance.history import add_parser as add_history_parser

    add_history_parser(sub)

    cmp_ = sub.add_parser("compare", help="what got worse between two report.json files")
    cmp_.add_argument("old")
    cmp_.add_argument("new")
    cmp_.add_argument("--perf-threshold", type=float, help="flag a perf ratio worse by more than this fraction (e.g. 0.3), never inside the noise (default per ratio kind: TTFT ratios 0.5, decode tok/s ratios 6.0, memory 0.1; measured spread in docs/perf.md)")
    return parser


# ------------------------------------------------------------------ selection

def _csv(v: str | None) -> list[str] | None:
    return [x.strip() for x in v.split(",") if x.strip()] if v else None


def _suites(args: argparse.Namespace) -> list[str]:
    from conformance.perf.selection import not_selected

    tier, target = getattr(args, "tier", None) or DEFAULT_TIER, getattr(args, "target", "")
    default = [*(s for s in TARGET_SUITES.get(target, ()) if s != "perf" or not not_selected(target, tier, asked=False)), *DEFAULT_SUITES]
    suites = _csv(getattr(args, "suite", None)) or default
    for s in suites:
        if s not in SUITES:
            raise KitError(f"--suite: unknown value {s!r}; allowed: {', '.join(SUITES)}")
    return suites


def _selected_cells(args: argparse.Namespace) -> list[Cell]:
    m = load_matrix(args.matrix)
    pages = _csv(args.page_sizes)
    try:
        page_sizes = [int(p) for p in pages] if pages else None
    except ValueError:
        raise KitError(f"--page-sizes: expected integers, got {args.page_sizes!r}") from None
    return m.select(
        target=args.target,
        models=_csv(args.models),
        strategies=_csv(args.strategies),
        faults=_csv(args.faults),
        page_sizes=page_sizes,
        tier=args.tier or DEFAULT_TIER,
    )


def _selection_text(args: argparse.Namespace) -> str:
    flags = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("models", "strategies", "faults", "page_sizes", "matrix") if getattr(args, k, None)]
    return ", ".join([f"tier {args.tier or DEFAULT_TIER}", *flags])


# ------------------------------------------------------------------ preflight

def _workers(args: argparse.Namespace) -> int:
    """The xdist workers a run uses (0: none). Without ``-n``: two on CPU targets (fewer
    cores: fewer); on target sglang one per ``--gpus-per-worker`` block of visible GPUs."""
    w = getattr(args, "workers", None)
    if w is None:
        if args.target == "sglang":
            from conformance.targets.sglang import visible_gpus

            visible = visible_gpus()[0] or []
            return max(1, len(visible) // max(1, args.gpus_per_worker))
        return min(2, os.cpu_count() or 1)
    w = str(w)
    if w in ("auto", "logical"):
        return os.cpu_count() or 1
    if not w.isdigit():
        raise KitError(f"-n: expected a number of workers, got {w!r}")
    return int(w)


def _preflight(args: argparse.Namespace, cells: list[Cell], suites: list[str]) -> Any:
    from conformance.preflight import Request, run_preflight

    req = Request(
        target=args.target, cells=tuple(cells), suites=tuple(suites), gsm8k_dir=getattr(args, "gsm8k_dir", None),
        gpus_per_worker=args.gpus_per_worker, workers=max(1, _workers(args)), twins=args.twins, selection=_selection_text(args),
    )
    return run_preflight(req, on_line=lambda line: print(line.render(), flush=True))


def _refuse(pre: Any) -> int:
    """At most three stderr lines: the first failure, what can run instead, how many more."""
    first = pre.failures[0]
    print(f"hybrid-conformance: error: {first.text}", file=sys.stderr)
    if first.hint:
        print(f"hybrid-conformance: hint: {first.hint}", file=sys.stderr)
    if len(pre.failures) > 1:
        print(f"hybrid-conformance: {len(pre.failures) - 1} more preflight failure(s) listed above", file=sys.stderr)
    return 5 if first.name == "selection" else 3


def cmd_preflight(args: argparse.Namespace) -> int:
    suites = _suites(args)
    pre = _preflight(args, _selected_cells(args), suites)
    return 0 if pre.ok else _refuse(pre)


# ------------------------------------------------------------------ plan

def cmd_plan(args: argparse.Namespace) -> int:
    from conformance.targets.serving import spec_for

    cells = _selected_cells(args)
    rows = []
    # A plan shows each command as worker 0 would launch it, with enough GPUs for its tp size.
    plan_opts = argparse.Namespace(**{**vars(args), "gpus_per_worker": max([args.gpus_per_worker, *(c.model.tp_size for c in cells)])})
    from conformance.targets.sglang import describing_gpus

    for i, cell in enumerate(cells):
        row: dict[str, Any] = {**cell.describe(), "markers": list(cell.markers)}
        if args.target in ("sglang", "sglang-cpu", "reference"):
            with describing_gpus():
                spec = spec_for(cell, plan_opts, port=30000 + i)
            row["command"] = spec.argv
            row["env"] = spec.env
        rows.append(row)
    failures = 0
    if args.validate:
        if args.target != "sglang":
            raise KitError("--validate checks sglang commands: use it with --target sglang")
        from conformance.targets.sglang import describing_gpus

        with describing_gpus():
            failures = _validate_rows(rows, cells, args)
    if args.format == "json":
        print(json.dumps({"cells": rows}, indent=2))
    else:
        for row in rows:
            line = f"{row['id']:<58} {','.join(row['markers'])}"
            if "command" in row:
                env = " ".join(f"{k}={v}" for k, v in row["env"].items())
                line += f"\n    {env + ' ' if env else ''}{shlex.join(row['command'])}"
            if "validation" in row:
                line += f"\n    validation: {row['validation']}"
            print(line)
        print(f"{len(rows)} cells")
    return 1 if failures else 0


def _validate_rows(rows: list[dict[str, Any]], cells: list[Cell], args: argparse.Namespace) -> int:
    from conformance.targets.sglang import config_folder, strip_launcher, validate_server_args

    from conformance.targets.disagg import not_applicable, pd_spec_for, validate_pd_spec

    from conformance.sglang_api.probes import probe

    print(f"hybrid-conformance: {probe().summary()}", file=sys.stderr)
    failures = 0
    pd_opts = argparse.Namespace(**{**vars(args), "gpus_per_worker": 3 * max(c.model.tp_size for c in cells)}) if cells else args
    for row, cell in zip(rows, cells):
        config = config_folder(cell, twins=args.twins)
        v = validate_server_args(strip_launcher(row["command"], args.sglang_launcher), cell, config=config)
        row["validation"] = v.message if v.status != "na" else f"n/a: {v.message}"
        if v.status == "na":
            print(f"hybrid-conformance: {cell.id}: not applicable on this SGLang: {v.message}", file=sys.stderr)
            continue
        if not v.ok:
            failures += 1
            print(f"hybrid-conformance: {cell.id}: SGLang refuses the command: {v.message}", file=sys.stderr)
        if not_applicable(cell):
            row["pd"] = not_applicable(cell)
            continue
        if cell.cache_variant.name != "radix":
            continue
        pd = validate_pd_spec(pd_spec_for(cell, pd_opts), cell, config=config)
        row["pd"] = {role: val.message if val.status != "na" else f"n/a: {val.message}" for role, val in pd.items()}
        for role, val in pd.items():
            if val.status == "na":
                print(f"hybrid-conformance: {cell.id}: PD {role} not applicable on this SGLang: {val.message}", file=sys.stderr)
            elif not val.ok:
                failures += 1
                print(f"hybrid-conformance: {cell.id}: PD {role} command refused: {val.message}", file=sys.stderr)
    return failures


# ------------------------------------------------------------------ run

def pytest_argv_for_run(args: argparse.Namespace) -> list[str]:
    suites = _suites(args)
    _selected_cells(args)  # validates the selection with one clear line
    report_dir = Path(args.report_dir)
    argv = [str(PKG_DIR / s) for s in suites]
    argv += ["-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={report_dir / 'junit.xml'}", f"--report-dir={report_dir}"]
    argv += [f"--target={args.target}", f"--timeout={args.timeout}"]
    for flag in ("models", "strategies", "faults", "page_sizes", "tier", "matrix", "gsm8k_dir", "dtype"):
        value = getattr(args, flag, None)
        if value:
            argv.append(f"--{flag.replace('_', '-')}={value}")
    if args.target == "sglang":
        argv += [f"--sglang-launcher={args.sglang_launcher}", f"--gpus-per-worker={args.gpus_per_worker}"]
        if args.twins:
            argv.append("--twins")
    marks = [e for e in (args.markexpr, None if (args.with_pool or args.target == "pool") else "not pool") if e]
    if marks:
        argv += ["-m", " and ".join(f"({e})" for e in marks)]
    if args.keyword:
        argv += ["-k", args.keyword]
    workers = _workers(args)
    if workers > 0:
        argv += ["-n", str(workers), "--dist", "loadgroup"]
    argv += list(args.pytest_args)
    return argv


def cmd_run(args: argparse.Namespace) -> int:
    from conformance.preflight import PREFLIGHT_FILE_ENV, preflight_only
    from conformance.summary import print_summary

    argv = pytest_argv_for_run(args)
    suites, cells = _suites(args), _selected_cells(args)
    report_dir = Path(args.report_dir)
    report_path = report_dir / "report.json"
    if report_path.exists():
        report_path.unlink()
    pre = _preflight(args, cells, suites)
    if not pre.ok:
        _write_refused_report(args, cells, pre, report_dir)
        return _refuse(pre)
    if preflight_only():
        print(f"preflight only: {len(cells)} cells selected, nothing started")
        return 0
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "preflight.json").write_text(json.dumps(pre.to_json(), indent=2) + "\n")
    os.environ[PREFLIGHT_FILE_ENV] = str((report_dir / "preflight.json").resolve())

    import pytest

    from conformance.progress import ProgressPlugin, wanted

    code = int(pytest.main(argv, plugins=[ProgressPlugin()] if wanted() else []))
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


def _write_refused_report(args: argparse.Namespace, cells: list[Cell], pre: Any, report_dir: Path) -> None:
    """A run refused at preflight still leaves a report saying so (complete: false)."""
    from conformance.report import build_report, write_report
    from conformance.runreport import run_facts

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


# ------------------------------------------------------------------ others

def cmd_serve(serve_args: list[str]) -> int:
    """``serve`` takes the reference server's own options (and its --help) as they are."""
    from conformance.reference.server import main as serve_main

    return int(serve_main(serve_args) or 0)


def cmd_make_twins(args: argparse.Namespace) -> int:
    from conformance.reference.twins import make_twins

    for path in make_twins(args.names or None, force=args.force):
        print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from conformance.report.compare import load_report_file, compare_reports, render_compare

    if args.perf_threshold is not None and not args.perf_threshold >= 0:
        raise KitError(f"--perf-threshold: expected a fraction >= 0 (e.g. 0.3), got {args.perf_threshold}")
    result = compare_reports(load_report_file(Path(args.old)), load_report_file(Path(args.new)), perf_threshold=args.perf_threshold)
    print(render_compare(result))
    return 1 if result.regressed else 0


def cmd_mutants(args: argparse.Namespace) -> int:
    from conformance.mutants.command import run_mutants

    if args.programs:
        from conformance.programs.explore import parse_budget

        parse_budget(args.programs)  # one line before anything starts
        if args.target == "pool":
            raise KitError("--programs: the pool tier has no server for request programs; use --target reference or sglang-cpu")
    return run_mutants(target=args.target, only=args.only, report_dir=Path(args.report_dir), fast=args.fast,
                       programs=args.programs, seed=args.seed, programs_only=args.programs_only, shrink_s=args.shrink_budget)


def cmd_fuzz(args: argparse.Namespace) -> int:
    from conformance.programs.explore import parse_budget

    parse_budget(args.budget)  # one line before anything starts
    extra = [f"--budget={args.budget}", f"--seed={args.seed}"]
    if args.shrink_budget is not None:
        extra.append(f"--shrink-budget={args.shrink_budget}")
    if args.program_db:
        extra.append(f"--program-db={args.program_db}")
    run_args = argparse.Namespace(**{**vars(args), "suite": "programs", "markexpr": None, "keyword": None, "gsm8k_dir": None,
                                     "with_pool": False, "pytest_args": [*extra, *args.pytest_args]})
    return cmd_run(run_args)


def cmd_replay(args: argparse.Namespace) -> int:
    from conformance.programs.replay import replay

    return replay(args)


def cmd_history(args: argparse.Namespace) -> int:
    from conformance.history import run_history

    return run_history(args)


COMMANDS = {"run": cmd_run, "preflight": cmd_preflight, "plan": cmd_plan, "make-twins": cmd_make_twins, "compare": cmd_compare, "mutants": cmd_mutants, "history": cmd_history,
            "fuzz": cmd_fuzz, "replay": cmd_replay}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv) if argv[:1] != ["serve"] else argparse.Namespace(command="serve")
    if not args.command:
        parser.print_help()
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.command == "serve":
            return cmd_serve(argv[1:])
        return COMMANDS[args.command](args)
    except KitError as e:
        print(f"hybrid-conformance: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hybrid-conformance: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `plan | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
