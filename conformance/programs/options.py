"""pytest options and marker of the request-program suite (loaded by ``conformance.plugin``).

``--budget`` (``ci`` | ``standard`` | ``premerge`` | ``nightly`` | examples ``40`` | seconds ``90s``/``5m``,
per cell; a plain pytest run defaults to ``ci`` on the premerge tier and ``standard`` above
it, ``hybrid-conformance fuzz`` to ``premerge``), ``--seed``, ``--program-db`` (the hypothesis database root; one folder per
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
from conformance.matrix.cells import DEFAULT_TIER
from conformance.session.options import PROGRAM_OPTIONS, add_pytest_options
from conformance.programs.explore import parse_budget
from conformance.programs.explore import default_budget

def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hybrid-conformance programs", "hybrid-conformance: randomized request programs (-m programs)")
    add_pytest_options(g, PROGRAM_OPTIONS)


def pytest_configure(config: pytest.Config) -> None:
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
    budget = opt("--budget") or os.environ.get("HYBRID_CONFORMANCE_BUDGET") or default_budget(opt("--tier") or DEFAULT_TIER)
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
