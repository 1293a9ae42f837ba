"""One source of options: every selection and run option is declared here once, as an
:class:`Option` record, and both fronts are generated from these records:

* ``hybrid-conformance`` (``conformance.cli``) adds them to its verbs' argparse parsers
  (:func:`add_arguments`), and ``run`` hands them on to pytest (:func:`forward`);
* the pytest plugin (``conformance.plugin``, ``conformance.programs.options``) adds them
  with ``addoption`` (:func:`add_pytest_options`) and resolves them (CLI > env > ini)
  into the frozen :class:`Options` record the fixtures share (:func:`resolve`);
* the verbs read a parsed command line as the same record (:func:`options_from_args`).

A bad value is one :class:`~conformance.errors.KitError` line naming it and the allowed ones.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from conformance.errors import KitError
from conformance.matrix.cells import DEFAULT_TARGET, STRATEGIES, TARGETS, TIERS
from conformance.matrix.suites import DEFAULT as DEFAULT_SUITES, NAMES as SUITES
from conformance.targets.registry import option_users, target_for, target_help

if TYPE_CHECKING:  # annotations only: the CLI parses its options without pytest
    import pytest

DEFAULT_LAUNCHER = "python -m sglang.launch_server"


@dataclass(frozen=True)
class Option:
    """One option as both fronts declare it. ``{default}`` in ``help`` becomes the default
    the front applies. ``forward``: how ``hybrid-conformance run`` hands it to pytest
    (``"always"`` when given, ``"target"`` when the selected target uses it, None never)."""

    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None  # what the CLI fills in (the plugin leaves it None: env and ini may answer)
    flag_only: bool = False  # a switch (store_true)
    pytest: bool = True  # also a pytest option
    cli: bool = True  # also a hybrid-conformance option
    forward: str | None = "always"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


TARGET = Option("--target", f"{target_help()} (default: {{default}})", choices=TARGETS, default=DEFAULT_TARGET, forward=None)
MODELS = Option("--models", "comma list of model ids, families or twin names to run (default: all)")
STRATEGIES_OPT = Option("--strategies", f"comma list of strategies ({', '.join(STRATEGIES)})")
FAULTS = Option("--faults", "comma list of faults from the matrix (e.g. none,lazy_alloc_fail)")
PAGE_SIZES = Option("--page-sizes", "comma list of page sizes")
SERVER_OPTIONS = Option("--server-options", "comma list of axis=value server options (e.g. mixed_chunk=on; fixtures/matrix.toml [axes]): "
                        "only cells whose options have these values (an axis a cell does not set is at its default; an axis named twice: either value)")
CELLS = Option("--cells", "comma list of matrix cell ids (as plan prints them) to run, within the other filters (default: all)")
TIER = Option("--tier", "premerge (fast subset) < standard (every twin x strategy + the lazy fault; default) < nightly (everything)", choices=TIERS)
MATRIX = Option("--matrix", "matrix file (default: fixtures/matrix.toml)")
LAUNCHER = Option("--sglang-launcher", f"the command that starts SGLang (default: {DEFAULT_LAUNCHER})", default=DEFAULT_LAUNCHER, forward="target")
GPUS = Option("--gpus-per-worker", "GPUs each xdist worker owns; a cell needs tp_size <= this (default 1)", type=int, default=1, forward="target")
TWINS = Option("--twins", "with --target sglang: serve the tiny twin folders instead of the HF models", flag_only=True, forward="target")
DTYPE = Option("--dtype", "with --target sglang-cpu: SGLang's --dtype (default float32)", choices=("float32", "bfloat16"), forward="target")
SUITE = Option("--suite", f"comma list of suites ({', '.join(SUITES)}; default: {', '.join(DEFAULT_SUITES)})", pytest=False, forward=None)
GSM8K_DIR = Option("--gsm8k-dir", "local GSM8K folder (test.jsonl, train_first8.jsonl); else env HYBRID_CONFORMANCE_GSM8K_DIR")
REPORT_DIR = Option("--report-dir", "write report.json, junit.xml, report.md/html here (default: {default})", forward=None)
SERVER_LOG_DIR = Option("--server-log-dir", "per-cell server logs (default: <report-dir>/logs or a temp dir)", cli=False)

#: What every verb that selects cells takes (``run``, ``preflight``, ``plan``, ``fuzz``).
SELECTION = (TARGET, MODELS, STRATEGIES_OPT, FAULTS, PAGE_SIZES, SERVER_OPTIONS, CELLS, TIER, MATRIX, LAUNCHER, GPUS, TWINS, DTYPE, SUITE)
#: The plugin's options: the selection and where things go.
PLUGIN_OPTIONS = (*(o for o in SELECTION if o.pytest), GSM8K_DIR, REPORT_DIR, SERVER_LOG_DIR)

BUDGET = Option("--budget", "request programs per cell: ci (2 programs; a plain pytest run's default on the premerge tier), "
                "standard (8 programs; its default above), premerge (25 s; fuzz's default), "
                "nightly (600 s), a number of examples (40) or seconds (90s, 5m)")
SEED = Option("--seed", "seed of the request-program generator (default 0): the same seed draws the same programs", type=int)
PROGRAM_DB = Option("--program-db", "hypothesis database root for request programs (default .hypothesis/hybrid-conformance); one folder per target and cell")
PROGRAM_FAILURES = Option("--program-failures", "where a failing program's replay file goes (default <report-dir>/programs, else ./program-failures)", cli=False)
SHRINK = Option("--shrink-budget", "seconds of shrinking after a finding (default: the budget profile's)", type=float)
TWIN_BROKER = Option("--twin-broker", "the cache-off twins of an enclosing run (``mutants`` passes its own; "
                     "conformance/programs/cold_twins.py): <socket path>#<key hex>", cli=False)
#: The request-program suite's options (``hybrid-conformance fuzz`` and ``-m programs``).
PROGRAM_OPTIONS = (BUDGET, SEED, PROGRAM_DB, PROGRAM_FAILURES, SHRINK, TWIN_BROKER)


# ------------------------------------------------------------------ the two fronts


def _help(opt: Option, default: object) -> str:
    if default is None:  # nothing filled in: say nothing of a default
        return opt.help.replace(" (default: {default})", "")
    return opt.help.replace("{default}", str(default))


def add_arguments(parser: argparse.ArgumentParser, options: Sequence[Option], **defaults: object) -> None:
    """The CLI side: ``options`` on a verb's parser; ``defaults`` (by dest) override a record's."""
    for opt in options:
        if not opt.cli:
            continue
        default = defaults.get(opt.dest, opt.default)
        kw: dict[str, Any] = {"help": _help(opt, default)}
        if opt.flag_only:
            kw["action"] = "store_true"
        else:
            kw.update(default=default, choices=opt.choices, type=opt.type)
        parser.add_argument(opt.flag, **kw)


def add_pytest_options(group: pytest.OptionGroup, options: Sequence[Option]) -> None:
    """The pytest side: ``options`` on a ``parser.getgroup(...)``; defaults stay None so the
    environment and the ini file can answer (:func:`resolve`)."""
    for opt in options:
        if not opt.pytest:
            continue
        help_text = _help(opt, opt.default)
        if opt.flag_only:
            group.addoption(opt.flag, action="store_true", default=False, help=help_text)
        else:
            group.addoption(opt.flag, default=None, choices=opt.choices, type=opt.type, help=help_text)


def forward(args: argparse.Namespace, options: Sequence[Option] = SELECTION + (GSM8K_DIR,)) -> list[str]:
    """The options of a ``run`` command line as pytest takes them: the given ones, and the
    target's own (``--sglang-launcher`` ...) when the selected target uses them."""
    target = target_for(args.target)
    out: list[str] = []
    for opt in options:
        if opt.forward == "target" and not target.uses_option(opt.dest):
            given = getattr(args, opt.dest, None)
            if given not in (None, False, "", opt.default):
                users = ", ".join(option_users(opt.dest))
                raise KitError(f"{opt.flag} applies to --target {users}; the {target.name} target does not use it")
            continue
        if opt.forward is None:
            continue
        value = getattr(args, opt.dest, None)
        if opt.flag_only:
            out += [opt.flag] if value else []
        elif value not in (None, ""):
            out.append(f"{opt.flag}={value}")
    return out


