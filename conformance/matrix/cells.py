"""The conformance matrix: fixtures/matrix.toml loaded into validated, frozen cells.

A cell is (model, strategy, page size, track interval, fault, cache variant, server options):
the server options are the axes of ``conformance.matrix.axes`` the cell sets (every other axis at
its default), from ``options`` tables of ``[[cells]]`` blocks or from a block that
``generate = "pairwise"`` turns into a covering array (``conformance.matrix.pairwise``).
Every rule violation is a :class:`MatrixError` whose message is one line naming
the file, the cell (or block) and the rule that was broken.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from conformance.matrix import axes as option_axes
from conformance.errors import KitError
from conformance.matrix.grid import Grid
from conformance.matrix.pairwise import Params, covering_array
from conformance.matrix.suites import NAMES as SUITE_NAMES
from conformance.matrix.strategy import BASELINE, NAMES, Strategy
from conformance.matrix.strategy import STRATEGIES as SGLANG_STRATEGIES

STRATEGIES = NAMES
FAMILIES = ("qwen3-next", "nemotron-h", "granite-h", "falcon-h1")
TARGETS = ("reference", "sglang", "sglang-cpu", "pool")
TIERS = ("premerge", "standard", "nightly")  # each tier includes the ones before it
PD_ROLES = ("prefill", "decode")  # the servers of a PD unit that run the model
DEFAULT_TIER = "standard"
#: Real SGLang on CPU is the kit's main CPU target; the reference engine is opt-in.
DEFAULT_TARGET = "sglang-cpu"
CHECKS = ("kl", "gsm8k", "prefix_branching", "leaks", "disagg", "agreement", "perf")

FIXTURES_DIR = Path(os.environ.get("HYBRID_CONFORMANCE_FIXTURES", Path(__file__).resolve().parents[2] / "fixtures"))
DEFAULT_MATRIX = FIXTURES_DIR / "matrix.toml"


class MatrixError(KitError):
    """The matrix file is malformed or asks for a combination SGLang refuses."""


@dataclass(frozen=True)
class Thresholds:
    kl_k3_max: float = 0.002
    kl_floor_factor: float = 100.0
    kl_abs_cap: float = 0.005
    gsm8k_min_accuracy: float = 0.0
    hit_fraction_min: float = 0.9


@dataclass(frozen=True)
class Model:
    id: str
    family: str
    hf_path: str
    twin: str
    tp_size: int
    mamba_chunk_size: int
    thresholds: Thresholds = field(default_factory=Thresholds)


@dataclass(frozen=True)
class MatrixFault:
    """A cell's fault axis (``[faults.<name>]`` of ``fixtures/matrix.toml``): the settings its
    servers run under (``none``: clean); not a seeded fault (``conformance.matrix.faults.SeededFault``)."""

    name: str
    description: str
    env: tuple[tuple[str, str], ...] = ()
    strategies: tuple[str, ...] = STRATEGIES
    effects: tuple[str, ...] = ()
    #: PD cells: the servers of the PD unit its ``env`` goes to (the non-PD server always gets it).
    pd_roles: tuple[str, ...] = PD_ROLES
    #: The suites whose tests bind its cells (empty: every suite); the others leave them out.
    suites: tuple[str, ...] = ()
    #: PD cells: SGLang settings every server of the PD unit gets (whatever ``pd_roles`` says),
    #: e.g. a timeout its failures need to end within a run.
    pd_env: tuple[tuple[str, str], ...] = ()
    #: Laid over any clean cell of its strategies when ``--faults`` names it (besides its own
    #: cells): a switch of the server's checking (SGLang's strict idle check), not a bug.
    overlay: bool = False
    #: The programs' coverage counters a nightly fuzz of its cells must move (``conformance/programs/coverage.py``).
    coverage: tuple[str, ...] = ()

    @property
    def injected(self) -> bool:
        return self.name != "none"

    def binds_suite(self, suite: str | None) -> bool:
        """Whether a test of ``suite`` (None: a test outside the suites) binds this fault's cells."""
        return not self.suites or suite is None or suite in self.suites


