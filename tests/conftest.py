"""Kit's own unit tests: pytester for plugin tests; a deterministic hypothesis profile so CI
runs are reproducible (no deadlines on a shared 2-core machine, no example database)."""

from hypothesis import settings

pytest_plugins = ["pytester"]

settings.register_profile("kit", deadline=None, derandomize=True, database=None)
settings.load_profile("kit")
