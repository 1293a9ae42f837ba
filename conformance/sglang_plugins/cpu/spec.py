"""How a CPU stand-in declares what it provides to a real SGLang server.

An ops module (``gdn_ops``, ``mamba2_ops``, ...) exports two tuples:

* ``TORCH_OPS``: :class:`TorchOp` records, ops SGLang reaches as ``torch.ops.sgl_kernel.<name>``;
  registered into the ``sgl_kernel`` torch library namespace with their schema.
* ``BINDINGS``: :class:`Binding` records, Python symbols SGLang imports or calls:
  ``how="standin"`` becomes an attribute of the ``sgl_kernel`` stand-in module
  (``target`` = ``"sgl_kernel.mamba.causal_conv1d_fn_cpu"``); ``how="replace"`` is a
  REPLACE hook in SGLang's own hook registry (``target`` = SGLang's dotted path);
  ``how="bind"`` defines a module global that SGLang leaves unbound on CPU (its
  ``if is_cuda(): from ... import ...`` blocks), so the hook registry cannot resolve it;
  ``how="constant"`` likewise defines a module-level constant SGLang imports only off CPU
  (``impl`` is the value; a release that binds it keeps its own); ``how="override"`` sets a
  module-level constant SGLang binds itself, in every home where it is bound (a module that
  imported it by name holds its own copy), for a number sized for a GPU server's host.

A symbol that moved between SGLang releases names its older homes in ``alternates``: a
dotted path (same call signature, same impl) or a ``(path, impl)`` pair (an older helper
with its own signature doing the same step); the install hooks every home that resolves
and requires at least one.  ``required=False`` marks a helper an older release does not have at all (it
computes that step in torch); its absence is reported, never an error.

Nothing here imports SGLang: the records are plain data, read by
``conformance.sglang_plugins.cpu.install`` inside the servers the kit launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# What every stand-in computes its recurrences in, whatever the caller's dtype: results are cast
# back to it (states to the pool's dtype).  The kernels use float32; the stand-ins are the kit's
# reference, and float32 is not exact enough for it (``gdn_ops``' docstring has the measurement).
WORK_DTYPE = torch.float64

HOW = ("standin", "replace", "bind", "constant", "override")


@dataclass(frozen=True)
class TorchOp:
    """``torch.ops.sgl_kernel.<name>``: schema as in sgl-kernel's CPU extension, torch impl."""

    name: str
    schema: str  # e.g. "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor dt_bias, float beta, float threshold) -> Tensor"
    impl: Callable


@dataclass(frozen=True)
class Binding:
    """A Python-level symbol SGLang uses, provided by the kit."""

    target: str
    impl: Callable
    how: str = "replace"
    why: str = ""
    alternates: tuple = ()  # older homes: "dotted.path" or ("dotted.path", impl)
    required: bool = True  # False: a release without it in any home does not call it

    @property
    def homes(self) -> tuple[tuple[str, Callable], ...]:
        """(dotted path, impl) for the current home and every older one."""
        return ((self.target, self.impl), *((a, self.impl) if isinstance(a, str) else tuple(a) for a in self.alternates))

    def __post_init__(self) -> None:
        if self.how not in HOW:
            raise ValueError(f"Binding {self.target}: how={self.how!r}, allowed {HOW}")