@dataclass(frozen=True)
class CacheVariant:
    name: str
    description: str
    args: tuple[str, ...] = ()
    strategies: tuple[str, ...] = STRATEGIES
    targets: tuple[str, ...] = TARGETS


@dataclass(frozen=True)
class Cell:
    """One matrix cell: the unit that gets exactly one server."""

    model: Model
    strategy: Strategy
    page_size: int
    track_interval: int
    fault: MatrixFault
    cache_variant: CacheVariant
    tier: str
    block: str
    targets: tuple[str, ...] = TARGETS
    #: (axis, value) of each server-option axis the cell sets off its default, in axis order.
    options: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        parts = [self.model.id, self.strategy.name, f"p{self.page_size}", f"t{self.track_interval}"]
        if self.fault.injected:
            parts.append(self.fault.name)
        if self.cache_variant.name != "radix":
            parts.append(self.cache_variant.name)
        parts += [f"{axis}-{value}" for axis, value in self.options]
        return "-".join(parts)

    @property
    def env(self) -> dict[str, str]:
        """The fault's environment and the one the cell's axis values set (``axes.server_env``)."""
        return {**dict(self.fault.env), **option_axes.server_env(self)}

    @property
    def grid(self) -> Grid:
        """SGLang's resolved chunk and cached-state grids for this cell."""
        return Grid.of(self)

    @property
    def markers(self) -> tuple[str, ...]:
        """Marker names a test bound to this cell carries (besides its check marker)."""
        marks = [self.strategy.name]
        marks += ["premerge", "nightly"] if self.tier == "premerge" else ["nightly"]  # every cell runs nightly
        if self.fault.injected:
            marks.append(self.fault.name)
        if self.cache_variant.name != "radix":
            marks.append(self.cache_variant.name)
        return tuple(marks)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model.id,
            "family": self.model.family,
            "strategy": self.strategy.name,
            "page_size": self.page_size,
            "track_interval": self.track_interval,
            "fault": self.fault.name,
            "cache_variant": self.cache_variant.name,
            "options": {v.axis: v.name for v in option_axes.values_of(self)},
            "tier": self.tier,
        }


