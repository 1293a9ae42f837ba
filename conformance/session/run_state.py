"""The pytest run's typed state, kept in ``config.stash``: the resolved options, the matrix,
the outcomes gathered so far. Read by the plugin, its report hooks and the suites' own
plugins (perf selection) alike, so none of them imports another to reach it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conformance.errors import KitError
from conformance.matrix.cells import Matrix, load_matrix
from conformance.session.options import Options
from conformance.report.outcomes import Outcomes
from conformance.report.phases import PhaseTotals


@dataclass
class RunState:
    """Typed run state kept in ``config.stash``."""

    options: Options
    started: float = field(default_factory=time.time)
    matrix: Matrix | None = None
    outcomes: Outcomes = field(default_factory=Outcomes)
    not_applicable: dict[str, str] = field(default_factory=dict)
    exitstatus: int | None = None
    preflight: list[dict[str, Any]] | None = None
    preflight_failures: dict[str, str] = field(default_factory=dict)  # nodeid -> the need it lacks
    phases: PhaseTotals = field(default_factory=PhaseTotals)
    collected_at: float | None = None  # when the controller learnt the collected tests

    def get_matrix(self) -> Matrix:
        if self.matrix is None:
            try:
                self.matrix = load_matrix(self.options.matrix_path)
            except KitError as e:
                raise pytest.UsageError(str(e)) from None
        return self.matrix


RUN_KEY = pytest.StashKey[RunState]()


def run_state(config: pytest.Config) -> RunState:
    return config.stash[RUN_KEY]
