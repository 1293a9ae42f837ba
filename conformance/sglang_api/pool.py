"""The pool tier's entry to SGLang: pick the driver the installed release fits, load its symbols.

``load()`` imports the symbols of the chosen driver once (SGLang's import takes ~12 s) and
returns a namespace; it raises :class:`SGLangUnavailable` with a one-line cause when sglang
is missing, fails to import (e.g. an incompatible transformers), or no driver fits.
``driver_class()`` is the driver itself.  Tests call :func:`require`: a skip naming the
cause in an ordinary run, a failure naming it when the pool tier was asked for explicitly
(``--target pool``, ``-m pool`` or ``HYBRID_CONFORMANCE_REQUIRE_SGLANG=1``): never a
silent pass, never a green gate that tested nothing.

The CPU neutralisation lives here too (:func:`cpu_pin_memory_guard`): SGLang's
``prepare_for_decode``/``prepare_for_extend`` call ``Tensor.pin_memory()`` for buffered
strategies, and some releases' ``set_mamba_track_indices_from_reqs`` builds its index with
``torch.tensor(..., pin_memory=True)``; both need a CUDA driver.  The drivers call those
helpers inside the guard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from types import SimpleNamespace
from typing import Iterator

from conformance.sglang_api import probes

REQUIRE_ENV = "HYBRID_CONFORMANCE_REQUIRE_SGLANG"

_API: SimpleNamespace | None = None
_ERROR: str | None = None


class SGLangUnavailable(RuntimeError):
    """sglang cannot be used by the pool tier; ``str()`` is the one-line cause."""


def _import() -> SimpleNamespace:
    features = probes.probe()
    if not features.importable:
        raise SGLangUnavailable(f"sglang {features.version} is not importable ({features.import_error})")
    if features.pool_driver is None:
        raise SGLangUnavailable(f"no pool driver fits: {features.summary()}")
    warnings.filterwarnings("ignore")
    if features.pool_driver == "kv":
        from conformance.sglang_api import pool_kv as module
    else:
        from conformance.sglang_api import pool_legacy as module
    try:
        api = module.import_symbols(features)
    except Exception as e:
        raise SGLangUnavailable(
            f"sglang {features.version} lacks a symbol the {features.pool_driver} pool driver needs ({type(e).__name__}: {e})"
        ) from None
    for name in ("sglang", "sglang.srt", "root"):
        logging.getLogger(None if name == "root" else name).setLevel(logging.ERROR)
    api.features, api.driver = features, module.DRIVER
    return api


def load() -> SimpleNamespace:
    """Import SGLang's symbols once; raise :class:`SGLangUnavailable` naming the cause."""
    global _API, _ERROR
    if _API is not None:
        return _API
    if _ERROR is not None:
        raise SGLangUnavailable(_ERROR)
    try:
        _API = _import()
    except SGLangUnavailable as e:
        _ERROR = str(e)
        raise
    return _API


def driver_class():
    return load().driver


def explicitly_required(config=None) -> bool:
    """Whether the user asked for the pool tier itself (then unusable sglang is a failure)."""
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        return True
    if config is None:
        return False
    markexpr = str(getattr(config.option, "markexpr", "") or "")
    target = getattr(config.option, "target", None)
    return target == "pool" or "pool" in markexpr.replace("(", " ").replace(")", " ").split()


def require(config=None) -> SimpleNamespace:
    """``load()`` for tests: skip with the cause, or fail with it when explicitly asked for."""
    import pytest

    try:
        return load()
    except SGLangUnavailable as e:
        if explicitly_required(config):
            pytest.fail(f"pool tier asked for but cannot run: {e}", pytrace=False)
        pytest.skip(f"pool tier needs sglang: {e}")


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
    """What both pool drivers do the same way (see ``conformance.targets.pool.driver``)."""

    def fresh_token(self) -> int:
        self._next_token += 1
        return self._next_token

    def _expect_state(self, slot: int, tokens, where: str) -> None:
        from conformance.targets.pool import state_marker
        from conformance.targets.pool.driver import StateMismatch

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


def version() -> str:
    return probes.probe().version


@contextlib.contextmanager
def cpu_pin_memory_guard() -> Iterator[None]:
    """Make pinning memory (``Tensor.pin_memory()``, ``torch.tensor(..., pin_memory=True)``)
    a no-op when no CUDA driver is present."""
    import torch

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
