"""Bind programs to running servers: the cache-off twin, the oracle's numbers, restarts.

The cold side of the differential oracle is a **cache-off twin**: a second server for
the same model (and dtype) with the radix cache disabled (``--disable-radix-cache``, on
SGLang and on the reference server), no seeded fault and the simplest strategy.  Every
answer of the server under test is re-computed there as one teacher-forced prefill.
Why a twin and not a flush of the same server: programs must run long stretches without
a flush (a flush rebuilds SGLang's free lists and hides leaks); why not the reference
engine in-process: on ``sglang-cpu`` it would compare two implementations, not SGLang's
cache against SGLang without it.  The twin only depends on the model, so one serves
every cell of that model in a session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterator

from conformance.matrix import axes
from conformance.checks.differential import Tolerance
from conformance.checks.hit_bounds import StrategyGrid
from conformance.matrix.faults import FAULT_SWITCHES
from conformance.matrix.cells import CacheVariant, Cell, MatrixFault
from conformance.programs.runner import ProgramTarget
from conformance.programs.strategies import GenSpec
from conformance.report.phases import timed
from conformance.matrix.strategy import BASELINE, STRATEGIES
from conformance.session.suite_support import exact_mode, idle_deadline, lookahead, vocab_size
from conformance.sglang_contract.metric_names import KIT_KV_TOTAL, KIT_MAMBA_TOTAL, MAMBA_TOTAL_TOKENS, MAX_TOTAL_NUM_TOKENS
from conformance.targets.base import Endpoint
from conformance.targets.serving import not_serving
from conformance.reference import twins
from conformance.targets.serving import serve_cell
from conformance.programs.evidence import refuse_missing, request_log
from conformance.programs.noise import calibrate
from conformance.programs.oracle import Limits

COLD_VARIANT = CacheVariant("cold", "radix cache disabled: the programs' cache-off twin", ("--disable-radix-cache",))
NO_BUFFER = dataclasses.replace(STRATEGIES[BASELINE], description="cache-off twin")


def cold_cell(cell: Cell) -> Cell:
    """The cache-off twin of ``cell``: same model and server options (those of the radix
    tree dropped), no_buffer, page 1, no fault, cache off."""
    clean = MatrixFault("none", "the cache-off twin runs no fault", env=tuple((k, "") for k in FAULT_SWITCHES))
    options = tuple((axis, value) for axis, value in cell.options if not axes.AXES[axis].tree_only)
    return dataclasses.replace(cell, strategy=NO_BUFFER, page_size=1, track_interval=256, fault=clean, cache_variant=COLD_VARIANT,
                               options=options)


def prepare_twin(cell: Cell) -> None:
    """Generate the twin and import its model class in this thread: transformers' lazy
    module import is not safe when two threads (the cell's server and its twin's) race
    through it."""
    import transformers

    spec = twins.load_spec(cell.model.twin)
    twins.ensure_twin(cell.model.twin)
    getattr(transformers, spec.architecture)


@contextlib.contextmanager
def serve_cold(cell: Cell, options: Any, log_dir: Path) -> Iterator[Endpoint]:
    with timed(serve_cell(cold_cell(cell), options, log_dir=log_dir), "cold twin") as ep:
        yield ep


def grid_for(ep: Endpoint) -> StrategyGrid:
    cell, g = ep.cell, ep.cell.grid
    return StrategyGrid(
        g.chunk, g.page_size, g.track_interval, strategy=cell.strategy,
        lazy_alloc_fail=cell.fault.name == "lazy_alloc_fail", lookahead=lookahead(ep),
    )


def path_cap(info: dict, cell: Cell) -> int | None:
    """The server's cap on Mamba states per tree path (SGLang's ``mamba_max_states_per_path``
    in its server info; the cell's ``path_cap`` axis where the info lacks it), None: no cap."""
    cap = info.get("mamba_max_states_per_path")
    if cap is None:
        chosen = axes.value_of(cell, "path_cap").name
        cap = None if chosen == "off" else chosen
    return int(cap) if cap is not None and int(cap) > 0 else None


def target_for(ep: Endpoint, cold: Endpoint) -> ProgramTarget:
    info = ep.info or ep.client.server_info()
    metrics = ep.client.metrics()
    refuse_missing(metrics, target=ep.target, attempts=[_later(ep.client)] * 25)
    requests = request_log(ep.log_path, target=ep.target)
    kv_total = metrics.get(KIT_KV_TOTAL) or metrics.get(MAX_TOTAL_NUM_TOKENS) or info.get("max_total_num_tokens")
    context = info.get("context_length") or info.get("max_total_num_tokens") or kv_total or 4096
    limits = Limits(
        context_len=int(context),
        max_input=int(info["max_req_input_len"]) if info.get("max_req_input_len") else None,
        kv_total=float(kv_total) if kv_total else None,
        mamba_total=metrics.get(KIT_MAMBA_TOTAL) or metrics.get(MAMBA_TOTAL_TOKENS),
        prefill_budget=int(info["chunked_prefill_size"]) if (info.get("chunked_prefill_size") or 0) > 0 else None,
        path_cap=path_cap(info, ep.cell),
    )
    exact = exact_mode(ep)
    tol, noise = (Tolerance.for_mode(True), {}) if exact else calibrate(cold.client, vocab_size=vocab_size(ep))
    return ProgramTarget(
        client=ep.client, cold=cold.client, grid=grid_for(ep), limits=limits, tol=tol, noise=noise, exact=exact,
        idle_deadline_s=idle_deadline(ep), log_text=ep.log_text if ep.process else None,
        alive=ep.process.exit_reason if ep.process else None, info=info, requests=requests,
        mixed=axes.enabled(ep.cell, axes.MIXED_BATCHES),
    )


def _later(client: Any) -> Any:
    def scrape() -> dict:
        time.sleep(0.2)
        return client.metrics()
    return scrape


def gen_spec(ep: Endpoint, target: ProgramTarget) -> GenSpec:
    g = target.grid
    return GenSpec(
        vocab_size=vocab_size(ep), chunk=g.chunk, checkpoint_grid=g.checkpoint_grid, track_grid=g.track_grid,
        page_size=g.page_size, context_len=target.limits.context_len,
        streaming_sessions=axes.enabled(ep.cell, axes.STREAMING_SESSIONS),
        reasoning_requests=axes.enabled(ep.cell, axes.REASONING_REQUESTS),
        pressure_weight=pressure_weight(ep.cell, g.page_size),
        kv_total=int(target.limits.kv_total or 0) if axes.coverage_required(ep.cell) else 0,
    )


#: ``off`` switches the pressure shapes off (``conformance/programs/strategies.py``): what a
#: seeded fault on a pressure path is missed without.
PRESSURE_SHAPES_ENV = "HYBRID_CONFORMANCE_PRESSURE_SHAPES"


def pressure_weight(cell: Any, page_size: int) -> int:
    """How often a cell's programs draw a pressure shape: 4 on a small-pool or page-size > 1
    cell, 1 elsewhere, 0 with ``HYBRID_CONFORMANCE_PRESSURE_SHAPES=off``."""
    if os.environ.get(PRESSURE_SHAPES_ENV, "on").strip().lower() == "off":
        return 0
    return 4 if axes.coverage_required(cell) or page_size > 1 else 1


def restart_if_dead(ep: Endpoint) -> bool:
    """Restart the cell's server when it died or stopped serving (True when restarted)."""

    if ep.process is None or not_serving(ep.client, ep.process.exit_reason) is None:
        return False
    ep.process.stop()
    ep.process.start()
    return True
