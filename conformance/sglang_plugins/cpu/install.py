"""Install the CPU stand-ins into a running SGLang process (called by the general plugin).

* torch behaviour fixes (``torch_device``) in every SGLang process;
* in the scheduler (the process that runs the model): every ``how="replace"`` binding
  through SGLang's own ``HookRegistry`` (REPLACE), every ``how="bind"`` binding as the
  module global SGLang leaves unbound on CPU -- or, when a release does bind it, as a
  REPLACE hook like the others (a feature probe, not a version check);
* a check that ``sgl_kernel`` is the kit's stand-in;
* in every process, the extra_buffer device gate where the release's platform interface
  has no answer for it (``device_gate``).

Returns what was installed, for the plugin report; raises with one line on anything
that did not take effect, so a server never runs half-enabled.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from conformance.sglang_plugins import activation
from conformance.sglang_plugins.cpu import device_gate, torch_device
from conformance.sglang_plugins.cpu.catalogue import bindings
from conformance.sglang_plugins.cpu import pd_bridge


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
    done["device_gate"] = device_gate.install()  # in every process: the main one parses the server args
    if role != "scheduler":
        return done
    from sglang.srt.plugins.hook_registry import HookRegistry

    replaced, bound, missing_targets, absent = [], [], [], []
    for b in bindings():
        if b.how == "standin":
            continue
        homes = [(h, impl) for h, impl in b.homes if _resolves(h, b.how)]
        if not homes:
            (missing_targets if b.required else absent).append(b.target)
            continue
        for home, impl in homes:
            module_path, _, attr = home.rpartition(".")
            owner = pkgutil.resolve_name(module_path)
            if b.how in ("bind", "constant") and not hasattr(owner, attr) or b.how == "override":
                setattr(owner, attr, impl)
                bound.append(home)
            elif b.how == "constant":
                continue  # the release binds it itself
            else:
                _register_replace(home, impl)
                replaced.append(home)
    if missing_targets:
        import sglang

        raise InstallError(
            f"sglang {getattr(sglang, '__version__', '?')} lacks what the kit's CPU stand-ins hook "
            f"(written for another release?): {', '.join(missing_targets)}"
        )
    HookRegistry.apply_hooks()  # load_plugins() applies again afterwards; already-patched targets are skipped
    missing = [t for t in replaced + bound if not _is_ours(pkgutil.resolve_name(t), _impl_of(t)) and pkgutil.resolve_name(t) != _impl_of(t)]
    if missing:
        raise InstallError(f"stand-ins did not take effect: {', '.join(missing)}")
    done["replaced"], done["bound"], done["absent"] = replaced, bound, absent
    if activation.pd_enabled():
        done["pd_bridges"] = pd_bridge.install()
    return done


def _resolves(home: str, how: str) -> bool:
    """Whether ``home`` exists in this SGLang (a "bind" home needs only its module)."""
    module_path, _, attr = home.rpartition(".")
    try:
        owner = pkgutil.resolve_name(module_path)
    except (ImportError, AttributeError, ValueError):
        return False
    return how in ("bind", "constant") or hasattr(owner, attr)


def _impl_of(target: str) -> Any:
    for b in bindings():
        for home, impl in b.homes:
            if home == target:
                return impl
    raise KeyError(target)


def import_module(name: str) -> Any:
    return importlib.import_module(name)
