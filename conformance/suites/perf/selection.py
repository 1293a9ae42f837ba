"""When the perf suite runs: on the real targets (``sglang-cpu``, ``sglang``) in the
standard and nightly tiers; on the kit's reference engine, or in the premerge tier, only
when asked for (``--suite perf``, ``-m perf``, or its path).  Elsewhere its tests are
deselected (reported by pytest as deselected, never skipped as passes).  Loaded as a
pytest plugin by ``conformance.plugin``; ``hybrid-conformance run`` picks its default
suites by the same rule."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from conformance.matrix.cells import DEFAULT_TIER
from conformance.session.run_state import run_state
from conformance.targets.registry import PERF_TARGETS, target_for

SUITE_DIR = Path(__file__).resolve().parent


def asked_for(markexpr: str | None, args: Iterable[str]) -> bool:
    """True when a marker expression names ``perf`` or a path given is inside this suite."""
    if markexpr and "perf" in markexpr.replace("(", " ").replace(")", " ").split():
        return True
    for arg in args:
        try:
            path = Path(str(arg).split("::", 1)[0]).resolve()
        except OSError:
            continue
        if path == SUITE_DIR or SUITE_DIR in path.parents:
            return True
    return False


def not_selected(target: str, tier: str, *, asked: bool) -> str | None:
    """Why perf tests are left out of a run (None: they run)."""
    if asked:
        return None
    if not target_for(target).runs_by_default("perf"):
        return f"perf runs on the real targets ({', '.join(PERF_TARGETS)}); on {target} only when asked for (--suite perf)"
    if tier == "premerge":
        return "perf runs in the standard and nightly tiers; in premerge only when asked for (--suite perf)"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    """Deselect (never skip) the perf tests of a run they are not selected for."""
    marked = [item for item in items if item.get_closest_marker("perf") is not None]
    if not marked:
        return
    options = run_state(config).options
    if not_selected(options.target, options.tier or DEFAULT_TIER, asked=asked_for(config.option.markexpr, config.args)) is None:
        return
    config.hook.pytest_deselected(items=marked)
    items[:] = [item for item in items if item.get_closest_marker("perf") is None]
