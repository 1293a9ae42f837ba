"""``PoolHarness(key, sizes)``: the pool driver that fits the installed SGLang.

The feature probe (``conformance.sglang_api.probes``) picks the driver: the ``req.kv``
lifecycle driver (``conformance.sglang_api.pool_kv``) or the older-lifecycle driver
(``conformance.sglang_api.pool_legacy``).  The driver contract and its shared types live
in ``conformance.sglang_api.pool_driver``.
"""

from __future__ import annotations

from conformance.sglang_api import pool
from conformance.sglang_api.pool_driver import (  # noqa: F401  (re-exported: the pool tier's names)
    FULL_LAYERS,
    MAMBA_LAYERS,
    NotApplicable,
    PoolExhausted,
    PoolSizes,
    Running,
    StateMismatch,
)
from conformance.sglang_api.pool_runtime import PoolKey


def PoolHarness(key: PoolKey, sizes: PoolSizes = PoolSizes()):  # noqa: N802  (a factory named like the class it returns)
    """A fresh driver for ``key``; raises :class:`NotApplicable` when the release cannot run it."""
    api = pool.load()
    return api.driver(key, sizes, api=api)
