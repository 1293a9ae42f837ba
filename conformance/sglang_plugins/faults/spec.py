"""How a seeded fault of real SGLang is declared, installed, and seen to fire.

A fault module (one per fault, listed in ``catalogue.FAULT_MODULES``) exports ``FAULT``,
a :class:`conformance.matrix.faults.SeededFault` of layer ``sglang`` made by :func:`sglang_fault`: the
real bug it models, the cells where it can show, and its :class:`Hook` records -- each a
dotted SGLang symbol, a hook type of SGLang's ``HookRegistry``
(``before``/``after``/``around``/``replace``) and the function.  Nothing
here imports SGLang at import time, so ``docs/faults.md`` and the ``mutants`` plans can
read the catalogue anywhere.

Inside a server (scheduler process only) :func:`install` registers the hooks
through SGLang's registry, applies them, and proves each one took effect (the registry
only logs a target it could not patch).  A hook calls :func:`fired` when the fault
actually changes what SGLang does; the first firings are appended to the plugin report
(``status: "fired"``), so a fault the workload never reached is told apart from a fault
the checks missed.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from conformance.matrix.faults import SeededFault
from conformance.sglang_plugins import activation

HOOK_TYPES = ("before", "after", "around", "replace")
#: Firings written to the plugin report: the first ten, then every power of ten.
_REPORTED = set(range(1, 11)) | {100, 1000, 10000}
_FIRED: dict[str, int] = {}


class FaultInstallError(RuntimeError):
    """A fault's hook did not take effect; ``str()`` is one line."""


@dataclass(frozen=True)
class Hook:
    """One hook of a fault: ``target`` is SGLang's dotted symbol, ``how`` a HookType."""

    target: str
    how: str
    fn: Callable

    def __post_init__(self) -> None:
        if self.how not in HOOK_TYPES:
            raise ValueError(f"Hook {self.target}: how={self.how!r}, allowed {HOOK_TYPES}")


def sglang_fault(name: str, description: str, real_bug: str, observable: str, hooks: tuple[Hook, ...], *,
                 strategies: tuple[str, ...] = ("extra_buffer",), families: tuple[str, ...] = ("qwen3-next",),
                 suites: tuple[str, ...] = ("kl",), cell_fault: str = "none", options: tuple[str, ...] = (),
                 cache_variant: str = "radix", seen_by: tuple[str, ...] = (), group: str = "scripted") -> SeededFault:
    """A seeded fault of real SGLang (layer ``sglang``, selected by ``HYBRID_CONFORMANCE_SGLANG_FAULT``).

    ``real_bug``: the SGLang bug (PR) or bug class it stands for; ``observable``: what a
    check sees; ``strategies`` / ``families`` (model families): where it can show (the ``mutants`` plan picks
    the cheapest such cell); ``suites``: the suites whose checks must catch it, first the one
    expected to; ``cell_fault``: the matrix fault of that cell when the fault
    needs one too (e.g. ``lazy_alloc_fail``: SGLang's own ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL``);
    ``options``: the server-option axis values (``axis=value``, ``conformance.matrix.axes``) the fault
    only shows under (its cell sets them); ``cache_variant``: the matrix cache variant of its
    cell (``hicache``: SGLang's host tier); ``seen_by``: the check outside the suites that sees
    it (``conformance.matrix.faults.SEEN_BY``), then scored through that; ``group``: why it was written
    (``conformance.matrix.faults.GROUPS``).  Where it is injected is read off its hooks.
    """
    return SeededFault(
        name, "sglang", description, real_bug, ", ".join(f"{h.target} ({h.how.upper()})" for h in hooks), observable,
        suites=suites, strategies=strategies, families=families, cell_fault=cell_fault, hooks=tuple(hooks), options=tuple(options),
        cache_variant=cache_variant, seen_by=tuple(seen_by), group=group,
    )


def install(fault: SeededFault, role: str) -> dict[str, Any]:
    """Register and apply ``fault``'s hooks in SGLang's scheduler process; prove they took effect."""
    if role != "scheduler":
        return {}
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in fault.hooks:
        HookRegistry.register(h.target, h.fn, HookType(h.how))
    HookRegistry.apply_hooks()
    missing = [h.target for h in fault.hooks if not _takes_effect(h)]
    if missing:
        raise FaultInstallError(f"fault {fault.name}: hook did not take effect on {', '.join(missing)} (renamed in this SGLang release?)")
    return {"fault": fault.name, "hooks": [f"{h.how}:{h.target}" for h in fault.hooks]}


def _takes_effect(hook: Hook) -> bool:
    """True when resolving the target reaches ``hook.fn`` through the registry's wrappers."""
    from conformance.sglang_plugins.cpu.install import _is_ours  # deferred: the CPU stand-ins import torch; only a server with them installed asks

    module_path, _, attr = hook.target.rpartition(".")
    owner = pkgutil.resolve_name(module_path)
    raw = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    raw = getattr(raw, "__func__", raw)  # classmethod / staticmethod wrappers
    return _is_ours(raw, hook.fn)


def fired(name: str, **detail: Any) -> None:
    """Note that fault ``name`` changed SGLang's behaviour (cheap; reported sparsely)."""
    n = _FIRED.get(name, 0) + 1
    _FIRED[name] = n
    if n in _REPORTED:
        activation.write_report(activation.FAULT_PLUGIN, "fired", fault=name, count=n, **detail)


def fire_count(name: str) -> int:
    return _FIRED.get(name, 0)


def plan_arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """Argument ``name`` (position ``index``) of a hooked call, however it was passed."""
    return kwargs[name] if name in kwargs else args[index]


def call_losing_frees(name: str, allocator: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` with the mamba allocator's frees lost; fires ``name``
    (with the slot count) when something was lost."""
    with suppressed_frees(allocator) as frees:
        result = original(*args, **kwargs)
    if frees.lost:
        fired(name, slots=frees.lost)
    return result


def losing_release_frees(name: str, applies: Callable[[Any], bool]) -> Callable:
    """An AROUND hook on SGLang's ``release_kv_cache``: while it releases a request ``applies``
    picks, the mamba allocator's frees are lost (:func:`call_losing_frees`)."""
    def hook(original, req, tree_cache, *args, **kwargs):
        allocator = getattr(tree_cache.req_to_token_pool, "mamba_allocator", None)
        if allocator is None or not applies(req):
            return original(req, tree_cache, *args, **kwargs)
        return call_losing_frees(name, allocator, original, req, tree_cache, *args, **kwargs)
    return hook


class suppressed_frees:
    """``with suppressed_frees(allocator) as lost:`` -- the allocator's ``free`` forgets the
    slots it is given (counted in ``lost``) for the duration of the block."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.lost = 0

    def _forget(self, index: Any) -> None:
        self.lost += int(index.numel())

    def __enter__(self) -> "suppressed_frees":
        self.allocator.free = self._forget
        return self

    def __exit__(self, *exc: object) -> None:
        del self.allocator.free


def zero_device_track_mask(name: str, batch: Any, marks_attr: str) -> None:
    """Clear ``batch.mamba_track_mask`` (the device mask the kernel reads) when the host-side
    ``marks_attr`` marks a row to track, and report the firing: the state is never written
    into the track slot while the scheduler still records and caches it."""
    marks = getattr(batch, marks_attr, None)
    mask = getattr(batch, "mamba_track_mask", None)
    if marks and mask is not None and any(marks):
        mask.zero_()
        fired(name, rows=sum(bool(m) for m in marks))
