"""Every CPU stand-in the ``sglang-cpu`` target provides, gathered from the ops modules.

Each module listed in :data:`OPS_MODULES` exports ``TORCH_OPS`` and ``BINDINGS``
(``conformance.sglang_plugins.cpu.spec``).  Nothing here imports SGLang.
"""

from __future__ import annotations

import functools
import importlib
import os

from conformance.sglang_plugins.cpu.spec import Binding, TorchOp

OPS_MODULES = (
    "conformance.sglang_plugins.cpu.gdn_ops",       # Qwen3-Next gated delta net
    "conformance.sglang_plugins.cpu.mamba2_ops",    # Nemotron-H, Granite-4.0-H, FalconH1
    "conformance.sglang_plugins.cpu.triton_spots",  # Triton-only helpers on the shared paths
    "conformance.sglang_plugins.cpu.hicache_ops",   # HiCache host tier: host register, direct copies
)


#: Comma list replacing :data:`OPS_MODULES` (developers trying a partial or extra set; the
#: kit's tests use it to show what a server lacking an op says).
MODULES_ENV = "HYBRID_CONFORMANCE_CPU_OPS_MODULES"


@functools.lru_cache(maxsize=1)
def _modules() -> tuple:
    names = [m.strip() for m in os.environ.get(MODULES_ENV, "").split(",") if m.strip()] or list(OPS_MODULES)
    return tuple(importlib.import_module(m) for m in names)


def torch_ops() -> tuple[TorchOp, ...]:
    return tuple(op for m in _modules() for op in getattr(m, "TORCH_OPS", ()))


def bindings(how: str | None = None) -> tuple[Binding, ...]:
    out = tuple(b for m in _modules() for b in getattr(m, "BINDINGS", ()))
    return tuple(b for b in out if how is None or b.how == how)
