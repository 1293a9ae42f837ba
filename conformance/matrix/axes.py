"""Server options that touch Mamba state, as matrix axes: every axis value and the SGLang
server arguments it maps to, in this one place.

An :class:`Axis` is one server option family (mixed chunk, the overlap scheduler, the
chunked-prefill size, the Mamba and KV pool sizes, the radix eviction policy, streaming
sessions, reasoning with ``--strip-thinking-cache``, the cap on Mamba states per tree path);
an :class:`AxisValue` is one setting of it.  A cell carries the values it sets
(``Cell.options``); every other axis is at its default for the cell (:func:`value_of`).  ``server_args`` is the only place an axis value
becomes SGLang flags (the targets add them to the cell's command); ``needs`` names the
parser flag and choice a release must offer for the value (``conformance.sglang_api.probes``
answers it per release: ``na`` with the parser's own line); ``refuses`` says why SGLang or
the kit refuses a value for a cell, for the matrix to refuse it on load.

Page size and track interval stay the cell's own fields (``Cell.page_size``,
``Cell.track_interval``); ``--disable-radix-cache`` stays the cold twin and is no axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from conformance.errors import KitError
from conformance.matrix.grid import Grid
from conformance.matrix.strategy import DISABLE_OVERLAP_FLAG, Strategy

#: The kit's sglang-cpu pool sizes (the axes' "default" values on that target).
CPU_MAX_TOTAL_TOKENS = 8192
CPU_MAX_MAMBA_CACHE_SIZE = 48
#: The small pools of the pool axes (eviction under pressure).
SMALL_MAX_TOTAL_TOKENS = 4096
SMALL_MAX_MAMBA_CACHE_SIZE = 16
#: T-LRU's tuning (tokens): SGLang refuses tlru unless threshold > next_prompt_estimate.
TLRU_THRESHOLD, TLRU_NEXT_PROMPT_ESTIMATE = 512, 64
TLRU_CONFIG = f'{{"threshold": {TLRU_THRESHOLD}, "next_prompt_estimate": {TLRU_NEXT_PROMPT_ESTIMATE}}}'
#: A server that takes streaming sessions (``open_session(streaming=True)``).
STREAMING_SESSIONS = "streaming_sessions"
#: A server that batches prefill chunks with running decodes (requests without logprobs only).
MIXED_BATCHES = "mixed_batches"
#: A server that counts a request's output as thinking when the request asks for reasoning
#: (``require_reasoning``; with ``--strip-thinking-cache`` only its prompt is then cached).
REASONING_REQUESTS = "reasoning_requests"
#: A server whose KV pool is the axis's small one: the leaks suite stores more prompt KV than
#: it holds (evictions under KV pressure), which no other workload reaches.
KV_PRESSURE = "kv_pressure"
#: A server whose KV evictions the kit judges against its eviction policy's order
#: (``conformance/checks/eviction_order.py``): the modelled non-default policies, and the small
#: KV pool (LRU, the axis off, under KV pressure).
EVICTION_ORDER = "eviction_order"
#: The eviction policies whose KV victim order ``conformance/checks/eviction_order.py`` models.
ORDERED_POLICIES = ("lfu", "slru", "priority", "tlru")
#: SGLang's cap on the Mamba states kept per root-to-leaf path (from 0.5.18).
PATH_CAP_FLAG = "--mamba-max-states-per-path"
#: SGLang's choice of the unified radix tree's core (``mem_cache/unified_cache/tree_core_registry.py``,
#: 0.5.19+; its default is ``python`` on 0.5.19-0.5.20, ``rust`` from 0.5.21): an environment
#: variable, not a flag, so its ``needs`` name the variable and the core (a feature probe answers it).
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
#: The reasoning parser of the think-token twins (qwen3's ``<think>`` ... ``</think>``).
REASONING_PARSER = "qwen3"
#: That parser's think-end token (``Qwen3Detector.think_end_token``).
THINK_END_TOKEN = "</think>"


class _AxisCell(Protocol):
    """What an axis value's flags and refusals read of a matrix cell."""

    @property
    def strategy(self) -> Strategy: ...
    @property
    def grid(self) -> Grid: ...
    @property
    def options(self) -> tuple[tuple[str, str], ...]: ...


