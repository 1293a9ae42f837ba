"""The ``perf`` block of each cell in report.json: ratios inside one run, their noise,
what ``compare`` flags, and the report's ratio table (the ratio plot is drawn in
``conformance.report.plots`` from these blocks).

A cell's block is built from its ``perf`` check (``conformance.checks.perf``): the
medians, their spreads, and ``ratios`` -- each against the cell itself (hit vs cold
TTFT), the model's ``no_buffer`` cell of the same run, or (``extra_buffer_lazy``) its
``extra_buffer`` sibling -- with ``ratio_bounds``, the interval the ratio's two
intervals allow.  Absolute times on a shared machine move with its load; ratios taken
inside one run move far less, so they are what runs are compared on.

``compare`` flags a ratio that got worse by more than a threshold (``--perf-threshold``;
default per ratio: :data:`DEFAULT_THRESHOLDS`, from the spread measured over repeated
runs, docs/perf.md) and never one inside the measured noise (the old and new intervals
overlap).  Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from conformance.checks.perf import POOL_METRICS, TIME_METRICS, Spread, fixed, interval_of, ratio

#: Keys every perf block has (the contract: ttft_cold_s, ttft_hit_s, decode_tok_s, repeats, ratios).
BLOCK_KEYS = ("ttft_cold_s", "ttft_hit_s", "decode_tok_s", "repeats", "ratios")
BLOCK_NUMBERS = (*TIME_METRICS, *POOL_METRICS, "repeats", "concurrency")


@dataclass(frozen=True)
class RatioSpec:
    """``metric`` of the cell over ``base_metric`` of ``against``: ``self``, or the perf
    details' key naming the paired cell (``baseline_cell``: the model's no_buffer cell;
    ``extra_buffer_cell``: a lazy cell's extra_buffer sibling); ``worse`` says which
    direction is a regression."""

    name: str
    metric: str
    against: str
    base_metric: str
    worse: str  # "higher" or "lower"
    kind: str  # "time" (TTFT), "throughput" (decode tok/s across cells) or "memory" (counted)
    text: str


RATIOS = (
    RatioSpec("hit_vs_cold_ttft", "ttft_hit_s", "self", "ttft_cold_s", "higher", "time", "TTFT on a prefix hit / cold TTFT"),
    RatioSpec("ttft_vs_no_buffer", "ttft_cold_s", "baseline_cell", "ttft_cold_s", "higher", "time", "cold TTFT / the no_buffer cell's"),
    RatioSpec("ttft_hit_vs_no_buffer", "ttft_hit_s", "baseline_cell", "ttft_hit_s", "higher", "time", "hit TTFT / the no_buffer cell's"),
    RatioSpec("decode_vs_no_buffer", "decode_tok_s", "baseline_cell", "decode_tok_s", "lower", "throughput", "decode tok/s of one request / the no_buffer cell's"),
    RatioSpec("decode_concurrent_vs_no_buffer", "decode_tok_s_concurrent", "baseline_cell", "decode_tok_s_concurrent", "lower", "throughput",
              "decode tok/s of N concurrent requests / the no_buffer cell's"),
    RatioSpec("mamba_peak_vs_no_buffer", "mamba_peak_used", "baseline_cell", "mamba_peak_used", "higher", "memory", "peak mamba slots used / the no_buffer cell's"),
    RatioSpec("resident_vs_extra_buffer", "track_slots_per_request", "extra_buffer_cell", "track_slots_per_request", "higher", "memory",
              "resident track slots per running request / the extra_buffer cell's (lazy claim: about half)"),
    RatioSpec("mamba_peak_vs_extra_buffer", "mamba_peak_used", "extra_buffer_cell", "mamba_peak_used", "higher", "memory",
              "peak mamba slots used / the extra_buffer cell's"),
)
RATIO_BY_NAME = {r.name: r for r in RATIOS}
#: Default relative worsening compare tolerates per ratio kind, from the spread measured
#: over three back-to-back ``--suite perf --tier premerge --models qwen3-next`` runs on
#: sglang-cpu on the shared 2-core machine (docs/perf.md, "Measured spread"):
#: ``time`` (TTFT ratios): clean pairs worsened by up to +356%, always inside the two
#: runs' intervals, so never flagged; 0.5 flags the seeded ``track_path_slowdown``.
#: ``throughput`` (decode tok/s against the no_buffer cell): each cell is timed at a
#: different moment, and outside load on the machine moved whole cells -- a clean pair
#: worsened by +530% outside both intervals -- so the default sits above that (on a quiet
#: machine or a GPU box, set ``--perf-threshold``).  ``memory`` (counted slots): 0% spread.
DEFAULT_THRESHOLDS = {"time": 0.5, "throughput": 6.0, "memory": 0.1}


# ------------------------------------------------------------------ blocks
def _metric(cell: Mapping[str, Any], name: str) -> Spread | None:
    verdict = (cell.get("checks") or {}).get("perf") or {}
    got = interval_of(verdict.get("details") or {}, name)
    if got is not None:
        return got
    value = (verdict.get("metrics") or {}).get(name)
    return fixed(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _against(cell: Mapping[str, Any], spec: RatioSpec, by_id: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any] | None:
    if spec.against == "self":
        return cell
    details = ((cell.get("checks") or {}).get("perf") or {}).get("details") or {}
    other = details.get(spec.against)
    return by_id.get(other) if other and other != cell.get("id") else None


def perf_block(cell: Mapping[str, Any], by_id: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The ``perf`` block of one cell (None when its perf check did not run)."""
    verdict = (cell.get("checks") or {}).get("perf")
    if verdict is None:
        return None
    metrics, details = verdict.get("metrics") or {}, verdict.get("details") or {}
    block: dict[str, Any] = {"status": verdict.get("status")}
    for key in BLOCK_NUMBERS:
        block[key] = metrics.get(key)
    ratios: dict[str, float | None] = {}
    bounds: dict[str, list[float]] = {}
    for spec in RATIOS:
        other = _against(cell, spec, by_id)
        if other is None:
            continue
        r = ratio(_metric(cell, spec.metric), _metric(other, spec.base_metric))
        ratios[spec.name] = round(r.median, 4) if r else None
        if r:
            bounds[spec.name] = [round(r.lo, 4), round(r.hi, 4)]
    block.update(
        ratios=ratios,
        ratio_bounds=bounds,
        spread=details.get("spread") or {},
        engine=details.get("engine"),
        timing_source=details.get("timing_source"),
        quiet=details.get("quiet"),
        baseline_cell=details.get("baseline_cell"),
        extra_buffer_cell=details.get("extra_buffer_cell"),
    )
    return block


