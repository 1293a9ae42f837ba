"""Stand-in servers for the launcher and plugin tests (real child processes)."""