@dataclass(frozen=True)
class AxisValue:
    """One setting of an axis.

    ``args``: its SGLang server arguments for a cell.  ``needs``: the parser flag (and, for a
    flag with choices, the choice) a release must offer.  ``refuses``: why a cell cannot take
    it (None: it can).
    """

    axis: str
    name: str
    description: str
    args: Callable[[_AxisCell], list[str]] = lambda cell: []
    needs: tuple[str, str | None] | None = None
    refuses: Callable[[_AxisCell], str | None] = lambda cell: None
    #: What the value lets clients do (the workloads and programs draw only what the cell allows).
    enables: tuple[str, ...] = ()
    #: Environment variables the value sets on SGLang's servers (a cell that sets the axis only:
    #: a cell at the axis default keeps the release's own default).
    env: tuple[tuple[str, str], ...] = ()
    #: The programs' coverage counters (``conformance/programs/coverage.py``) a nightly fuzz of a
    #: cell with this value must move (a small pool: the pressure it is there for).
    coverage: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """``axis=value``, as a plan and the pairwise test name it."""
        return f"{self.axis}={self.name}"


@dataclass(frozen=True)
class Axis:
    """A server option family and its values; ``default`` is the value a cell that does not
    set the axis has (a callable of the cell for the overlap axis: the strategy decides)."""

    name: str
    description: str
    values: Mapping[str, AxisValue]
    default: Callable[[Strategy], str]
    #: It configures only the radix tree, which a cache-off server has none of (the programs'
    #: cache-off twin drops it: SGLang 0.5.21 refuses tlru without a radix tree).
    tree_only: bool = False

    def value(self, name: str) -> AxisValue:
        return self.values[name]


def _flag(*args: str) -> Callable[[_AxisCell], list[str]]:
    return lambda cell: list(args)


# ------------------------------------------------------------------ chunked prefill

