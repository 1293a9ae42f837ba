"""Kit's own unit tests: pytester for plugin tests; a deterministic hypothesis profile so CI
runs are reproducible (no deadlines on a shared 2-core machine, no example database).

Tests that cost minutes of another kind are ``scheduled``: they run in the scheduled workflow
(``ci/workflows/nightly.yml``, job ``scheduled-tests``: ``pytest -m scheduled``), never in the
README's test command. Scheduled are the ``release_range`` tests (each needs venvs of other
SGLang releases from PyPI) and the direct probes of seeded real-SGLang faults (``fault_probe``,
one real SGLang server each) outside the ``fault_probe_fast`` subset CI keeps, and tests marked
``scheduled`` with their reason (minutes of fuzzing on real SGLang, repeated real-SGLang starts
where CI keeps one). A default run
deselects them (deselected, not skipped, and said so in the header); a marker expression that
names ``scheduled``, ``release_range`` or ``fault_probe`` runs them.
"""

import os

import pytest
from hypothesis import settings

pytest_plugins = ["pytester"]

settings.register_profile("kit", deadline=None, derandomize=True, database=None)
settings.load_profile("kit")

# The kit's default target is real SGLang on CPU; the kit's own tests drive pytest and the
# CLI in child processes against the reference engine or stand-ins unless a test names a
# target itself (the sglang-cpu target has its own tests and suites).
os.environ.setdefault("HYBRID_CONFORMANCE_TARGET", "reference")

PROBE = "fault_probe"
SCHEDULED = "scheduled"
#: Markers that make a test scheduled (``fault_probe`` only outside ``fault_probe_fast``).
SCHEDULED_BY = ("release_range", PROBE)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{PROBE}: a direct probe of a seeded real-SGLang fault (starts an sglang-cpu server)")
    config.addinivalue_line("markers", f"{PROBE}_fast: the probes CI runs by default")
    config.addinivalue_line("markers", f"{SCHEDULED}: runs in the scheduled workflow, not in the README's test command (another SGLang release, a slow fault probe)")


def is_scheduled(item: pytest.Item) -> bool:
    """Another release's venv, or a real-SGLang fault probe outside the fast subset."""
    if item.get_closest_marker(SCHEDULED) or item.get_closest_marker("release_range"):
        return True
    return bool(item.get_closest_marker(PROBE)) and not item.get_closest_marker(f"{PROBE}_fast")


def _scheduled_asked(config: pytest.Config) -> bool:
    expr = config.option.markexpr or ""
    return any(name in expr for name in (SCHEDULED, *SCHEDULED_BY))


@pytest.hookimpl(tryfirst=True)  # marks them before pytest's own -m filter reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    scheduled = [i for i in items if is_scheduled(i)]
    for item in scheduled:
        item.add_marker(SCHEDULED)  # so that ``-m scheduled`` selects every one of them
    if _scheduled_asked(config) or not scheduled:
        return
    config.hook.pytest_deselected(items=scheduled)
    items[:] = [i for i in items if i not in set(scheduled)]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [] if _scheduled_asked(config) else [f"scheduled tests (other SGLang releases, slow fault probes) deselected: run them with -m {SCHEDULED}"]
