"""The pool tier's entry to SGLang: pick the driver the installed release fits, load its symbols.

``load()`` imports the symbols of the chosen driver once (SGLang's import takes ~12 s) and
returns a namespace; it raises :class:`SGLangUnavailable` with a one-line cause when sglang
is missing, fails to import (e.g. an incompatible transformers), or no driver fits.
``driver_class()`` is the driver itself.  Tests call :func:`require`: a skip naming the
cause in an ordinary run, a failure naming it when the pool tier was asked for explicitly
(``--target pool``, ``-m pool`` or ``HYBRID_CONFORMANCE_REQUIRE_SGLANG=1``): never a
silent pass, never a green gate that tested nothing.

The drivers (``pool_kv``, ``pool_legacy``) get the loaded namespace when built
(``api.driver(key, sizes, api=api)``); what they share is in ``pool_base``, the contract
they offer in ``pool_driver``.
"""

from __future__ import annotations

import logging
import os
import warnings
from types import SimpleNamespace

from conformance.sglang_api import pool_kv, pool_legacy, probes

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
    module = pool_kv if features.pool_driver == "kv" else pool_legacy
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


def explicitly_required(asked: bool = False) -> bool:
    """Whether the user asked for the pool tier itself (then unusable sglang is a failure):
    ``asked`` is the caller's answer from the run's options (``suites.pool_tier_asked``), or
    the environment says so."""
    return asked or os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def require(asked: bool = False) -> SimpleNamespace:
    """``load()`` for tests: skip with the cause, or fail with it when explicitly asked for."""
    import pytest

    try:
        return load()
    except SGLangUnavailable as e:
        if explicitly_required(asked):
            pytest.fail(f"pool tier asked for but cannot run: {e}", pytrace=False)
        pytest.skip(f"pool tier needs sglang: {e}")


def version() -> str:
    return probes.probe().version