# ------------------------------------------------------------------ resolution


def csv(value: str | None) -> tuple[str, ...] | None:
    """``"a, b,"`` -> ``("a", "b")``; nothing -> None."""
    if value is None:
        return None
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    return items or None


def page_sizes(value: str | None) -> tuple[int, ...] | None:
    pages = csv(value)
    try:
        return tuple(int(p) for p in pages) if pages else None
    except ValueError:
        raise KitError(f"--page-sizes: expected integers, got {value!r}") from None


@dataclass(frozen=True)
class Options:
    """The run's resolved options, as the fixtures see them."""

    target: str
    models: tuple[str, ...] | None
    strategies: tuple[str, ...] | None
    faults: tuple[str, ...] | None
    page_sizes: tuple[int, ...] | None
    tier: str | None
    matrix_path: str | None
    report_dir: Path | None
    log_dir: Path | None
    sglang_launcher: str
    gpus_per_worker: int
    twins: bool
    gsm8k_dir: str | None
    dtype: str | None = None
    server_options: tuple[str, ...] | None = None
    cells: tuple[str, ...] | None = None


def _record(value: Callable[[Option], Any]) -> Options:
    """The one builder of :class:`Options`: ``value(option)`` is an option's raw value (as
    typed, or the front's fallback); lists are split, page sizes parsed, paths made."""
    report_dir = Path(value(REPORT_DIR)) if value(REPORT_DIR) else None
    log_dir = value(SERVER_LOG_DIR)
    return Options(
        target=value(TARGET),
        models=csv(value(MODELS)),
        strategies=csv(value(STRATEGIES_OPT)),
        faults=csv(value(FAULTS)),
        page_sizes=page_sizes(value(PAGE_SIZES)),
        tier=value(TIER),
        matrix_path=value(MATRIX),
        report_dir=report_dir,
        log_dir=Path(log_dir) if log_dir else (report_dir / "logs" if report_dir else None),
        sglang_launcher=value(LAUNCHER),
        gpus_per_worker=value(GPUS),
        twins=bool(value(TWINS)),
        gsm8k_dir=value(GSM8K_DIR),
        dtype=value(DTYPE),
        server_options=csv(value(SERVER_OPTIONS)),
        cells=csv(value(CELLS)),
    )


