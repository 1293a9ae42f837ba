"""Torch behaviour a CUDA build of torch shows on a machine without a GPU, made CPU-like
inside the ``sglang-cpu`` servers only.

* ``torch.get_device_module()`` with no argument returns ``torch.cuda`` on a CUDA build
  even without a driver; SGLang's Qwen3-Next layers call ``.current_device()`` on it.
  Without a usable CUDA device it now returns ``torch.cpu``.
* ``Tensor.pin_memory()`` needs a CUDA driver; SGLang pins host buffers while preparing
  extra_buffer tracking.  Without a usable CUDA device it returns the tensor itself
  (pinning is a transfer optimisation, not semantics).
* A module SGLang imported before this patch keeps the ``torch.cuda`` it bound then
  (``device_module = get_device_module()`` at import: 0.5.17's ``managers.cache_controller``
  when the server is forked from a pre-imported launcher); such a module-level
  ``device_module`` is rebound to ``torch.cpu``, and SGLang's memoised ``get_device_module``
  (0.5.17: an ``lru_cache`` around ``torch.get_device_module()``) is cleared, else a module
  imported after the patch (0.5.11-0.5.17's ``hybrid_cache_controller``, HiCache) still binds
  the ``torch.cuda`` it cached.
* The factories (``torch.tensor``, ``empty``, ``zeros``, ``ones``, ``full``) with
  ``pin_memory=True`` need the driver too; SGLang 0.5.13 and older pass it unconditionally
  when building the extra_buffer track indices.  Without a usable CUDA device the keyword
  is dropped (the same tensor, unpinned).
"""

from __future__ import annotations

import sys

import torch

_PATCHED: list[str] = []
FACTORIES = ("tensor", "empty", "zeros", "ones", "full")


def _unpinned(factory):  # noqa: ANN001, ANN202
    def call(*args, **kwargs):  # noqa: ANN002, ANN003
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    call.__wrapped__ = factory
    call.__name__ = getattr(factory, "__name__", "factory")
    return call


def install() -> list[str]:
    if torch.cuda.is_available():
        return list(_PATCHED)
    if _PATCHED:  # patched before (a pre-imported launcher): modules imported since may hold torch.cuda
        return [*_PATCHED, *rebind_device_modules()]
    original_get_device_module = torch.get_device_module

    def get_device_module(device=None):  # noqa: ANN001
        if device is None:
            return torch.cpu
        return original_get_device_module(device)

    torch.get_device_module = get_device_module

    def pin_memory(self, *args, **kwargs):  # noqa: ANN001
        return self

    torch.Tensor.pin_memory = pin_memory
    _PATCHED.extend(["torch.get_device_module", "torch.Tensor.pin_memory"])
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
        _PATCHED.append(f"torch.{name}(pin_memory=)")
    _PATCHED.extend(rebind_device_modules())
    return list(_PATCHED)


def rebind_device_modules() -> list[str]:
    """Every imported SGLang module whose ``device_module`` is ``torch.cuda`` (bound before the
    patch) gets ``torch.cpu``, and a memoised ``get_device_module`` (0.5.17's
    ``sglang.srt.utils.common``, an ``lru_cache`` that may hold ``torch.cuda`` from a call before
    the patch) is cleared, so a module imported later binds ``torch.cpu``; the names of those
    rebound or cleared."""
    out = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang."):
            continue
        memo = getattr(module, "get_device_module", None)
        if getattr(memo, "cache_info", None) is not None and memo.cache_info().currsize:
            memo.cache_clear()
            out.append(f"{name}.get_device_module (cache cleared)")
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = torch.cpu
            out.append(f"{name}.device_module")
    return out
