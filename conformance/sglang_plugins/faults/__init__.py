"""Seeded faults of real SGLang, installed through SGLang's hook registry by the
``hybrid_conformance_faults`` general plugin when ``HYBRID_CONFORMANCE_SGLANG_FAULT``
names one.  One module per fault; the catalogue is
``conformance.sglang_plugins.faults.catalogue``, the record format ``.spec``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.sglang_plugins.faults.catalogue import get_fault
from conformance.sglang_plugins.faults.spec import install as install_hooks


def install(name: str, role: str) -> dict[str, Any]:
    """Inside an SGLang process (the general plugin): install fault ``name``."""
    return install_hooks(get_fault(name), role)


def fault_for_launch(cell_env: Mapping[str, str]) -> str | None:
    """The SGLang fault a server launched with ``cell_env`` (over the kit's own environment,
    as ``mutants`` sets it) will load; a name the catalogue does not know is a
    :class:`~conformance.errors.KitError` in one line, before anything is launched."""
    # a cell that sets the switch, even to "" (the programs' cache-off twin), overrides the caller's
    name = (cell_env[SGLANG_FAULT_ENV] if SGLANG_FAULT_ENV in cell_env else os.environ.get(SGLANG_FAULT_ENV)) or None
    if name:
        get_fault(name)
    return name
