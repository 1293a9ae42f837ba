"""Start-up of a real-SGLang-on-CPU cell through the kit's own launcher: a plain launch against
the pre-imported launcher (``conformance.targets.preimport``), in one run.

    python bench/bench_startup.py [--cell qwen3-next-80b-extra_buffer-p1-t256] [--repeats 5]
                                  [--modes plain,preimported,preimported-fork] [--fault cow_skipped]

Each repeat starts the cell's server once per mode, in turn (modes interleaved, so the
machine's load falls on all of them alike), exactly as a run does (``serve_cell``: the cell's
argv and env, the plugin proof), and times, from the call that starts the cell: SGLang's
first log line, its first scheduler line, "Load weight end", "The server is fired up", the
launcher's health check, and the first ``/generate`` answer (one new token).  The zygotes are
started (and their import timed) before the first repeat: they are paid once per run.  With
``--fault`` the seeded SGLang fault is switched on and the bench prints whether its "fired"
record came from each mode's server.  Prints medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.matrix.cells import load_matrix
from conformance.session.options import Options
from conformance.sglang_plugins.activation import read_report
from conformance.targets import preimport
from conformance.targets.serving import serve_cell, spec_for

PHASES = {
    "first_log": None,
    "scheduler": "Init parallel begin",
    "weights": "Load weight end",
    "fired_up": "The server is fired up",
}


def options() -> Options:
    return Options(target="sglang-cpu", models=None, strategies=None, faults=None, page_sizes=None, tier=None, matrix_path=None,
                   report_dir=None, log_dir=None, sglang_launcher="python -m sglang.launch_server", gpus_per_worker=1,
                   twins=False, gsm8k_dir=None)


def phase_times(log: Path, t0: float, offset: int) -> dict[str, float]:
    """When each phase's line reached the log (by the file's lines' arrival: SGLang's own
    timestamps have 1 s resolution, so they are read only for the last line)."""
    out: dict[str, float] = {}
    text = log.read_text(errors="replace")[offset:]
    import datetime as dt

    for name, pattern in PHASES.items():
        for line in text.splitlines():
            if (pattern is None and line.strip()) or (pattern and pattern in line):
                if line.startswith("[") and len(line) > 20:
                    try:
                        out[name] = dt.datetime.strptime(line[1:20], "%Y-%m-%d %H:%M:%S").timestamp() - t0
                    except ValueError:
                        pass
                break
    return out


def one_start(cell, opts: Options, log_dir: Path, fault: str | None) -> dict:
    log = log_dir / f"{cell.id}.log"
    offset = log.stat().st_size if log.exists() else 0
    t0 = time.time()
    with serve_cell(cell, opts, log_dir=log_dir) as ep:
        healthy = time.time() - t0
        ep.client.generate({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        answer = time.time() - t0
        if fault:
            prompt = list(range(5, 130))
            for _ in range(4):
                ep.client.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        report = log.with_suffix(".plugins.jsonl")
        fired = max((int(r.get("count", 0)) for r in read_report(report) if r.get("status") == "fired"), default=0)
        launch = ep.process.launch
    return {"launch": launch, "healthy": healthy, "first_answer": answer, "fired": fired, **phase_times(log, t0, offset)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="qwen3-next-80b-extra_buffer-p1-t256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="plain,preimported,preimported-fork")
    ap.add_argument("--fault", default=None, help="a seeded SGLang fault (docs/faults.md) switched on in every server")
    args = ap.parse_args()
    modes = args.modes.split(",")
    cell = next(c for c in load_matrix().cells if c.id == args.cell)
    opts = options()
    if args.fault:
        os.environ[SGLANG_FAULT_ENV] = args.fault
    log_root = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    spec = spec_for(cell, opts)
    t0 = time.time()
    zygote = preimport.zygote_for(spec.argv[0], spec.env, log_root)
    print(f"zygote: imported SGLang's server stack in {zygote.import_s:.1f}s (wall to ready {time.time() - t0:.1f}s), once per run"
          + (f"; unavailable: {zygote.unavailable}" if zygote.unavailable else ""))
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for m in modes:
            os.environ[preimport.LAUNCH_ENV] = m
            row = one_start(cell, opts, log_root / m, args.fault)
            rows[m].append(row)
            print(f"repeat {r + 1} {m:17} " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    keys = ("first_log", "scheduler", "weights", "fired_up", "healthy", "first_answer")
    print(f"\nmedian of {args.repeats}, seconds from 'start cell' ({cell.id}):")
    print(f"{'mode':17} " + " ".join(f"{k:>12}" for k in keys) + "  fired")
    for m in modes:
        med = {k: statistics.median([x[k] for x in rows[m] if k in x]) if any(k in x for x in rows[m]) else float("nan") for k in keys}
        print(f"{m:17} " + " ".join(f"{med[k]:12.1f}" for k in keys) + f"  {[x['fired'] for x in rows[m]]}")
    base = statistics.median(x["first_answer"] for x in rows[modes[0]])
    for m in modes[1:]:
        print(f"{m} / {modes[0]} first answer: {statistics.median(x['first_answer'] for x in rows[m]) / base:.2f}")
    preimport.stop_all()


if __name__ == "__main__":
    main()