def chunked_prefill_size(value: str, grid: Grid) -> int | None:
    """The ``--chunked-prefill-size`` of a chunked-prefill value for a cell's grid: ``grid``
    cuts on the prefill checkpoint grid (2 x ``lcm(chunk, page)``), ``off-grid`` half a
    checkpoint grid later (a multiple of the page, not of the grid), ``sub-chunk`` below
    the mamba chunk (SGLang warns that checkpoints can then be skipped); None: SGLang's
    default size."""
    g = grid.checkpoint_grid
    return {"grid": 2 * g, "off-grid": g + g // 2, "sub-chunk": grid.chunk // 2}.get(value)


def _chunked_args(value: str) -> Callable[[_AxisCell], list[str]]:
    return lambda cell: ["--chunked-prefill-size", str(chunked_prefill_size(value, cell.grid))]


def _chunked_refuses(value: str) -> Callable[[_AxisCell], str | None]:
    def refuses(cell: _AxisCell) -> str | None:
        size = chunked_prefill_size(value, cell.grid)
        g = cell.grid
        if size is None:
            return None
        if size < 1 or size % g.page_size:
            return f"chunked prefill {value!r} needs a size that is a multiple of the page ({size} with page {g.page_size})"
        if value == "off-grid" and size % g.checkpoint_grid == 0:
            return f"chunked prefill 'off-grid' needs a page smaller than the checkpoint grid (grid {g.checkpoint_grid}, page {g.page_size})"
        if value == "sub-chunk" and size < g.page_size:
            return f"chunked prefill 'sub-chunk' needs a page below half the chunk (chunk {g.chunk}, page {g.page_size})"
        return None
    return refuses


# ------------------------------------------------------------------ overlap

def _overlap_on_refuses(cell: _AxisCell) -> str | None:
    return cell.strategy.refuses_settings(overlap=True, pd=False)


#: SGLang's refusal of the lazy strategy without the overlap scheduler, at start
#: (``_calculate_mamba_ratio`` of the KV-cache sizing, every release with the lazy strategy).
LAZY_NEEDS_OVERLAP = "Lazy extra buffer requires overlap schedule (--disable-overlap-schedule is incompatible)"


def _overlap_off_refuses(cell: _AxisCell) -> str | None:
    if cell.strategy.lazy:
        return f"SGLang refuses {cell.strategy.name} without the overlap scheduler at start: {LAZY_NEEDS_OVERLAP!r}"
    return None


def _values(axis: str, *values: AxisValue) -> dict[str, AxisValue]:
    assert all(v.axis == axis for v in values)
    return {v.name: v for v in values}


def _default(name: str) -> Callable[[Strategy], str]:
    return lambda strategy: name


#: The coverage counters every small pool must move in a nightly fuzz (a KV pool adds retractions).
POOL_PRESSURE = ("refused_after_match", "matched_then_evicted", "eviction_walks", "nodes_evicted")


def _pool_axis(name: str, flag: str, what: str, cpu_default: int, small: int, unit: str, small_enables: tuple[str, ...] = (),
               coverage: tuple[str, ...] = POOL_PRESSURE) -> Axis:
    """A pool-size axis: the target's pool (default) or a small one (eviction under pressure)."""
    return Axis(name, f"{what} size ({flag})", _values(
        name,
        AxisValue(name, "default", f"the target's pool (sglang-cpu: {cpu_default} {unit})"),
        AxisValue(name, "small", f"{small} {unit}: eviction under pressure", _flag(flag, str(small)), needs=(flag, None), enables=small_enables,
                  coverage=coverage),
    ), _default("default"))


_AXES = (
    Axis("overlap", "SGLang's overlap scheduler (event_loop_overlap) on or off", _values(
        "overlap",
        AxisValue("overlap", "on", "the overlap scheduler (one batch in flight while the next is scheduled)", refuses=_overlap_on_refuses),
        AxisValue("overlap", "off", "--disable-overlap-schedule", _flag(DISABLE_OVERLAP_FLAG), needs=(DISABLE_OVERLAP_FLAG, None),
                  refuses=_overlap_off_refuses),
    ), lambda strategy: "on" if strategy.overlap else "off"),
    Axis("mixed_chunk", "prefill chunks batched with running decodes", _values(
        "mixed_chunk",
        AxisValue("mixed_chunk", "off", "prefill and decode in separate batches"),
        AxisValue("mixed_chunk", "on", "--enable-mixed-chunk", _flag("--enable-mixed-chunk"), needs=("--enable-mixed-chunk", None),
                  enables=(MIXED_BATCHES,)),
    ), _default("off")),
    Axis("chunked_prefill", "prompts cut into several prefill chunks", _values(
        "chunked_prefill",
        AxisValue("chunked_prefill", "default", "SGLang's default --chunked-prefill-size"),
        AxisValue("chunked_prefill", "grid", "cut on the checkpoint grid (2 x lcm(chunk, page))", _chunked_args("grid"),
                  needs=("--chunked-prefill-size", None), refuses=_chunked_refuses("grid")),
        AxisValue("chunked_prefill", "off-grid", "cut half a checkpoint grid off it", _chunked_args("off-grid"),
                  needs=("--chunked-prefill-size", None), refuses=_chunked_refuses("off-grid")),
        AxisValue("chunked_prefill", "sub-chunk", "cut below the mamba chunk", _chunked_args("sub-chunk"),
                  needs=("--chunked-prefill-size", None), refuses=_chunked_refuses("sub-chunk")),
    ), _default("default")),
    _pool_axis("mamba_pool", "--max-mamba-cache-size", "the Mamba state pool", CPU_MAX_MAMBA_CACHE_SIZE, SMALL_MAX_MAMBA_CACHE_SIZE, "slots"),
    _pool_axis("kv_pool", "--max-total-tokens", "the KV pool", CPU_MAX_TOTAL_TOKENS, SMALL_MAX_TOTAL_TOKENS, "tokens", (KV_PRESSURE, EVICTION_ORDER),
               (*POOL_PRESSURE, "retractions")),
    Axis("eviction", "the radix cache's eviction policy (--radix-eviction-policy)", _values(
        "eviction",
        *(AxisValue("eviction", p, f"--radix-eviction-policy {p}", _flag("--radix-eviction-policy", p) if p != "lru" else _flag(),
                    needs=("--radix-eviction-policy", p), enables=(EVICTION_ORDER,) if p in ORDERED_POLICIES else ())
          for p in ("lru", "lfu", "slru", "priority")),
        # SGLang refuses a bare tlru at start ("needs 'threshold' greater than 'next_prompt_estimate'")
        AxisValue("eviction", "tlru", f"--radix-eviction-policy tlru with {TLRU_CONFIG}",
                  _flag("--radix-eviction-policy", "tlru", "--radix-eviction-policy-config", TLRU_CONFIG), needs=("--radix-eviction-policy", "tlru"),
                  enables=(EVICTION_ORDER,)),
    ), _default("lru"), tree_only=True),
    Axis("sessions", "streaming sessions (--enable-streaming-session) or plain sessions", _values(
        "sessions",
        AxisValue("sessions", "streaming", "--enable-streaming-session", _flag("--enable-streaming-session"),
                  needs=("--enable-streaming-session", None), enables=(STREAMING_SESSIONS,)),
        AxisValue("sessions", "plain", "sessions without streaming-session mode"),
    ), _default("streaming")),
    Axis("reasoning", "reasoning output whose thinking is stripped from the cache", _values(
        "reasoning",
        AxisValue("reasoning", "off", "no reasoning parser"),
        AxisValue("reasoning", "strip-thinking", f"--reasoning-parser {REASONING_PARSER} --strip-thinking-cache",
                  _flag("--reasoning-parser", REASONING_PARSER, "--strip-thinking-cache"), needs=("--strip-thinking-cache", None),
                  enables=(REASONING_REQUESTS,)),
    ), _default("off")),
    Axis("path_cap", "the Mamba states the radix tree keeps per root-to-leaf path (--mamba-max-states-per-path)", _values(
        "path_cap",
        AxisValue("path_cap", "off", "no cap (SGLang's -1)"),
        # after each insert SGLang removes the shallowest interior states beyond the cap (their
        # KV stays); the tail, forks and locked nodes are kept
        AxisValue("path_cap", "1", f"{PATH_CAP_FLAG} 1: one state per path, the older ones dropped on insert",
                  _flag(PATH_CAP_FLAG, "1"), needs=(PATH_CAP_FLAG, None)),
    ), _default("off"), tree_only=True),
    Axis("tree_core", f"the unified radix tree's core ({TREE_CORE_ENV}; a cell that does not set it runs the release's "
                      "default: python on 0.5.19-0.5.20, rust from 0.5.21)", _values(
        "tree_core", *(AxisValue("tree_core", core, f"{TREE_CORE_ENV}={core}", env=((TREE_CORE_ENV, core),), needs=(TREE_CORE_ENV, core))
          for core in ("rust", "python")),
    ), _default("rust"), tree_only=True),
)

#: Every axis by name.
AXES: dict[str, Axis] = {a.name: a for a in _AXES}
NAMES: tuple[str, ...] = tuple(AXES)


def value_of(cell: _AxisCell, axis: str) -> AxisValue:
    """The value of ``axis`` in ``cell``: the one it sets, else the axis default for its strategy."""
    chosen = dict(cell.options).get(axis)
    a = AXES[axis]
    return a.value(chosen if chosen is not None else a.default(cell.strategy))


def all_default(options, strategy: Strategy) -> bool:
    """Every ``axis=value`` of ``options`` is that axis' default for ``strategy`` (a fault that
    needs only defaults shows on the plain cell, e.g. ``overlap=on`` for extra_buffer)."""
    return all(AXES[axis].default(strategy) == value for axis, value in parse_selection(options))


def values_of(cell: _AxisCell) -> tuple[AxisValue, ...]:
    """Every axis' value in ``cell``, in :data:`AXES` order."""
    return tuple(value_of(cell, a) for a in AXES)


def server_args(cell: _AxisCell) -> list[str]:
    """The SGLang server arguments every axis value of ``cell`` maps to."""
    return [arg for v in values_of(cell) for arg in v.args(cell)]


def server_env(cell: _AxisCell) -> dict[str, str]:
    """The environment the axis values the cell sets map to (an axis at its default sets none)."""
    chosen = dict(cell.options)
    return {k: v for value in values_of(cell) if chosen.get(value.axis) == value.name for k, v in value.env}


def refusal(cell: _AxisCell) -> str | None:
    """Why SGLang (or the kit's grid) refuses one of the cell's axis values (None: none)."""
    return next((r for r in (v.refuses(cell) for v in values_of(cell)) if r), None)


def sets_flag(cell: _AxisCell, flag: str) -> bool:
    """The cell's axis values pass ``flag`` (a target's own default for it then steps aside)."""
    return flag in server_args(cell)


def needed(cell: _AxisCell) -> tuple[tuple[str, str | None], ...]:
    """(parser flag, choice) each axis value the cell sets needs of the release."""
    return tuple(v.needs for v in values_of(cell) if v.needs is not None and dict(cell.options).get(v.axis) == v.name)


def enabled(cell: _AxisCell, capability: str) -> bool:
    """The cell's axis values let clients use ``capability`` (e.g. :data:`STREAMING_SESSIONS`)."""
    return any(capability in v.enables for v in values_of(cell))


def coverage_required(cell: _AxisCell) -> tuple[str, ...]:
    """The coverage counters the cell's axis values (and its matrix fault, e.g. SGLang's forced
    retraction) require a nightly fuzz to move (none: no pressure cell)."""
    fault = getattr(getattr(cell, "fault", None), "coverage", ())
    return tuple(dict.fromkeys([*(c for v in values_of(cell) for c in v.coverage), *fault]))


def parse_selection(items) -> tuple[tuple[str, str], ...]:
    """``("mixed_chunk=on", ...)`` -> ``(("mixed_chunk", "on"), ...)``; a KitError line naming
    the allowed axes or values for a bad item."""
    out = []
    for item in items:
        axis, sep, value = str(item).partition("=")
        if not sep or axis not in AXES:
            raise KitError(f"--server-options: expected axis=value with axis one of {', '.join(NAMES)}, got {item!r}")
        if value not in AXES[axis].values:
            raise KitError(f"--server-options: {axis} has no value {value!r}; allowed: {', '.join(AXES[axis].values)}")
        out.append((axis, value))
    return tuple(out)
