"""The suites: one folder per check, the pytest files that bind workload, target and check per cell."""
