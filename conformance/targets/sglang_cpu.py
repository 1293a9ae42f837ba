"""The ``sglang-cpu`` target: SGLang's own server, scheduler, radix cache and pools, on CPU,
serving the tiny twins.

The command is the ``sglang`` target's (``SGLangTarget.server_args`` with the twin folder
as model path) plus the CPU flags that SGLang needs here; what differs is the
environment that switches the kit's code inside SGLang on, through SGLang's extension
points only (``conformance.sglang_plugins``):

* ``SGLANG_PLATFORM`` selects the kit's out-of-tree CPU platform where SGLang's platform
  interface has the extra_buffer answer (a feature probe; older releases run SGLang's
  in-tree CPU device logic and the CPU plugin answers their extra_buffer device gate);
* ``SGLANG_PLUGINS`` loads the kit's general plugins (CPU stand-ins, seeded faults) and
  no other, ``HYBRID_CONFORMANCE_SGLANG_CPU=1`` switches the CPU plugin on;
* ``PYTHONPATH`` starts with the folder holding the ``sgl_kernel`` stand-in;
* ``HYBRID_CONFORMANCE_PLUGIN_REPORT`` is where each plugin proves it ran (set per launch
  by ``conformance.targets.serving``, checked by ``conformance.targets.plugin_proof``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conformance.matrix import axes
from conformance.matrix.cells import Cell
from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.sglang_plugins import activation
from conformance.sglang_plugins.faults import fault_for_launch
from conformance.targets.base import LaunchSpec
from conformance.targets.sglang import SGLangTarget
from conformance.sglang_api import probes
from conformance.sglang_api.validate import config_for_release
from conformance.reference.twins import ensure_twin # the folder, generated on first use; no model load

STANDIN_PATH = Path(__file__).resolve().parents[1] / "sglang_plugins" / "standin"
DTYPES = ("float32", "bfloat16")

#: Pool sizes small enough that a burst of a few requests exercises eviction and
#: refused admissions, and a context long enough for the suites' prompts.
MAX_TOTAL_TOKENS = axes.CPU_MAX_TOTAL_TOKENS
CONTEXT_LENGTH = 4096
#: A budget, not a size (the caps above size the pools): see ``SGLangCpuTarget.server_args``.
MEM_FRACTION_STATIC = "0.9"
MAX_MAMBA_CACHE_SIZE = axes.CPU_MAX_MAMBA_CACHE_SIZE
#: SGLang up to 0.5.13 derives ``grpc_port = port + 10000`` unless SGLANG_GRPC_PORT is set
#: and refuses to start when that exceeds 65535 (a free port is often above 55535).
GRPC_OFFSET = 10000
#: A HiCache cell (``--enable-hierarchical-cache``) on CPU: SGLang's ``direct`` io backend
#: (torch copies; SGLang then takes its ``page_first_direct`` layout), whose copies the CPU
#: plugin binds (``conformance.sglang_plugins.cpu.hicache_ops``), and the host pool sized
#: against the device pool: SGLang's default sizing keeps 10 GiB of host memory free and
#: refuses on a shared machine ("No host memory is left for HiCache ...").
HICACHE_FLAG = "--enable-hierarchical-cache"
HICACHE_CPU_ARGS = ("--hicache-io-backend", "direct", "--hicache-ratio", "2")
#: SGLang's own self-checks every sglang-cpu server runs with (its strict idle leak check
#: kills the scheduler on a leak; the tree sanity check): SGLang's switches, not the kit's,
#: so a bug folder's GPU regression test passes them too (``conformance/commands/bug_artefacts.py``).
SGLANG_SELF_CHECKS = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1"}


def _platform_answers_extra_buffer() -> bool:
    features = probes.probe()
    return features.platform_extra_buffer_answer or not features.importable


#: Triton's switch that runs ``@triton.jit`` kernels in its CPU interpreter (read when a
#: kernel is defined, so the zygote imports under it: it is part of the import env).
TRITON_INTERPRET = "TRITON_INTERPRET"


def _paged_kernels_need_interpreter(cell: Cell) -> bool:
    """Page size above 1 on a release whose paged KV allocator has only its Triton kernels
    (no device question to answer): SGLang's own kernels then run in Triton's interpreter."""
    if cell.page_size <= 1:
        return False
    return probes.probe().paged_alloc_triton_only


@dataclass
class SGLangCpuTarget:
    """Real ``python -m sglang.launch_server`` serving a twin on CPU."""

    dtype: str = "float32"
    python: str = field(default_factory=lambda: sys.executable)
    max_mamba_cache_size: int = MAX_MAMBA_CACHE_SIZE
    name: str = "sglang-cpu"

    def supports(self, cell: Cell) -> str | None:
        if self.name not in cell.targets:
            return f"cache variant {cell.cache_variant.name!r} is served on GPUs only"
        return None

    def server_args(self, cell: Cell, *, port: int) -> list[str]:
        base = SGLangTarget(twins=True, launcher=f"{self.python} -m sglang.launch_server")
        # a release before granite's new layer names serves a copy spelled its way; the probe is
        # the target release's: this process runs in the release's venv, as its server does (self.python)
        folder = config_for_release(ensure_twin(cell.model.twin), probes.probe(), serving=True)
        args = base.server_args(cell, model_path=str(folder), port=port)
        args += [
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--disable-cuda-graph",
            "--dtype", self.dtype,
            "--mamba-ssm-dtype", "float32",
            "--context-length", str(CONTEXT_LENGTH),
            # SGLang's KV budget, every release 0.5.11-0.5.23 (``_profile_available_bytes``):
            # free host RAM after the weights load minus ``(1 - fraction)`` x free RAM before
            # it. On a shared machine other processes take RAM between the two readings, and
            # at 0.3 a drop of 30% refused the start ("Loaded weights leave no GPU memory for
            # the KV cache", 0.5.16+) or shrank the pools below the caps that size them
            # (--max-total-tokens, --max-mamba-cache-size): the budget only has to hold those
            "--mem-fraction-static", MEM_FRACTION_STATIC,
            # an idle scheduler otherwise polls at 100% of a core: on 2 cores, two idle
            # servers would halve the speed of everything else
            "--sleep-on-idle",
        ]
        if HICACHE_FLAG in cell.cache_variant.args:
            args += list(HICACHE_CPU_ARGS)
        # the pools' defaults here, unless the cell's pool axis sets them (conformance.matrix.axes)
        for flag, value in (("--max-total-tokens", MAX_TOTAL_TOKENS), ("--max-mamba-cache-size", self.max_mamba_cache_size)):
            if not axes.sets_flag(cell, flag):
                args += [flag, str(value)]
        return args

    def env(self, cell: Cell) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(STANDIN_PATH), os.environ.get("PYTHONPATH", "")) if p)
        env = {
            "PYTHONPATH": path,
            "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_PLUGINS": ",".join((activation.CPU_PLUGIN, activation.OBSERVE_PLUGIN, activation.FAULT_PLUGIN)),
            activation.CPU_ENV: "1",
            activation.OBSERVE_ENV: "1",
            # the conv state takes the activations as they are: it must be the model's dtype
            "SGLANG_MAMBA_CONV_DTYPE": self.dtype,
            **SGLANG_SELF_CHECKS,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **cell.env,
        }
        if _platform_answers_extra_buffer():
            env["SGLANG_PLATFORM"] = activation.PLATFORM_NAME
        if _paged_kernels_need_interpreter(cell):
            env[TRITON_INTERPRET] = "1"
        fault = fault_for_launch(cell.env)
        if fault:
            env[SGLANG_FAULT_ENV] = fault
        return env

    def expected_plugins(self, cell: Cell) -> tuple[str, ...]:
        """The kit plugins that must prove they ran; the fault plugin whenever a fault reaches
        the server (from the cell's env or from the kit's own, as ``mutants`` sets it)."""
        plugins = [activation.CPU_PLUGIN, activation.OBSERVE_PLUGIN]
        if fault_for_launch(cell.env):
            plugins.append(activation.FAULT_PLUGIN)
        return tuple(plugins)

    def launch_spec(self, cell: Cell, *, port: int, gpus: list[int] | None = None) -> LaunchSpec:
        argv = [self.python, "-m", "sglang.launch_server", *self.server_args(cell, port=port)]
        env = self.env(cell)
        if port + GRPC_OFFSET > 65535:  # SGLang 0.5.13 and older refuse a derived gRPC port above 65535
            env.setdefault("SGLANG_GRPC_PORT", str(port - GRPC_OFFSET))
        return LaunchSpec(
            argv=argv,
            env=env,
            port=port,
            health_path="/health_generate",
            start_timeout_s=600.0,
            plugins=self.expected_plugins(cell),
            preimport=True,
            # on SIGTERM SGLang sleeps 5 s "to let GPU activity settle" before it exits; the kit
            # has judged the server (teardown idle check, log) before it stops it
            term_grace_s=1.0,
        )
