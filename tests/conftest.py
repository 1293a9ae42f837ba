"""Kit's own unit tests: pytester for plugin tests."""

pytest_plugins = ["pytester"]