def attach_perf_blocks(cells: Sequence[dict[str, Any]]) -> None:
    """Give every cell whose perf check ran its ``perf`` block (in place)."""
    by_id = {c.get("id"): c for c in cells if c.get("id")}
    for cell in cells:
        block = perf_block(cell, by_id)
        if block is not None:
            cell["perf"] = block


def validate_perf_block(block: Any, where: str, fail: Callable[[str, str], Exception]) -> None:
    at = f"{where} perf"
    if not isinstance(block, Mapping):
        raise fail(at, "expected an object")
    for key in BLOCK_KEYS:
        if key not in block:
            raise fail(at, f"missing {key!r}")
    for key in BLOCK_NUMBERS:
        if block.get(key) is not None and not _is_number(block[key]):
            raise fail(at, f"{key!r} must be a number or null, got {block[key]!r}")
    if not isinstance(block["ratios"], Mapping) or any(not isinstance(k, str) or (v is not None and not _is_number(v)) for k, v in block["ratios"].items()):
        raise fail(at, "'ratios' must map ratio names to numbers or null")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------ compare
@dataclass(frozen=True)
class RatioChange:
    """One ratio of one cell, old vs new, and whether compare flags it."""

    cell: str
    name: str
    old: float
    new: float
    worse_by: float  # relative worsening (negative: better)
    threshold: float
    in_noise: bool

    @property
    def flagged(self) -> bool:
        return self.worse_by > self.threshold and not self.in_noise


def _worse_by(spec: RatioSpec, old: float, new: float) -> float:
    if old <= 0 or new <= 0:
        return 0.0
    return new / old - 1.0 if spec.worse == "higher" else old / new - 1.0


def _overlap(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    return bool(a and b) and a[0] <= b[1] and b[0] <= a[1]


def ratio_changes(old_cells: Mapping[str, Mapping[str, Any]], new_cells: Mapping[str, Mapping[str, Any]], threshold: float | None = None) -> list[RatioChange]:
    """Every ratio both runs measured for a cell both ran, judged against ``threshold``
    (relative worsening; None: :data:`DEFAULT_THRESHOLDS` by ratio kind)."""
    out = []
    for cid, old_cell in old_cells.items():
        new_cell = new_cells.get(cid)
        old_b, new_b = old_cell.get("perf"), (new_cell or {}).get("perf")
        if not isinstance(old_b, Mapping) or not isinstance(new_b, Mapping):
            continue
        for name, old_v in (old_b.get("ratios") or {}).items():
            new_v = (new_b.get("ratios") or {}).get(name)
            spec = RATIO_BY_NAME.get(name)
            if spec is None or not _is_number(old_v) or not _is_number(new_v):
                continue
            limit = DEFAULT_THRESHOLDS[spec.kind] if threshold is None else threshold
            noise = _overlap((old_b.get("ratio_bounds") or {}).get(name), (new_b.get("ratio_bounds") or {}).get(name))
            out.append(RatioChange(cid, name, float(old_v), float(new_v), _worse_by(spec, float(old_v), float(new_v)), limit, noise))
    return out


def note_of(change: RatioChange) -> str:
    spec = RATIO_BY_NAME[change.name]
    return f"{spec.text}: {change.worse_by:+.0%} worse (threshold {change.threshold:.0%}; outside both runs' intervals)"


# ------------------------------------------------------------------ display
def perf_rows(cells: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table rows: cell, engine, TTFT cold/hit, decode 1/N, peaks, then each ratio present."""
    names = [r.name for r in RATIOS if any(r.name in ((c.get("perf") or {}).get("ratios") or {}) for c in cells)]
    head = ["cell", "ttft cold s", "ttft hit s", "decode tok/s (1 / N)", "mamba peak", "track slots/req", *names]
    rows = [head]
    for cell in cells:
        b = cell.get("perf")
        if not isinstance(b, Mapping):
            continue
        ratios = b.get("ratios") or {}
        rows.append([
            str(cell["id"]), _num(b.get("ttft_cold_s")), _num(b.get("ttft_hit_s")),
            f"{_num(b.get('decode_tok_s'))} / {_num(b.get('decode_tok_s_concurrent'))}",
            _num(b.get("mamba_peak_used")), _num(b.get("track_slots_per_request")),
            *(_num(ratios.get(n)) if n in ratios else "" for n in names),
        ])
    return rows if len(rows) > 1 else []


def engines(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({str(c["perf"].get("engine")) for c in cells if isinstance(c.get("perf"), Mapping) and c["perf"].get("engine")})


def cell_ratio(cell: Mapping[str, Any], name: str) -> float | None:
    """The cell's ratio ``name`` as a number (None: no perf block, no such ratio, or not a number)."""
    value = ((cell.get("perf") or {}).get("ratios") or {}).get(name)
    return float(value) if _is_number(value) else None


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