@dataclass(frozen=True)
class Matrix:
    path: Path
    models: Mapping[str, Model]
    strategies: Mapping[str, Strategy]
    faults: Mapping[str, MatrixFault]
    cache_variants: Mapping[str, CacheVariant]
    cells: tuple[Cell, ...]
    #: The server-option axes the matrix declares and the values it uses of each.
    axes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The parameters of each ``generate = "pairwise"`` block (its covering array's input).
    generated: Mapping[str, Params] = field(default_factory=dict)

    def select(
        self,
        *,
        target: str | None = None,
        models: Sequence[str] | None = None,
        strategies: Sequence[str] | None = None,
        faults: Sequence[str] | None = None,
        page_sizes: Sequence[int] | None = None,
        tier: str | None = None,
        server_options: Sequence[str] | None = None,
        cells: Sequence[str] | None = None,
    ) -> list[Cell]:
        """Cells matching every given filter (None = no filter), in file order.

        ``tier`` selects that tier and the smaller ones: premerge ⊂ standard ⊂ nightly.
        An overlay fault named in ``faults`` is also laid over every selected clean cell of
        its strategies (the same cell, that fault's env; one cell per id).  ``cells``: only
        these ids (``plan`` prints them; ``history --shard`` runs a shard's cells by id).
        """
        if tier is not None:
            _check_choices("--tier", [tier], TIERS)
        if models:
            _check_choices("--models", models, [*self.models, *(m.family for m in self.models.values()), *(m.twin for m in self.models.values())])
        if strategies:
            _check_choices("--strategies", strategies, STRATEGIES)
        if faults:
            _check_choices("--faults", faults, self.faults)
        wanted: dict[str, set[str]] = {}  # one axis named twice: either value
        for axis, value in option_axes.parse_selection(server_options or ()):
            wanted.setdefault(axis, set()).add(value)
        overlays = [self.faults[f] for f in faults or () if self.faults[f].overlay]
        out: dict[str, Cell] = {}
        for cell in self.cells:
            if target and target not in cell.targets:
                continue
            if models and not ({cell.model.id, cell.model.family, cell.model.twin} & set(models)):
                continue
            if strategies and cell.strategy.name not in strategies:
                continue
            if page_sizes and cell.page_size not in page_sizes:
                continue
            if tier and TIERS.index(cell.tier) > TIERS.index(tier):
                continue
            if any(option_axes.value_of(cell, axis).name not in values for axis, values in wanted.items()):
                continue
            for c in [cell] * (not faults or cell.fault.name in faults) + _overlaid(cell, overlays):
                out.setdefault(c.id, c)
        if cells:
            unknown = [c for c in cells if c not in out and all(c != m.id for m in self.cells)]
            if unknown:
                raise KitError(f"--cells: unknown cell {unknown[0]!r} (hybrid-conformance plan --tier nightly lists them)")
            return [c for c in out.values() if c.id in set(cells)]
        return list(out.values())

    def baseline_for(self, cell: Cell) -> Cell | None:
        """The cell's paired baseline (GSM8K's paired test): see :func:`baseline_spec`;
        None for a cell that is its own baseline or whose baseline the matrix lacks."""
        spec = baseline_spec(cell, self.strategies.get(BASELINE))
        if spec is None:
            return None
        return next((c for c in self.cells if _baseline_match(c, cell.model.id, *spec)), None)


def _overlaid(cell: Cell, overlays: Sequence[MatrixFault]) -> list[Cell]:
    """``cell`` under each overlay fault that takes it (a clean cell of its strategies)."""
    if cell.fault.injected:
        return []
    return [dataclasses.replace(cell, fault=f) for f in overlays if cell.strategy.name in f.strategies]


def baseline_spec(cell: Cell, no_buffer: Strategy | None) -> tuple[int, int] | None:
    """(page size, track interval) of the ``no_buffer`` cell a cell is paired with, or None
    for a baseline cell itself.

    The pairing: the same model's ``no_buffer`` cell, no fault, radix cache, the same track
    interval, and the same page size when SGLang allows ``no_buffer`` there; ``no_buffer``
    only takes page size 1, so larger-page cells pair with the page-1 cell (the nearest
    baseline SGLang allows), and hierarchical-cache cells with the radix cell (``no_buffer``
    has no host-offload variant)."""
    if cell.strategy.is_baseline and not cell.fault.injected and cell.cache_variant.name == "radix" and not cell.options:
        return None
    limit = no_buffer.max_page_size if no_buffer is not None else None
    page = cell.page_size if limit is None or cell.page_size <= limit else limit
    return page, cell.track_interval


def baseline_id(cell: Cell, no_buffer: Strategy | None) -> str | None:
    """The id the paired baseline cell has (for verdicts that name a missing one)."""
    spec = baseline_spec(cell, no_buffer)
    return None if spec is None else f"{cell.model.id}-{BASELINE}-p{spec[0]}-t{spec[1]}"


def _baseline_match(c: Cell, model_id: str, page: int, interval: int) -> bool:
    return (
        c.model.id == model_id and c.strategy.is_baseline and not c.fault.injected
        and c.cache_variant.name == "radix" and c.page_size == page and c.track_interval == interval and not c.options
    )


def _check_choices(option: str, values: Iterable[str], allowed: Iterable[str]) -> None:
    allowed = list(dict.fromkeys(allowed))
    for v in values:
        if v not in allowed:
            raise KitError(f"{option}: unknown value {v!r}; allowed: {', '.join(allowed)}")


# ------------------------------------------------------------------ loading

_TOP_KEYS = {"schema", "defaults", "strategies", "faults", "cache_variants", "axes", "models", "cells"}
_MODEL_KEYS = {"id", "family", "hf_path", "twin", "tp_size", "mamba_chunk_size", "thresholds"}
_STRATEGY_KEYS = {"description", "overlap", "max_page_size", "ping_pong_slots", "pd"}
_FAULT_KEYS = {"description", "env", "strategies", "effects", "pd_roles", "suites", "pd_env", "overlay", "coverage"}
_VARIANT_KEYS = {"description", "args", "strategies", "targets"}
_BLOCK_KEYS = {"name", "tier", "models", "strategies", "page_sizes", "track_intervals", "faults", "cache_variants", "targets",
               "options", "generate"}
_AXIS_KEYS = {"description", "values"}
#: How a ``generate`` block turns its lists into cells (default: their cartesian product).
GENERATORS = ("product", "pairwise")
_DEFAULT_KEYS = {"track_interval"}


class _Ctx:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, rule: str) -> MatrixError:
        return MatrixError(f"{self.path}: {where}: {rule}")

    def keys(self, where: str, table: Mapping[str, Any], allowed: set[str], required: Iterable[str] = ()) -> None:
        if not isinstance(table, Mapping):
            raise self.fail(where, f"expected a table, got {type(table).__name__}")
        for k in table:
            if k not in allowed:
                raise self.fail(where, f"unknown key {k!r} (allowed: {', '.join(sorted(allowed))})")
        for k in required:
            if k not in table:
                raise self.fail(where, f"missing required key {k!r}")

    def typed(self, where: str, value: Any, kind: type | tuple[type, ...], name: str) -> Any:
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise self.fail(where, f"{name} must be {kind}, got bool")
        if not isinstance(value, kind):
            raise self.fail(where, f"{name} must be {getattr(kind, '__name__', kind)}, got {value!r}")
        return value


