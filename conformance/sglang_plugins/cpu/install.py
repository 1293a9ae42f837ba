"""Install the CPU stand-ins into a running SGLang process (called by the general plugin).

* torch behaviour fixes (``torch_device``) in every SGLang process;
* in the scheduler (the process that runs the model): every ``how="replace"`` binding
  through SGLang's own ``HookRegistry`` (REPLACE), every ``how="bind"`` binding as the
  module global SGLang leaves unbound on CPU -- or, when a release does bind it, as a
  REPLACE hook like the others (a feature probe, not a version check);
* a check that ``sgl_kernel`` is the kit's stand-in.

Returns what was installed, for the plugin report; raises with one line on anything
that did not take effect, so a server never runs half-enabled.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from conformance.sglang_plugins import activation
from conformance.sglang_plugins.cpu import torch_device
from conformance.sglang_plugins.cpu.catalogue import bindings


class InstallError(RuntimeError):
    """A stand-in could not be installed; ``str()`` is one line."""


def _register_replace(target: str, impl: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, impl, HookType.REPLACE)


def _is_ours(obj: Any, impl: Any) -> bool:
    seen = 0
    while obj is not None and seen < 8:
        if obj is impl:
            return True
        # a REPLACE wrapper calls the hook captured in its closure
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is impl:
                    return True
            except ValueError:
                pass
        obj = getattr(obj, "__wrapped__", None) if getattr(obj, "__wrapped__", None) is not obj else None
        seen += 1
    return False


def install(role: str) -> dict[str, Any]:
    done: dict[str, Any] = {"torch": torch_device.install()}
    import sgl_kernel  # the stand-in, put on the path by the kit's launcher

    if not getattr(sgl_kernel, "_hybrid_conformance_installed", False):
        raise InstallError(f"sgl_kernel at {getattr(sgl_kernel, '__file__', '?')} is not the kit's stand-in")
    done["torch_ops"] = list(getattr(sgl_kernel, "registered_ops", []))
    if role != "scheduler":
        return done
    from sglang.srt.plugins.hook_registry import HookRegistry

    replaced, bound, missing_targets = [], [], []
    for b in bindings():
        if b.how == "standin":
            continue
        module_path, _, attr = b.target.rpartition(".")
        try:
            owner = pkgutil.resolve_name(module_path)
        except (ImportError, AttributeError, ValueError):
            missing_targets.append(b.target)
            continue
        if b.how == "replace" and not hasattr(owner, attr):
            missing_targets.append(b.target)
            continue
        if b.how == "bind" and not hasattr(owner, attr):
            setattr(owner, attr, b.impl)
            bound.append(b.target)
        else:
            _register_replace(b.target, b.impl)
            replaced.append(b.target)
    if missing_targets:
        import sglang

        raise InstallError(
            f"sglang {getattr(sglang, '__version__', '?')} lacks what the kit's CPU stand-ins hook "
            f"(written for another release?): {', '.join(missing_targets)}"
        )
    HookRegistry.apply_hooks()  # load_plugins() applies again afterwards; already-patched targets are skipped
    missing = [t for t in replaced + bound if not _is_ours(pkgutil.resolve_name(t), _impl_of(t))]
    if missing:
        raise InstallError(f"stand-ins did not take effect: {', '.join(missing)}")
    done["replaced"], done["bound"] = replaced, bound
    if activation.pd_enabled():
        from conformance.sglang_plugins.cpu import pd_bridge

        done["pd_bridges"] = pd_bridge.install()
    return done


def _impl_of(target: str) -> Any:
    for b in bindings():
        if b.target == target:
            return b.impl
    raise KeyError(target)


def import_module(name: str) -> Any:
    return importlib.import_module(name)
