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
* Its early send of a cached prefix (``maybe_send_cached_prefix_chunk``, taken when a
  prefill request hits the prefill server's radix cache) records, under the overlap
  scheduler (``extra_buffer`` cells), a ``torch.cuda.Event`` on the scheduler's forward
  stream so the transfer waits for the previous step's writes: on this CPU "expected stream
  to be a torch.Stream or torch.cuda.Stream object" and the prefill scheduler dies.  On CPU
  the previous step's forward has finished when the scheduler gets there (the CPU stream
  runs each op as it is issued), so there is nothing to wait for: an AROUND hook runs the
  early send with the scheduler's ``enable_overlap`` off for that call only, SGLang's own
  branch without the event; the send itself is unchanged.

:data:`BRIDGES` lists each hook (target, what it bridges) for the plugin report and
``docs/targets.md``.
"""

from __future__ import annotations

from typing import Any

SENDER_INIT = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__"
EARLY_SEND = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk"

#: (SGLang target, the CUDA assumption it bridges)
BRIDGES: tuple[tuple[str, str], ...] = (
    (SENDER_INIT, "prefill._send_kv_chunk pins host indices and records a torch.cuda.Event when the sender supports_host_tensor_indices"),
    (EARLY_SEND, "the early send of a cached prefix records a torch.cuda.Event on the forward stream under the overlap scheduler"),
)


def sender_on_host(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``MooncakeKVSender.__init__``: this sender takes the host-index branch."""
    self.supports_host_tensor_indices = False


def early_send_without_event(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``maybe_send_cached_prefix_chunk``: the same send, without the CUDA completion event."""
    overlap = scheduler.enable_overlap
    scheduler.enable_overlap = False
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.enable_overlap = overlap


def install() -> list[str]:
    """Register the bridges (scheduler process of a PD role only); the targets hooked.
    A target this release lacks is left alone (the step it bridges does not exist there)."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = ((SENDER_INIT, sender_on_host, HookType.AFTER), (EARLY_SEND, early_send_without_event, HookType.AROUND))
    before = {}
    for target, fn, how in hooks:
        owner, attr = target.rsplit(".", 1)
        try:
            before[target] = getattr(pkgutil.resolve_name(owner), attr)
        except (ImportError, AttributeError):
            continue
        HookRegistry.register(target, fn, how)
    HookRegistry.apply_hooks()
    for target, original in before.items():
        owner, attr = target.rsplit(".", 1)
        if getattr(pkgutil.resolve_name(owner), attr) is original:  # SGLang logs a failed hook and carries on
            raise RuntimeError(f"hook on {target} was not applied")
    return list(before)
