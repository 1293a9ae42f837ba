"""What SGLang's PD disaggregation code assumes about CUDA, bridged for the ``sglang-cpu``
servers (installed by the CPU plugin in the scheduler process, through SGLang's hook
registry, in the servers the kit starts as PD roles: ``activation.pd_enabled()``).

* SGLang 0.5.23's prefill side (``disaggregation/prefill.py``, ``_send_kv_chunk``) asks its
  sender ``supports_host_tensor_indices``; Mooncake's sender answers ``True`` and the
  prefill then copies the page indices into a ``pin_memory=True`` host tensor and records
  a ``torch.cuda.Event`` on ``torch.cuda.current_stream()``: "Found no NVIDIA driver" on
  this CPU.  An AFTER hook on ``MooncakeKVSender.__init__`` makes each sender answer
  ``False``, so the prefill takes SGLang's own other branch (``kv_to_page_indices`` on the
  indices it already holds on the host).  The bytes moved, and by whom, stay SGLang's and
  Mooncake's (TCP transport, ``MC_FORCE_TCP=1``).

:data:`BRIDGES` lists each hook (target, what it bridges) for the plugin report and
``docs/targets.md``.
"""

from __future__ import annotations

from typing import Any

SENDER_INIT = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__"

#: (SGLang target, the CUDA assumption it bridges)
BRIDGES: tuple[tuple[str, str], ...] = (
    (SENDER_INIT, "prefill._send_kv_chunk pins host indices and records a torch.cuda.Event when the sender supports_host_tensor_indices"),
)


def sender_on_host(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``MooncakeKVSender.__init__``: this sender takes the host-index branch."""
    self.supports_host_tensor_indices = False


def install() -> list[str]:
    """Register the bridges (scheduler process of a PD role only); the targets hooked."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    owner, attr = SENDER_INIT.rsplit(".", 1)
    before = getattr(pkgutil.resolve_name(owner), attr)
    HookRegistry.register(SENDER_INIT, sender_on_host, HookType.AFTER)
    HookRegistry.apply_hooks()
    if getattr(pkgutil.resolve_name(owner), attr) is before:  # SGLang logs a failed hook and carries on
        raise RuntimeError(f"hook on {SENDER_INIT} was not applied")
    return [target for target, _why in BRIDGES]
