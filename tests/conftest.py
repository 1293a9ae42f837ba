"""Kit's own unit tests: pytester for plugin tests; a deterministic hypothesis profile so CI
runs are reproducible (no deadlines on a shared 2-core machine, no example database).

Direct probes of seeded real-SGLang faults (``fault_probe``) start one real SGLang server
each: a default run keeps only the ``fault_probe_fast`` subset (deselected, not skipped,
and said so in the header); ``-m fault_probe`` (or any marker expression naming it) runs
them all."""

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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{PROBE}: a direct probe of a seeded real-SGLang fault (starts an sglang-cpu server)")
    config.addinivalue_line("markers", f"{PROBE}_fast: the probes CI runs by default")


def _all_probes_asked(config: pytest.Config) -> bool:
    return PROBE in (config.option.markexpr or "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _all_probes_asked(config):
        return
    slow = [i for i in items if i.get_closest_marker(PROBE) and not i.get_closest_marker(f"{PROBE}_fast")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i not in slow]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [] if _all_probes_asked(config) else [f"real-SGLang fault probes: fast subset only (run all with -m {PROBE})"]
