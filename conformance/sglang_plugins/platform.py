"""Out-of-tree platform entry point (group ``sglang.srt.platforms``).

``activate()`` answers SGLang's platform discovery: the kit's CPU platform when the kit
launched this server for the ``sglang-cpu`` target and the installed SGLang's platform
interface has the Mamba extra_buffer answer the kit's platform gives, else ``None`` (not
this machine's platform), so SGLang's own discovery is unchanged everywhere else.

On a release whose ``SRTPlatform`` has no ``support_mamba_cache_extra_buffer`` (before
0.5.22) SGLang decides the device questions in-tree from ``--device cpu``; the kit then
selects no platform and answers only the extra_buffer device gate through a general
plugin (``conformance.sglang_plugins.device_gate``).
"""

from __future__ import annotations

from conformance.sglang_plugins import activation

PLATFORM_CLASS = "conformance.sglang_plugins.cpu_platform.KitCpuPlatform"
EXTRA_BUFFER_ANSWER = "support_mamba_cache_extra_buffer"


def platform_answers_extra_buffer() -> bool:
    """Whether this SGLang's platform interface lets a platform allow extra_buffer."""
    try:
        from sglang.srt.platforms.interface import SRTPlatform
    except ImportError:
        return False
    return hasattr(SRTPlatform, EXTRA_BUFFER_ANSWER)


def activate() -> str | None:
    if not activation.cpu_enabled() or not platform_answers_extra_buffer():
        return None
    return PLATFORM_CLASS
