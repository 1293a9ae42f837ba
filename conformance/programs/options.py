"""pytest options and marker of the request-program suite (loaded by ``conformance.plugin``).

``--budget`` (``ci`` | ``premerge`` | ``nightly`` | examples ``40`` | seconds ``90s``/``5m``,
per cell; a plain pytest run defaults to ``ci``, ``hybrid-conformance fuzz`` to
``premerge``), ``--seed``, ``--program-db`` (the hypothesis database root; one folder per
target and cell), ``--program-failures`` (where a failing program's replay file goes),
``--shrink-budget`` (seconds of shrinking after a finding).  Precedence: CLI > env
(``HYBRID_CONFORMANCE_BUDGET``, ``HYBRID_CONFORMANCE_SEED``) > defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.errors import KitError

HELP_BUDGET = "request programs per cell: ci (default: 2 programs), premerge (25 s), nightly (600 s), a number of examples (40) or seconds (90s, 5m)"
HELP_SEED = "seed of the request-program generator (default 0): the same seed draws the same programs"
HELP_DB = "hypothesis database root for request programs (default .hypothesis/hybrid-conformance); one folder per target and cell"
HELP_FAILURES = "where a failing program's replay file goes (default <report-dir>/programs, else ./program-failures)"
HELP_SHRINK = "seconds of shrinking after a finding (default: the budget profile's)"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybrid-conformance programs", "hybrid-conformance: randomized request programs (-m programs)")
    g.addoption("--budget", default=None, help=HELP_BUDGET)
    g.addoption("--seed", type=int, default=None, help=HELP_SEED)
    g.addoption("--program-db", default=None, help=HELP_DB)
    g.addoption("--program-failures", default=None, help=HELP_FAILURES)
    g.addoption("--shrink-budget", type=float, default=None, help=HELP_SHRINK)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "programs: randomized request programs with a differential oracle (conformance/programs)")
    from conformance.programs.explore import parse_budget

    budget = config.getoption("--budget") or os.environ.get("HYBRID_CONFORMANCE_BUDGET")
    if budget:
        try:
            parse_budget(budget)
        except KitError as e:
            raise pytest.UsageError(str(e)) from None


@dataclass(frozen=True)
class ProgramOptions:
    budget: str
    seed: int
    db_root: Path | None
    failures_dir: Path
    shrink_s: float | None


def program_options(config: pytest.Config, report_dir: Path | None) -> ProgramOptions:
    opt = config.getoption
    budget = opt("--budget") or os.environ.get("HYBRID_CONFORMANCE_BUDGET") or "ci"
    raw_seed = opt("--seed")
    if raw_seed is None:
        env = os.environ.get("HYBRID_CONFORMANCE_SEED", "0")
        try:
            raw_seed = int(env)
        except ValueError:
            raise KitError(f"HYBRID_CONFORMANCE_SEED: expected an integer, got {env!r}") from None
    db = opt("--program-db") or os.environ.get("HYBRID_CONFORMANCE_PROGRAM_DB") or ".hypothesis/hybrid-conformance"
    failures = opt("--program-failures") or (str(report_dir / "programs") if report_dir else "program-failures")
    return ProgramOptions(budget, int(raw_seed), None if db.lower() == "none" else Path(db), Path(failures), opt("--shrink-budget"))
