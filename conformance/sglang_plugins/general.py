"""General-plugin entry points (group ``sglang.srt.plugins``), run by SGLang's
``load_plugins()`` in each of its processes.

Both do nothing unless the kit's launcher switched them on
(``conformance.sglang_plugins.activation``); both write one report record per process,
including on failure, and re-raise so SGLang's own log carries the traceback too.
"""

from __future__ import annotations

from conformance.sglang_plugins import activation


def cpu() -> None:
    """CPU enablement: torch stand-ins for Triton-only and AMX-gated spots."""
    if not activation.cpu_enabled():
        return
    role = activation.process_role()
    try:
        from conformance.sglang_plugins.cpu.install import install

        installed = install(role)
    except Exception as e:
        activation.write_report(activation.CPU_PLUGIN, "error", error=f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    activation.write_report(activation.CPU_PLUGIN, "ok", installed=installed)


def observe() -> None:
    """Fresh idle gauges and the idle invariant's terms on ``/metrics``."""
    if not activation.observe_enabled():
        return
    role = activation.process_role()
    try:
        from conformance.sglang_plugins.observe import install

        installed = install(role)
    except Exception as e:
        activation.write_report(activation.OBSERVE_PLUGIN, "error", error=f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    activation.write_report(activation.OBSERVE_PLUGIN, "ok", installed=installed)


def faults() -> None:
    """Seeded faults of real SGLang, one selected by ``HYBRID_CONFORMANCE_SGLANG_FAULT``."""
    name = activation.fault_name()
    if not name:
        return
    role = activation.process_role()
    try:
        from conformance.sglang_plugins.faults import install

        installed = install(name, role)
    except Exception as e:
        activation.write_report(activation.FAULT_PLUGIN, "error", fault=name, error=f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    activation.write_report(activation.FAULT_PLUGIN, "ok", fault=name, installed=installed)
