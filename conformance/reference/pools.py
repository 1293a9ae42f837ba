"""Fixed-size pools of the reference engine and SGLang's idle leak invariant.

* :class:`MambaSlotPool` — slots 1..N (slot 0 is the reserved dummy target, never handed
  out).  A slot is held by a running request (working slot, ping-pong track slots), by a
  radix cache node (a state snapshot), or by a streaming session.
* :class:`TokenPool` — KV token slots of the attention layers, counted in tokens.
* :class:`RequestPool` — request rows (``--max-running-requests``).

At idle SGLang asserts per pool ``available + evictable + protected + session_held +
uncached == total``; :func:`check_pool` gives the same verdict and message form.
"""

from __future__ import annotations

from dataclasses import dataclass


class MambaSlotPool:
    """Hands out mamba slot ids; like SGLang's allocator it trusts its callers (a double
    free puts an id on the free list twice)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("mamba pool needs at least one slot")
        self.size = size
        self._free: list[int] = list(range(1, size + 1))

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self._free):
            return None
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def free(self, slots) -> None:
        for s in slots:
            if s is None:
                continue
            assert 1 <= s <= self.size, f"slot {s} outside the pool"
            self._free.append(s)

    def clear(self) -> None:
        """Every slot free again (SGLang's ``MambaSlotAllocator.clear`` on ``/flush_cache``)."""
        self._free = list(range(1, self.size + 1))

    def has_duplicates(self) -> bool:
        return len(set(self._free)) != len(self._free)


class TokenPool:
    """KV token slots, counted (the engine never needs individual token indices)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._available = size

    def available(self) -> int:
        return self._available

    def alloc(self, n: int) -> bool:
        if n > self._available:
            return False
        self._available -= n
        return True

    def free(self, n: int) -> None:
        self._available += n

    def clear(self) -> None:
        """Every token free again (SGLang's allocator ``clear`` on ``/flush_cache``)."""
        self._available = self.size


class RequestPool:
    """Request rows; a running request or a streaming session holds one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._available = size

    def available(self) -> int:
        return self._available

    def alloc(self) -> bool:
        if self._available == 0:
            return False
        self._available -= 1
        return True

    def free(self) -> None:
        self._available += 1


@dataclass(frozen=True)
class PoolCheck:
    pool: str
    total: int
    available: int
    evictable: int
    protected: int
    session_held: int
    uncached: int

    @property
    def leak(self) -> bool:
        accounted = self.available + self.evictable + self.protected + self.session_held + self.uncached
        return accounted != self.total

    @property
    def message(self) -> str:
        return (
            f"[{self.pool}] total={self.total}, available={self.available}, evictable={self.evictable}, "
            f"protected={self.protected}, session_held={self.session_held}, uncached={self.uncached}"
        )


def check_pool(pool: str, *, total: int, available: int, evictable: int, protected: int,
               session_held: int, uncached: int = 0) -> PoolCheck:
    """SGLang's idle invariant for one pool (``uncached`` is what running requests hold)."""
    return PoolCheck(pool, total, available, evictable, protected, session_held, uncached)


def leak_message(checks: list[PoolCheck]) -> str | None:
    """SGLang's log line for a failed idle check, or None when every pool balances."""
    bad = [c for c in checks if c.leak]
    if not bad:
        return None
    return "pool memory leak detected! " + "; ".join(c.message for c in checks)
