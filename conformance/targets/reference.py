"""The embedded reference target: the kit's own CPU server for a cell's tiny twin.

The engine lives in ``conformance/reference/``; this module only builds the
command that starts it as a child process (the same as ``hybrid-conformance serve``).
"""

from __future__ import annotations

import os
import sys

from conformance.matrix.faults import FAULT_ENV  # noqa: F401 - the fault env var the reference engine reads
from conformance.matrix.cells import Cell
from conformance.targets.base import LaunchSpec

#: Advanced/testing: run another module or script as the reference server.
SERVER_ENV = "HYBRID_CONFORMANCE_REFERENCE_SERVER"
#: Set to 1 to start every reference server with a fresh interpreter instead of the forkserver.
NO_FORKSERVER_ENV = "HYBRID_CONFORMANCE_NO_FORKSERVER"
#: The Python the reference server runs with (default: this one).  ``history`` sets it to its own
#: interpreter inside a release's venv whose pins changed torch or transformers: the engine is the
#: kit's, defined on the kit's transformers, not on the release's pin (transformers 5.6-5.12 give
#: split extends that differ from one extend); a venv on the kit's own libraries needs no other.
PYTHON_ENV = "HYBRID_CONFORMANCE_REFERENCE_PYTHON"
#: Imported once by the forkserver, so each cell's server starts in well under a second.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.nemotron_h.modeling_nemotron_h",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "transformers.models.falcon_h1.modeling_falcon_h1",
    "fastapi",
    "uvicorn",
    "conformance.reference.server",
    "conformance.reference.routes",
    "conformance.reference.model",
)


class ReferenceTarget:
    name = "reference"

    #: 66 mamba slots: one is held by the leaks burst's locked prefix, and 65 is a multiple of
    #: neither 3 (extra_buffer) nor 2 (extra_buffer_lazy) slots per request, so a burst that
    #: saturates the pool leaves one or two slots free and the next matched admission fails
    #: after taking its working slot -- the "scheduling a matched request fails" path.
    DEFAULT_MAMBA_SLOTS = 66

    def __init__(self, *, python: str | None = None, max_mamba_slots: int | None = DEFAULT_MAMBA_SLOTS, forkserver: bool = True) -> None:
        self.python = python or os.environ.get(PYTHON_ENV) or sys.executable
        self.max_mamba_slots = max_mamba_slots
        # the forkserver forks this interpreter, so another python starts fresh
        self.forkserver = (forkserver and os.environ.get(NO_FORKSERVER_ENV, "") in ("", "0")
                           and self.python == sys.executable)

    def supports(self, cell: Cell) -> str | None:
        if self.name not in cell.targets:
            if cell.cache_variant.name != "radix":
                return f"cache variant {cell.cache_variant.name!r} is served by real SGLang only"
            where = f"the matrix runs it on {', '.join(cell.targets)} only"
            if cell.options:
                return f"its server options ({', '.join(f'{a}={v}' for a, v in cell.options)}) are real SGLang's; {where}"
            return where
        return None

    def launch_spec(self, cell: Cell, *, port: int, gpus: list[int] | None = None) -> LaunchSpec:
        server = os.environ.get(SERVER_ENV, "conformance.reference.server")
        entry = [server] if server.endswith(".py") else ["-m", server]
        argv = [
            self.python, *entry,
            "--model", cell.model.twin,
            "--strategy", cell.strategy.name,
            "--page-size", str(cell.page_size),
            "--track-interval", str(cell.track_interval),
            "--host", "127.0.0.1",
            "--port", str(port),
        ]
        if self.max_mamba_slots:
            argv += ["--max-mamba-slots", str(self.max_mamba_slots)]
        argv += list(cell.cache_variant.args)  # e.g. --disable-radix-cache (the programs' cold twin)
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **cell.env}
        # 300 s: a history run's agreement check on a loaded 2-core machine saw one reference
        # server print nothing in 120 s (two release halves in parallel, 2026-11-27)
        spec = LaunchSpec(argv=argv, env=env, port=port, start_timeout_s=300.0)
        if self.forkserver and server == "conformance.reference.server":
            spec.entry = "conformance.reference.server:main"
            spec.entry_argv = argv[3:]
            spec.preload = PRELOAD
        return spec