def resolve(opt: Callable[[str], Any], *, ini_target: str | None = None) -> Options:
    """The plugin's resolver: CLI (``opt``: the value of a flag) > env > ini, validated; a bad
    value is one KitError line."""
    fallbacks: dict[str, Callable[[], Any]] = {  # where a flag is not given: env, then ini or the default
        TARGET.flag: lambda: os.environ.get("HYBRID_CONFORMANCE_TARGET") or ini_target or DEFAULT_TARGET,
        LAUNCHER.flag: lambda: os.environ.get("HYBRID_CONFORMANCE_SGLANG_LAUNCHER") or DEFAULT_LAUNCHER,
        GPUS.flag: lambda: 1,
        GSM8K_DIR.flag: lambda: os.environ.get("HYBRID_CONFORMANCE_GSM8K_DIR"),
    }

    def value(option: Option) -> object:
        given = opt(option.flag)
        return given or fallbacks[option.flag]() if option.flag in fallbacks else given

    target = value(TARGET)
    if target not in TARGETS:
        raise KitError(f"--target: unknown value {target!r}; allowed: {', '.join(TARGETS)}")
    for s in csv(value(STRATEGIES_OPT)) or ():
        if s not in STRATEGIES:
            raise KitError(f"--strategies: unknown value {s!r}; allowed: {', '.join(STRATEGIES)}")
    return _record(value)


def options_from_args(args: argparse.Namespace) -> Options:
    """The verbs' resolver: a parsed command line (its parser applied the defaults) as the
    same record; an option the verb does not take is at its declared default.  Checked by
    the matrix's selection where the verb selects cells; the environment answers in the
    pytest run a verb starts, as for any pytest run."""
    return _record(lambda option: getattr(args, option.dest, option.default))
