"""A pool-tier run that ran nothing is not green.

Registered by the plugin with ``--target pool``: it counts the pool tests that ran (passed
or failed) and those skipped (n/a on this release, or sglang unusable).  When every
selected pool test was skipped the session exits 1 with one line saying so: a gate on the
pool tier must have tested SGLang code to be green.
"""

from __future__ import annotations

import pytest


class PoolGate:
    def __init__(self) -> None:
        self.ran = 0
        self.skipped = 0
        self.reasons: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "pool" not in report.keywords:
            return
        if report.failed or (report.when == "call" and report.passed):
            self.ran += 1  # a setup/teardown error failed loudly: not "nothing ran"
        elif report.skipped:  # n/a and kit skips, raised in setup or in the test body
            self.skipped += 1
            if isinstance(report.longrepr, tuple) and len(self.reasons) < 1:
                self.reasons.append(str(report.longrepr[2]).removeprefix("Skipped: "))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput") or exitstatus != 0 or self.ran or not self.skipped:
            return
        line = f"hybrid-conformance: pool tier ran nothing: all {self.skipped} selected tests were skipped"
        line += f" (first: {self.reasons[0]})" if self.reasons else ""
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
