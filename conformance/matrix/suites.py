"""The suites, one :class:`Suite` record each: the only place that names them.

A suite is a folder of pytest files under ``conformance/suites/`` that binds a workload, a
target and a check per cell; its name is also its pytest marker and the check name its
verdicts carry.  ``--suite`` accepts these names, ``run`` turns them into the folders, the
plugin registers their markers, and a module's suite is read off its dotted path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.errors import KitError

SUITES_DIR = Path(__file__).resolve().parents[1] / "suites"
PACKAGE = "conformance.suites"


@dataclass(frozen=True)
class Suite:
    """One suite: its name (= marker = check), what its marker means, whether a plain
    ``run`` selects it (``default``), and the order a default run gives it."""

    name: str
    help: str
    default: bool = False

    @property
    def path(self) -> Path:
        """The suite's folder (what ``run`` hands to pytest)."""
        return SUITES_DIR / self.name


_ALL = (
    Suite("leaks", "pool-leak invariants", default=True),
    Suite("kl", "KL divergence between cached and uncached logprobs", default=True),
    Suite("prefix_branching", "prefix-branching cache hits against the oracle", default=True),
    Suite("gsm8k", "GSM8K accuracy / agreement", default=True),
    Suite("disagg", "PD disaggregation"),
    Suite("agreement", "real SGLang on CPU against the reference engine (target sglang-cpu)"),
    Suite("perf", "what the cell's strategy costs: TTFT, tok/s, pool peaks (standard tier, real targets)"),
    Suite("programs", "randomized request programs with a differential oracle (conformance/programs)"),
    Suite("hicache", "cells with --enable-hierarchical-cache: SGLang's host tier"),
)

#: Every suite by name.
SUITES: dict[str, Suite] = {s.name: s for s in _ALL}
NAMES = tuple(SUITES)
#: What a plain ``run`` selects, in its order (leaks last: it judges every scenario's idle probe).
DEFAULT = ("kl", "prefix_branching", "gsm8k", "leaks")
assert set(DEFAULT) == {s.name for s in _ALL if s.default}, "DEFAULT lists the default suites"


def suite(name: str) -> Suite:
    """The suite of a name (one line naming the allowed ones when unknown)."""
    try:
        return SUITES[name]
    except KeyError:
        raise KitError(f"--suite: unknown value {name!r}; allowed: {', '.join(NAMES)}") from None


def suite_of_module(module: str) -> str | None:
    """The suite a test module belongs to (``conformance.suites.<suite>.test_*``), or None."""
    head, _, rest = module.partition(PACKAGE + ".")
    parts = rest.split(".") if not head and rest else []
    return parts[0] if len(parts) == 2 and parts[0] in SUITES else None
