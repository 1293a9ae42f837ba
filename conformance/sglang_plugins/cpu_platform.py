"""The kit's out-of-tree CPU platform for SGLang (selected via ``SGLANG_PLATFORM``).

SGLang's in-tree CPU platform answers "no" to Mamba cache snapshots
(``extra_buffer``); this one is SGLang's CPU device layer with the answers the kit's
torch stand-ins make true: Mamba state snapshots supported, no Triton, no pinned
memory, no graph capture, the torch-native attention backend.
"""

from __future__ import annotations

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class KitCpuPlatform(CpuDeviceMixin, SRTPlatform):
    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def support_mamba_cache_extra_buffer(self) -> bool:
        return True

    def is_pin_memory_available(self, device=None) -> bool:  # noqa: ANN001
        return False

    def get_dispatch_key_name(self) -> str:
        return "cpu"
