"""The ``plan`` verb: the selected cells and, for targets that launch a server, each exact
command and env as worker 0 would launch it; ``--validate`` runs SGLang's own parser on
every server and PD command (CPU, nothing launched)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from conformance.commands.history import fill_of, parse_budget_arg, parse_releases, CPU_SUITES, SGLANG_CPU
from conformance.commands.night_plan import Costs, Fill, costs_toml, measured_costs, night_of, plan_night
from conformance.commands.selection import selected_cells
from conformance.errors import KitError
from conformance.matrix.cells import Cell
from conformance.session.options import Options, options_from_args
from conformance.sglang_api import probes
from conformance.targets.disagg import not_applicable, pd_spec_for, validate_pd_spec
from conformance.targets.registry import VALIDATE, accepting, target_for
from conformance.targets.serving import spec_for
from conformance.targets.sglang import config_folder, describing_gpus, strip_launcher, validate_server_args


def cmd_plan(args: argparse.Namespace) -> int:
    if args.costs_from:
        print(costs_toml(measured_costs([Path(d) for d in args.costs_from])))
        return 0
    if args.releases:
        return print_night(args)
    options = options_from_args(args)
    target = target_for(options.target)
    cells = selected_cells(options)
    rows = []
    # A plan shows each command as worker 0 would launch it, with enough GPUs for its tp size.
    plan_opts = dataclasses.replace(options, gpus_per_worker=max([options.gpus_per_worker, *(c.model.tp_size for c in cells)]))
    for i, cell in enumerate(cells):
        row: dict[str, Any] = {**cell.describe(), "markers": list(cell.markers)}
        if target.serves_http():
            with describing_gpus():
                spec = spec_for(cell, plan_opts, port=30000 + i)
            row["command"] = spec.argv
            row["env"] = spec.env
        rows.append(row)
    failures = 0
    if args.validate:
        if not target.accepts(VALIDATE):
            raise KitError(f"--validate checks sglang commands: use it with --target {' or '.join(accepting(VALIDATE))}")
        with describing_gpus():
            failures = validate_rows(rows, cells, options)
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


def validate_rows(rows: list[dict[str, Any]], cells: list[Cell], options: Options) -> int:
    """SGLang's own parser on each row's server command and the cell's PD commands; the
    failures (each also one stderr line)."""
    print(f"hybrid-conformance: {probes.probe().summary()}", file=sys.stderr)
    failures = 0
    pd_opts = dataclasses.replace(options, gpus_per_worker=3 * max(c.model.tp_size for c in cells)) if cells else options
    for row, cell in zip(rows, cells):
        config = config_folder(cell, twins=options.twins)
        v = validate_server_args(strip_launcher(row["command"], options.sglang_launcher), cell, config=config)
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


def parse_shards(text: str | None) -> int | None:
    """``--shards``: a positive count, or None (``auto`` or not given: the fewest)."""
    if text in (None, "", "auto"):
        return None
    if not str(text).isdigit() or int(text) < 1:
        raise KitError(f"--shards: expected a positive number or auto, got {text!r}")
    return int(text)


def print_night(args: argparse.Namespace) -> int:
    """``plan --releases ...``: tonight's shards of the history workflow (night_plan.py)."""
    options = options_from_args(args)
    if options.target != SGLANG_CPU:
        raise KitError(f"plan --releases plans the history workflow's {SGLANG_CPU} cells; drop --target {options.target}")
    releases = parse_releases(args.releases)
    costs = Costs.load(Path(args.costs)) if args.costs else Costs.load()
    night = plan_night(releases, selected_cells(options), costs, night=night_of(args.night), tier=options.tier or "standard",
                       budget=parse_budget_arg(args.budget), suites=CPU_SUITES, shards=parse_shards(args.shards),
                       fill=fill_of(args))
    print(json.dumps(night.to_json(), indent=2) if args.format == "json" else night.render())
    return 0
