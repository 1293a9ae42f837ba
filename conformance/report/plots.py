"""PNG plots for report.html, drawn with matplotlib's object API (Agg, no pyplot state).

Three kinds: KL per token position for each cell (track boundaries as vertical
lines), pool occupancy over time for each strategy (from the leaks timeline) and
GSM8K accuracy with Wilson intervals for all cells.  A plot without data is a
:class:`Plot` with ``path=None`` and a ``note`` saying why, never an exception.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from matplotlib.figure import Figure

_DPI = 100


@dataclass(frozen=True)
class Plot:
    """One plot slot in the report: a PNG (``path``) or a note why there is none."""

    key: str
    title: str
    path: Path | None = None
    note: str = ""


def draw_all(report: Mapping[str, Any], plot_dir: Path) -> list[Plot]:
    """Write every plot of ``report`` into ``plot_dir``; return them in display order."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    cells = list(report.get("cells", [])) + list(report.get("disagg", []))
    return [*kl_plots(cells, plot_dir), *occupancy_plots(cells, plot_dir), gsm8k_plot(cells, plot_dir)]


def safe_name(text: str) -> str:
    """A file-name-safe form of a cell id or strategy name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "unnamed"


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, format="png")
    return path


def _pairs(rows: Any, width: int) -> list[list[float]]:
    """Rows of at least ``width`` numbers; anything else is dropped."""
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, (list, tuple)) and len(row) >= width:
            vals = row[:width]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
                out.append([float(v) for v in vals])
    return out


# ------------------------------------------------------------------ KL


def kl_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """One PNG per cell with a KL check: per-position KL, boundaries as vertical lines."""
    plots = []
    for cell in cells:
        verdict = cell.get("checks", {}).get("kl")
        if verdict is None:
            continue
        key, title = f"kl_{safe_name(cell['id'])}", f"KL per token position: {cell['id']}"
        details = verdict.get("details") or {}
        points = _pairs(details.get("per_position"), 2)
        if not points:
            why = f"check {verdict.get('status')}" + (f": {verdict['reason']}" if verdict.get("reason") else "")
            plots.append(Plot(key, title, note=f"no per-position KL recorded ({why})"))
            continue
        boundaries = [b for b in details.get("boundaries") or [] if isinstance(b, (int, float)) and not isinstance(b, bool)]
        fig = Figure(figsize=(7, 3))
        ax = fig.add_subplot()
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker=".", markersize=3, linewidth=1, color="tab:blue", label="KL(pos)")
        for i, b in enumerate(boundaries):
            ax.axvline(b, color="tab:red", linestyle="--", linewidth=0.8, label="track boundary" if i == 0 else None)
        floor = (verdict.get("metrics") or {}).get("noise_floor")
        if isinstance(floor, (int, float)) and floor > 0:
            ax.axhline(floor, color="grey", linestyle=":", linewidth=0.8, label="noise floor")
        ax.set_xlabel("token position")
        ax.set_ylabel("KL")
        ax.set_title(f"{cell['id']} ({verdict.get('status')})", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        plots.append(Plot(key, title, _save(fig, plot_dir / f"{key}.png")))
    return plots


# ------------------------------------------------------------------ pool occupancy


def occupancy_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """One PNG per strategy: mamba and KV pool usage over time, one line per cell."""
    by_strategy: dict[str, list[tuple[str, list[list[float]]]]] = {}
    for cell in cells:
        verdict = cell.get("checks", {}).get("leaks")
        if verdict is None:
            continue
        rows = _pairs((verdict.get("details") or {}).get("timeline"), 3)
        by_strategy.setdefault(str(cell.get("strategy", "?")), []).append((cell["id"], rows))
    plots = []
    for strategy, series in by_strategy.items():
        key, title = f"pool_{safe_name(strategy)}", f"Pool occupancy over time: {strategy}"
        series = [(cid, rows) for cid, rows in series if rows]
        if not series:
            plots.append(Plot(key, title, note=f"no leaks timeline recorded for any {strategy} cell"))
            continue
        fig = Figure(figsize=(7, 4.5))
        ax_mamba, ax_kv = fig.subplots(2, 1, sharex=True)
        for cid, rows in series:
            rows.sort()
            ts = [r[0] for r in rows]
            line = ax_mamba.plot(ts, [r[1] for r in rows], linewidth=1, label=cid)[0]
            ax_kv.plot(ts, [r[2] for r in rows], linewidth=1, color=line.get_color())
        ax_mamba.set_ylabel("mamba slots used")
        ax_kv.set_ylabel("KV tokens used")
        ax_kv.set_xlabel("time (s)")
        ax_mamba.set_title(f"pool occupancy: {strategy}", fontsize=9)
        ax_mamba.legend(fontsize=6, loc="upper right")
        plots.append(Plot(key, title, _save(fig, plot_dir / f"{key}.png")))
    return plots


# ------------------------------------------------------------------ GSM8K


def wilson_interval(accuracy: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (fallback when a verdict lacks it)."""
    if n <= 0 or not math.isfinite(accuracy):
        return 0.0, 1.0
    from scipy.stats import binomtest

    ci = binomtest(min(max(round(accuracy * n), 0), n), n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def gsm8k_plot(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> Plot:
    """One PNG: accuracy per cell as a point with its Wilson interval as error bar."""
    key, title = "gsm8k_accuracy", "GSM8K accuracy with Wilson intervals"
    rows = []
    for cell in cells:
        verdict = cell.get("checks", {}).get("gsm8k")
        if verdict is None:
            continue
        m, d = verdict.get("metrics") or {}, verdict.get("details") or {}
        acc, n = m.get("accuracy"), m.get("n")
        if not isinstance(acc, (int, float)) or isinstance(acc, bool) or not math.isfinite(acc):
            continue
        low, high = m.get("wilson_low"), d.get("wilson_high")
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
            low, high = wilson_interval(float(acc), int(n or 0))
        rows.append((cell["id"], float(acc), float(low), float(high), verdict.get("status")))
    if not rows:
        return Plot(key, title, note="no GSM8K accuracy recorded in this run")
    fig = Figure(figsize=(7, 1.2 + 0.35 * len(rows)))
    ax = fig.add_subplot()
    colours = {"pass": "tab:green", "fail": "tab:red", "skip": "tab:grey"}
    for y, (cid, acc, low, high, status) in enumerate(rows):
        ax.errorbar(
            acc, y, xerr=[[max(0.0, acc - low)], [max(0.0, high - acc)]], fmt="o", capsize=3, color=colours.get(status, "black")
        )
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("accuracy (95% Wilson interval)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", linewidth=0.3)
    return Plot(key, title, _save(fig, plot_dir / f"{key}.png"))
