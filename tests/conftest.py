"""Kit's own unit tests: pytester for plugin tests; a deterministic hypothesis profile so CI
runs are reproducible (no deadlines on a shared 2-core machine, no example database)."""

from hypothesis import settings

pytest_plugins = ["pytester"]

settings.register_profile("kit", deadline=None, derandomize=True, database=None)
settings.load_profile("kit")

# The kit's default target is real SGLang on CPU; the kit's own tests drive pytest and the
# CLI in child processes against the reference engine or stand-ins unless a test names a
# target itself (the sglang-cpu target has its own tests and suites).
import os  # noqa: E402

os.environ.setdefault("HYBRID_CONFORMANCE_TARGET", "reference")
