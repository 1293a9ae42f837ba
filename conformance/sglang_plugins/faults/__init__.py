"""Seeded faults of real SGLang, installed through SGLang's hook registry by the
``hybrid_conformance_faults`` general plugin when ``HYBRID_CONFORMANCE_SGLANG_FAULT``
names one.  The catalogue is ``conformance.sglang_plugins.faults.catalogue``.
"""

from __future__ import annotations

from typing import Any


def install(name: str, role: str) -> dict[str, Any]:
    from conformance.sglang_plugins.faults.catalogue import get_fault

    fault = get_fault(name)
    return fault.install(role)
