"""Out-of-tree platform entry point (group ``sglang.srt.platforms``).

``activate()`` answers SGLang's platform discovery: the kit's CPU platform when the kit
launched this server for the ``sglang-cpu`` target, else ``None`` (not this machine's
platform), so SGLang's own discovery is unchanged everywhere else.
"""

from __future__ import annotations

from conformance.sglang_plugins import activation

PLATFORM_CLASS = "conformance.sglang_plugins.cpu_platform.KitCpuPlatform"


def activate() -> str | None:
    return PLATFORM_CLASS if activation.cpu_enabled() else None
