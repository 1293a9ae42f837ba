"""General-plugin entry points (group ``sglang.srt.plugins``), run by SGLang's
``load_plugins()`` in each of its processes.

Each does nothing unless the kit's launcher switched it on
(``conformance.sglang_plugins.activation``); each writes one report record per process,
including on failure, and re-raises so SGLang's own log carries the traceback too.
"""

from __future__ import annotations

import importlib
from typing import Any

from conformance.sglang_plugins import activation


def _run(plugin: str, module: str, *args: Any, **report: Any) -> None:
    """Install ``module.install(*args, role)`` and report the outcome for this process."""
    role = activation.process_role()
    try:
        installed = importlib.import_module(module).install(*args, role)
    except Exception as e:
        activation.write_report(plugin, "error", error=f"{type(e).__name__}: {e}".splitlines()[0], **report)
        raise
    activation.write_report(plugin, "ok", installed=installed, **report)


def cpu() -> None:
    """CPU enablement: torch stand-ins for Triton-only and AMX-gated spots."""
    if activation.cpu_enabled():
        _run(activation.CPU_PLUGIN, "conformance.sglang_plugins.cpu.install")


def observe() -> None:
    """Fresh idle gauges and the idle invariant's terms on ``/metrics``."""
    if activation.observe_enabled():
        _run(activation.OBSERVE_PLUGIN, "conformance.sglang_plugins.observe")


def faults() -> None:
    """Seeded faults of real SGLang, one selected by ``HYBRID_CONFORMANCE_SGLANG_FAULT``."""
    name = activation.fault_name()
    if name:
        _run(activation.FAULT_PLUGIN, "conformance.sglang_plugins.faults", name, fault=name)