def load_matrix(path: str | os.PathLike[str] | None = None) -> Matrix:
    """Load and validate a matrix file (default: fixtures/matrix.toml)."""
    p = Path(path or os.environ.get("HYBRID_CONFORMANCE_MATRIX", DEFAULT_MATRIX))
    ctx = _Ctx(p)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise MatrixError(f"{p}: matrix file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise MatrixError(f"{p}: not valid TOML: {e}") from None
    ctx.keys("top level", raw, _TOP_KEYS, required=("schema", "models", "cells", "strategies", "faults"))
    if raw["schema"] != 1:
        raise ctx.fail("schema", f"unsupported schema {raw['schema']!r} (this kit reads schema 1)")
    defaults = raw.get("defaults", {})
    ctx.keys("[defaults]", defaults, _DEFAULT_KEYS)

    strategies: dict[str, Strategy] = {}
    for name, t in raw["strategies"].items():
        where = f"[strategies.{name}]"
        if name not in STRATEGIES:
            raise ctx.fail(where, f"strategy {name!r} does not exist in SGLang 0.5.23 (it has {', '.join(STRATEGIES)})")
        ctx.keys(where, t, _STRATEGY_KEYS, required=("overlap", "ping_pong_slots", "pd"))
        strategies[name] = dataclasses.replace(
            SGLANG_STRATEGIES[name],
            description=t.get("description", ""),
            overlap=ctx.typed(where, t["overlap"], bool, "overlap"),
            ping_pong_slots=ctx.typed(where, t["ping_pong_slots"], int, "ping_pong_slots"),
            pd=ctx.typed(where, t["pd"], bool, "pd"),
            max_page_size=t.get("max_page_size"),
        )
    for name, s in strategies.items():
        refusal = SGLANG_STRATEGIES[name].refuses_settings(overlap=s.overlap, pd=s.pd)
        if refusal:
            raise ctx.fail(f"[strategies.{name}]", refusal)

    faults: dict[str, MatrixFault] = {}
    for name, t in raw["faults"].items():
        where = f"[faults.{name}]"
        ctx.keys(where, t, _FAULT_KEYS)
        env, pd_env = t.get("env", {}), t.get("pd_env", {})
        if not all(isinstance(v, str) for v in (*env.values(), *pd_env.values())):
            raise ctx.fail(where, "env and pd_env values must be strings")
        fs = tuple(t.get("strategies", STRATEGIES))
        for s in fs:
            if s not in strategies:
                raise ctx.fail(where, f"unknown strategy {s!r}")
        roles = tuple(t.get("pd_roles", PD_ROLES))
        if not roles or set(roles) - set(PD_ROLES):
            raise ctx.fail(where, f"pd_roles {list(roles)}: each must be one of {', '.join(PD_ROLES)}")
        suites = tuple(t.get("suites", ()))
        unknown = [x for x in suites if x not in SUITE_NAMES]
        if unknown:
            raise ctx.fail(where, f"unknown suite(s) {', '.join(map(str, unknown))} (the suites: conformance/matrix/suites.py)")
        if not isinstance(t.get("overlay", False), bool):
            raise ctx.fail(where, "overlay must be true or false")
        faults[name] = MatrixFault(name, t.get("description", ""), tuple(sorted(env.items())), fs, tuple(t.get("effects", ())), roles, suites,
                             tuple(sorted(pd_env.items())), t.get("overlay", False), tuple(t.get("coverage", ())))
    if "none" not in faults:
        raise ctx.fail("[faults]", "a fault named 'none' (no injection) is required")

    variants: dict[str, CacheVariant] = {"radix": CacheVariant("radix", "the device radix cache")}
    for name, t in raw.get("cache_variants", {}).items():
        where = f"[cache_variants.{name}]"
        ctx.keys(where, t, _VARIANT_KEYS)
        variants[name] = CacheVariant(
            name, t.get("description", ""), tuple(t.get("args", ())), tuple(t.get("strategies", STRATEGIES)), tuple(t.get("targets", TARGETS))
        )

    models: dict[str, Model] = {}
    for i, t in enumerate(raw["models"]):
        where = f"[[models]] #{i + 1}"
        ctx.keys(where, t, _MODEL_KEYS, required=("id", "family", "hf_path", "twin", "tp_size", "mamba_chunk_size"))
        where = f"model {t['id']!r}"
        if t["family"] not in FAMILIES:
            raise ctx.fail(where, f"unknown family {t['family']!r} (allowed: {', '.join(FAMILIES)})")
        if t["id"] in models:
            raise ctx.fail(where, "duplicate model id")
        th = t.get("thresholds", {})
        ctx.keys(f"{where} thresholds", th, set(Thresholds.__dataclass_fields__))
        models[t["id"]] = Model(
            id=t["id"],
            family=t["family"],
            hf_path=t["hf_path"],
            twin=t["twin"],
            tp_size=ctx.typed(where, t["tp_size"], int, "tp_size"),
            mamba_chunk_size=ctx.typed(where, t["mamba_chunk_size"], int, "mamba_chunk_size"),
            thresholds=Thresholds(**{k: float(v) for k, v in th.items()}),
        )

    axes = _load_axes(ctx, raw.get("axes", {}))
    cells: list[Cell] = []
    seen: dict[str, str] = {}
    generated: dict[str, Params] = {}
    default_ti = defaults.get("track_interval", 256)
    for i, b in enumerate(raw["cells"]):
        bname = b.get("name", f"#{i + 1}") if isinstance(b, Mapping) else f"#{i + 1}"
        where = f"[[cells]] {bname!r}"
        ctx.keys(where, b, _BLOCK_KEYS, required=("models", "strategies", "page_sizes"))
        tier = b.get("tier", "nightly")
        if tier not in TIERS:
            raise ctx.fail(where, f"unknown tier {tier!r} (allowed: {', '.join(TIERS)})")
        block_targets = tuple(b.get("targets", TARGETS))
        for tg in block_targets:
            if tg not in TARGETS:
                raise ctx.fail(where, f"unknown target {tg!r} (allowed: {', '.join(TARGETS)})")
        mids: list[str] = []
        for m in b["models"]:
            hits = [k for k in models if fnmatch.fnmatchcase(k, m) or models[k].family == m]
            if not hits:
                raise ctx.fail(where, f"unknown model {m!r} (known: {', '.join(models)})")
            mids += [h for h in hits if h not in mids]
        for s in b["strategies"]:
            if s not in strategies:
                raise ctx.fail(where, f"strategy {s!r} does not exist in SGLang 0.5.23 (it has {', '.join(STRATEGIES)})")
        for f in b.get("faults", ["none"]):
            if f not in faults:
                raise ctx.fail(where, f"unknown fault {f!r} (known: {', '.join(faults)})")
        for v in b.get("cache_variants", ["radix"]):
            if v not in variants:
                raise ctx.fail(where, f"unknown cache variant {v!r} (known: {', '.join(variants)})")
        for ps in b["page_sizes"]:
            ctx.typed(where, ps, int, "page_sizes entries")
            if ps < 1:
                raise ctx.fail(where, f"page size must be >= 1, got {ps}")
        tis = b.get("track_intervals", [default_ti])
        for ti in tis:
            ctx.typed(where, ti, int, "track_intervals entries")
        params: Params = [
            ("model", mids), ("strategy", list(b["strategies"])), ("page_size", list(b["page_sizes"])), ("track_interval", list(tis)),
            ("fault", list(b.get("faults", ["none"]))), ("cache_variant", list(b.get("cache_variants", ["radix"]))),
            *_block_options(ctx, where, b.get("options", {}), axes),
        ]

        def build(row: Mapping[str, Any]) -> Cell:
            variant = variants[row["cache_variant"]]
            targets = tuple(t for t in block_targets if t in variant.targets)
            cell = Cell(models[row["model"]], strategies[row["strategy"]], row["page_size"], row["track_interval"],
                        faults[row["fault"]], variant, tier, bname, targets)
            chosen = {a: row[a] for a in option_axes.NAMES if a in row}
            return dataclasses.replace(cell, options=_normalized(cell, chosen))

        generate = b.get("generate", "product")
        if generate not in GENERATORS:
            raise ctx.fail(where, f"unknown generate {generate!r} (allowed: {', '.join(GENERATORS)})")
        if generate == "pairwise":
            generated[bname] = params
            rows = covering_array(params, _partial_validity(ctx, build, params))
        else:
            rows = [dict(zip([n for n, _ in params], combo)) for combo in itertools.product(*(vs for _, vs in params))]
        for row in rows:
            cell = build(row)
            _validate_cell(ctx, cell)
            if cell.id in seen:
                if generate == "pairwise":  # a generated row that an earlier block already holds
                    continue
                raise ctx.fail(f"cell {cell.id}", f"defined twice (blocks {seen[cell.id]!r} and {bname!r})")
            seen[cell.id] = bname
            cells.append(cell)
    matrix = Matrix(p, models, strategies, faults, variants, tuple(cells), axes, generated)
    _validate_baselines(ctx, matrix)
    return matrix


def _load_axes(ctx: _Ctx, raw: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """``[axes.<name>]`` tables: each axis of ``conformance.matrix.axes`` and the values the matrix uses."""
    out: dict[str, tuple[str, ...]] = {}
    for name, t in raw.items():
        where = f"[axes.{name}]"
        if name not in option_axes.AXES:
            raise ctx.fail(where, f"unknown axis {name!r} (known: {', '.join(option_axes.NAMES)})")
        ctx.keys(where, t, _AXIS_KEYS, required=("values",))
        known = option_axes.AXES[name].values
        for v in t["values"]:
            if v not in known:
                raise ctx.fail(where, f"unknown value {v!r} (the kit maps: {', '.join(known)})")
        out[name] = tuple(t["values"])
    return out


def _block_options(ctx: _Ctx, where: str, options: Any, axes: Mapping[str, tuple[str, ...]]) -> list[tuple[str, list[str]]]:
    """A block's ``options`` table as generator parameters, each axis value checked against ``[axes.*]``."""
    if not isinstance(options, Mapping):
        raise ctx.fail(where, "options must be a table of axis = [values]")
    out = []
    for axis, values in options.items():
        if axis not in axes:
            raise ctx.fail(where, f"options: axis {axis!r} is not declared in [axes] (declared: {', '.join(axes) or 'none'})")
        if not isinstance(values, list) or not values:
            raise ctx.fail(where, f"options.{axis} must be a non-empty list")
        for v in values:
            if v not in axes[axis]:
                raise ctx.fail(where, f"options.{axis}: value {v!r} is not in [axes.{axis}] values ({', '.join(axes[axis])})")
        out.append((axis, list(values)))
    return out


def _normalized(cell: Cell, chosen: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The (axis, value) pairs a cell sets off the axis defaults, in axis order."""
    return tuple((a, chosen[a]) for a in option_axes.NAMES if a in chosen and chosen[a] != option_axes.AXES[a].default(cell.strategy))


#: The generator parameters a cell needs before it can be judged at all.
_CORE = ("model", "strategy", "page_size", "track_interval", "fault", "cache_variant")


def _partial_validity(ctx: _Ctx, build: Any, params: Params) -> Any:
    """``valid(partial row)`` for the pairwise generator: None until the cell's own fields are
    chosen, then whether the cell (with the axis values chosen so far) passes every rule.
    Each axis value's refusal depends only on those fields, so a partial verdict holds."""
    cache: dict[tuple, bool] = {}

    def valid(row: Mapping[str, Any]) -> bool | None:
        if not all(k in row for k in _CORE):
            return None
        key = tuple(sorted((k, str(v)) for k, v in row.items()))
        if key not in cache:
            try:
                cell = build(row)
                _validate_cell(ctx, cell)
                cache[key] = not _interval_below_chunk(cell)
            except MatrixError:
                cache[key] = False
        return cache[key]

    return valid


def _interval_below_chunk(cell: Cell) -> bool:
    """SGLang 0.5.13-0.5.23 refuse a buffered server whose track interval is below the
    model's Mamba2 chunk (``probes.Features.track_interval_not_applicable``): a hand-written
    cell shows that refusal as n/a, but a generated cell meant to hold pairs would hold them
    on no release."""
    return cell.strategy.has_buffer and cell.track_interval < cell.model.mamba_chunk_size


def _validate_baselines(ctx: _Ctx, matrix: Matrix) -> None:
    """Every cell's paired baseline exists, in the same or a smaller tier, for every target
    that serves the cell (so any tier's run can pair each cell)."""
    if BASELINE not in matrix.strategies:
        return
    for cell in matrix.cells:
        want = baseline_id(cell, matrix.strategies[BASELINE])
        if want is None:
            continue
        base = matrix.baseline_for(cell)
        if base is None or TIERS.index(base.tier) > TIERS.index(cell.tier) or not set(cell.targets) <= set(base.targets):
            why = "is not defined" if base is None else f"is in tier {base.tier!r} or misses targets of the cell"
            raise ctx.fail(f"cell {cell.id}", f"its paired GSM8K baseline {want} {why} (add it to a [[cells]] block of tier <= {cell.tier!r})")


def _validate_cell(ctx: _Ctx, cell: Cell) -> None:
    """The combination rules SGLang 0.5.23 enforces (mamba_hook.py) plus the kit's own."""
    where = f"cell {cell.id}"
    s = cell.strategy
    refusal = (
        s.refuses_page_size(cell.page_size)
        or s.refuses_track_interval(cell.track_interval, cell.page_size)
        or Grid.refuses(cell.model.mamba_chunk_size, cell.page_size)
    )
    if refusal:
        raise ctx.fail(where, refusal)
    if s.name not in cell.fault.strategies:
        raise ctx.fail(where, f"fault {cell.fault.name!r} only applies to strategies {', '.join(cell.fault.strategies)}")
    if s.name not in cell.cache_variant.strategies:
        raise ctx.fail(where, f"cache variant {cell.cache_variant.name!r} only applies to strategies {', '.join(cell.cache_variant.strategies)}")
    if not cell.targets:
        raise ctx.fail(where, "no target can serve this cell")
    refused = option_axes.refusal(cell)
    if refused:
        raise ctx.fail(where, refused)

