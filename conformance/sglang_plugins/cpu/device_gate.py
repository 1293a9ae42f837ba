"""The extra_buffer device gate on releases whose platform interface has no answer for it.

From 0.5.22 SGLang asks the platform (``SRTPlatform.support_mamba_cache_extra_buffer``) and
the kit's out-of-tree platform answers.  Before, ``ServerArgs._handle_mamba_radix_cache``
(``_validate_mamba_extra_buffer`` from 0.5.16) asserts ``is_cuda() or is_musa() or is_npu()`` ("Mamba extra_buffer is only supported on
CUDA and MUSA and NPU devices"; 0.5.11 without NPU) whatever the platform.  This AROUND hook, registered
through SGLang's own ``HookRegistry`` in the process that parses the server arguments,
answers that one device question for ``--device cpu`` while the method runs: the gate's
``is_musa`` (the last-resort device of the three, read nowhere else in the method: checked
from the method's source before installing) says yes; every other line of the method and
all of SGLang's Mamba-cache logic run unchanged.  0.5.19-0.5.21 hold the gate in a module
function (``get_platform().is_musa``): there the function's ``get_platform()`` returns the real
platform with ``is_musa`` True during the call.  Nothing is installed when the platform
answers the question itself, or when no gate is found (cells that never meet it still run).
"""

from __future__ import annotations

import inspect
import pkgutil
import re
from typing import Any, Callable
from conformance.sglang_plugins import platform

#: The methods that hold the gate, newest first: 0.5.16-0.5.18 split it out of the
#: strategy handling ("extra_buffer needs CUDA/MUSA/NPU/ROCm (FLA)."); 0.5.11-0.5.15 assert
#: it in the handler ("Mamba extra_buffer is only supported on CUDA and MUSA [and NPU] devices").
#: 0.5.19-0.5.21 ask ``get_platform().is_*`` in a module function (:data:`PLATFORM_TARGETS`).
TARGETS = (
    "sglang.srt.server_args.ServerArgs._validate_mamba_extra_buffer",
    "sglang.srt.server_args.ServerArgs._handle_mamba_radix_cache",
)
TARGET = TARGETS[-1]
GATE = re.compile(r"assert\s*\(?\s*is_cuda\(\)\s+or\s+is_musa\(\)")  # the device assert, whatever devices follow
ANSWERED = "is_musa"  # the name the hook answers while the method runs
#: 0.5.19-0.5.21: ``assert get_platform().is_cuda or get_platform().is_musa or ...`` in a
#: module function; the hook answers ``is_musa`` on the platform that function's module reads.
PLATFORM_TARGETS = ("sglang.srt.arg_groups.mamba_hook.validate_mamba_extra_buffer",)
PLATFORM_GATE = re.compile(r"assert\s*\(?\s*get_platform\(\)\.is_cuda\s+or\s+get_platform\(\)\.is_musa\b")


def gate_location() -> str | None:
    """Where this SGLang gates extra_buffer on the device: ``platform`` (an
    ``SRTPlatform.support_mamba_cache_extra_buffer`` answer), the method of :data:`TARGETS`
    whose assert this hook answers, or None (neither found)."""
    if platform.platform_answers_extra_buffer():
        return "platform"
    for target in TARGETS:
        try:
            source = inspect.getsource(pkgutil.resolve_name(target))
        except (ImportError, AttributeError, ValueError, OSError, TypeError):
            continue
        if GATE.search(source) and source.count(f"{ANSWERED}(") == 1:
            return target
    for target in PLATFORM_TARGETS:
        try:
            source = inspect.getsource(pkgutil.resolve_name(target))
        except (ImportError, AttributeError, ValueError, OSError, TypeError):
            continue
        if PLATFORM_GATE.search(source) and source.count(ANSWERED) == 1:
            return target
    return None


def answer_device(original: Callable, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: for ``--device cpu`` the gate's ``is_musa`` answers yes during the call."""
    if getattr(server_args, "device", None) != "cpu":
        return original(server_args, *args, **kwargs)
    module = inspect.getmodule(original) or pkgutil.resolve_name("sglang.srt.server_args")
    saved = getattr(module, ANSWERED)
    setattr(module, ANSWERED, lambda *a, **k: True)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        setattr(module, ANSWERED, saved)


class _AnsweredPlatform:
    """The real platform object, except that ``is_musa`` says yes."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return True if name == ANSWERED else getattr(self._platform, name)


def answer_platform(original: Callable, view: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook (0.5.19-0.5.21): for ``--device cpu`` the function's module-level
    ``get_platform()`` returns the real platform whose ``is_musa`` says yes, during the call only."""
    if getattr(view, "device", None) != "cpu":
        return original(view, *args, **kwargs)
    module = inspect.getmodule(original)
    saved = module.get_platform
    module.get_platform = lambda: _AnsweredPlatform(saved())
    try:
        return original(view, *args, **kwargs)
    finally:
        module.get_platform = saved


def install() -> str:
    """Register the hook where needed; returns what was done (for the plugin report)."""
    where = gate_location()
    if where == "platform":
        return "platform answers support_mamba_cache_extra_buffer (no hook)"
    if where is None:  # cells that never meet the gate (no_buffer) still run; extra_buffer meets SGLang's own line
        import sglang

        return (f"sglang {getattr(sglang, '__version__', '?')}: no extra_buffer device gate found (neither "
                f"SRTPlatform.support_mamba_cache_extra_buffer nor a known device assert in "
                f"{', '.join(TARGETS + PLATFORM_TARGETS)}): nothing hooked, extra_buffer cells meet SGLang's own assert")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hook = answer_platform if where in PLATFORM_TARGETS else answer_device
    HookRegistry.register(where, hook, HookType.AROUND)
    return f"AROUND {where}: {ANSWERED} answers yes for --device cpu"
