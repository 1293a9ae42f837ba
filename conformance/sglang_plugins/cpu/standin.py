"""The machinery behind the ``sgl_kernel`` stand-in module (``standin/sgl_kernel``).

``install("sgl_kernel")`` runs when SGLang first imports ``sgl_kernel`` in a server
process: it registers every :class:`~conformance.sglang_plugins.cpu.spec.TorchOp` of the
ops catalogue into the ``sgl_kernel`` torch library, sets every ``how="standin"``
binding as an attribute of the stand-in (sub)module, and installs an import hook that
creates any other ``sgl_kernel.*`` submodule on demand.  Names nobody provides resolve
to :class:`Placeholder` objects: importing them works (SGLang imports many CUDA symbols
it never calls on CPU); calling one raises ``NotImplementedError`` naming the symbol,
which the kit reports as "an op the plugin lacks".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

from conformance.sglang_plugins.cpu.catalogue import bindings, torch_ops

NAMESPACE = "sgl_kernel"
VERSION = "0.0.0+hybrid-conformance"
_LIBRARIES: list[Any] = []  # keep torch.library.Library objects alive


class Placeholder:
    """A symbol of the real ``sgl_kernel`` that has no CPU stand-in."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"<hybrid-conformance placeholder {self._name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"hybrid-conformance sglang-cpu: {self._name} has no CPU stand-in "
            "(SGLang called a CUDA-only sgl_kernel symbol)"
        )

    def __getattr__(self, attr: str) -> "Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")


def _module_getattr(modname: str):
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{modname}.{name}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates ``sgl_kernel.<anything>`` as a stand-in package on first import."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        if fullname.startswith(NAMESPACE + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module) -> None:  # noqa: ANN001
        for b in bindings("standin"):
            parent, _, attr = b.target.rpartition(".")
            if parent == module.__name__:
                setattr(module, attr, b.impl)


def register_torch_ops(namespace: str = NAMESPACE) -> list[str]:
    """Define and implement every catalogued op under ``torch.ops.<namespace>``."""
    import torch

    lib = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(lib)
    names = []
    for op in torch_ops():
        lib.define(op.schema)
        lib.impl(op.name, op.impl, "CPU")
        names.append(op.name)
    return names


def install(modname: str = NAMESPACE) -> None:
    mod = sys.modules[modname]
    if getattr(mod, "_hybrid_conformance_installed", False):
        return
    mod.__getattr__ = _module_getattr(modname)  # type: ignore[attr-defined]
    mod.__version__ = VERSION  # type: ignore[attr-defined]
    if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFinder())
    for b in bindings("standin"):
        parent, _, attr = b.target.rpartition(".")
        if parent == modname:
            setattr(mod, attr, b.impl)
    mod.registered_ops = register_torch_ops()  # type: ignore[attr-defined]
    mod._hybrid_conformance_installed = True  # type: ignore[attr-defined]
