"""Proof that the kit's code ran inside a real SGLang server before any result is trusted.

SGLang's ``load_plugins()`` logs a failing plugin and carries on, so a server can be
healthy without the kit's CPU stand-ins or seeded fault.  Each kit plugin writes a
record per process (``conformance.sglang_plugins.activation``); a launch is accepted
only when every expected plugin reported ``ok`` from the scheduler process (the one
that runs the model, the pools and the radix cache) and none reported an error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from conformance.errors import ServerStartError
from conformance.sglang_plugins.activation import read_report


def check_plugins(name: str, report: Path, expected: tuple[str, ...], log_path: Path | None = None) -> list[dict[str, Any]]:
    """The records, or :class:`ServerStartError` naming the plugin that did not prove itself."""
    records = read_report(report)
    where = f"; log {log_path}" if log_path else ""
    for r in records:
        if r.get("status") == "error":
            raise ServerStartError(f"{name}: plugin {r.get('plugin')} failed in the {r.get('role')} process: {r.get('error')}{where}")
    for plugin in expected:
        if not any(r.get("plugin") == plugin and r.get("role") == "scheduler" and r.get("status") == "ok" for r in records):
            roles = sorted({r.get("role", "?") for r in records if r.get("plugin") == plugin}) or ["none"]
            raise ServerStartError(
                f"{name}: plugin {plugin} did not report from SGLang's scheduler process (reported from: {', '.join(roles)}); "
                f"is hybrid-conformance installed in the server's environment (entry points)?{where}"
            )
    return records


#: SGLang's model loaders log a checkpoint weight they have no parameter for and carry on;
#: the parameter then keeps its uninitialised memory and every answer is garbage.
_SKIPPED_WEIGHT = re.compile(r"Parameter (\S+) not found in params_dict")


def check_weights_loaded(name: str, log_path: Path) -> None:
    """:class:`ServerStartError` when SGLang's log says it skipped a weight of the twin's
    checkpoint (the served model is then not the twin, whatever the checks say after)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return
    skipped = sorted(set(_SKIPPED_WEIGHT.findall(text)))
    if skipped:
        raise ServerStartError(
            f"{name}: SGLang did not load {len(skipped)} weight(s) of the checkpoint ({', '.join(skipped[:3])}: "
            f"'not found in params_dict'), so the served model is not the twin; log {log_path}")
