"""What both pool drivers share: the driver base class, the slots a cache record holds,
and the CPU neutralisation of pinned memory.

:func:`cpu_pin_memory_guard`: SGLang's ``prepare_for_decode``/``prepare_for_extend`` call
``Tensor.pin_memory()`` for buffered strategies, and some releases'
``set_mamba_track_indices_from_reqs`` builds its index with ``torch.tensor(...,
pin_memory=True)``; both need a CUDA driver.  The drivers call those helpers inside the
guard.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from conformance.sglang_api import state_marker
from conformance.sglang_api.pool_driver import StateMismatch


def record_slots(record) -> list[int]:
    """Mamba slots a request's cache record holds: its state slot and the ping-pong track
    slots it holds (an empty lazy slot is flagged in ``mamba_ping_pong_empty`` where the
    release keeps flags, else marked -1 in the buffer)."""
    slots = [] if record.mamba_pool_idx is None else [int(record.mamba_pool_idx)]
    buffer = record.mamba_ping_pong_track_buffer
    if buffer is not None:
        values = [int(v) for v in buffer.tolist()]
        empty = getattr(record, "mamba_ping_pong_empty", None) or [v < 0 for v in values]
        slots += [v for v, e in zip(values, empty) if not e]
    return slots


class PoolDriverBase:
    """What both pool drivers do the same way (see ``conformance.sglang_api.pool_driver``)."""

    def fresh_token(self) -> int:
        self._next_token += 1
        return self._next_token

    def _expect_state(self, slot: int, tokens, where: str) -> None:
        want, got = state_marker.marker_for(tokens), state_marker.read(self.rtp.mamba_pool, slot)
        if got != want:
            raise StateMismatch(f"{where}: mamba slot {slot} holds {got}, expected {want}")

    def evict(self, num_tokens: int = 0, mamba_num: int = 0):
        return self.tree.evict(self.api.EvictParams(num_tokens=num_tokens, mamba_num=mamba_num))

    def evict_all(self):
        return self.evict(self.alloc.size, self.rtp.mamba_pool.size)

    def flush(self) -> None:
        """The scheduler's flush_cache (only legal when idle)."""
        if self.running:
            raise ValueError("flush needs an idle pool")
        self.tree.reset()
        self.rtp.clear()
        self.alloc.clear()
        self.evictions = 0


@contextlib.contextmanager
def cpu_pin_memory_guard() -> Iterator[None]:
    """Make pinning memory (``Tensor.pin_memory()``, ``torch.tensor(..., pin_memory=True)``)
    a no-op when no CUDA driver is present."""
    if torch.cuda.is_available():
        yield
        return
    original, original_tensor = torch.Tensor.pin_memory, torch.tensor

    def tensor(*args, pin_memory=False, **kwargs):  # torch.tensor(..., pin_memory=True) too
        return original_tensor(*args, **kwargs)

    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.tensor = tensor
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original  # type: ignore[method-assign]
        torch.tensor = original_tensor
