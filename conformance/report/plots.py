"""PNG plots for report.html, drawn with matplotlib's object API (Agg, no pyplot state).

Four kinds: KL per token position for each cell on a log scale (one line per
recording, broken where positions were not measured, the check's limit and the noise
floor as horizontal lines, chunk/track boundaries as vertical ones), pool occupancy
over time for each strategy (from the leaks timeline; PD cells from the disagg check's),
and GSM8K: accuracy with Wilson intervals, and, separately, agreement-mode cells (CPU
twins, where accuracy means nothing) as the fraction identical to the baseline, and the
perf ratios inside the run (from each cell's ``perf`` block).  A plot without data is a
:class:`Plot` with ``path=None`` and a ``note`` saying why, never an exception.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from matplotlib.figure import Figure

from conformance.report.perf import RATIO_BY_NAME, RATIOS, cell_ratio
from conformance.report.schema import model_label, variant_label

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
    return [*kl_plots(cells, plot_dir), *occupancy_plots(cells, plot_dir), *gsm8k_plots(cells, plot_dir), *perf_plots(report.get("cells", []), plot_dir)]


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


#: Checks whose details carry a per-position KL curve or an occupancy timeline.
KL_CHECKS = {"kl": "kl", "disagg": "pd_kl"}
TIMELINE_CHECKS = {"leaks": "pool", "disagg": "pd_pool"}
#: Where a KL of exactly 0 (exact agreement) is drawn on the log axis.
LOG_FLOOR = 1e-18


def segments(points: Sequence[Sequence[float]]) -> list[tuple[list[float], list[float]]]:
    """Split (position, value) points into runs of consecutive positions: a gap in the
    positions is a gap in the line, never a straight join across unmeasured tokens."""
    out: list[tuple[list[float], list[float]]] = []
    for x, y in sorted((p[0], p[1]) for p in points):
        if out and x - out[-1][0][-1] <= 1:
            out[-1][0].append(x)
            out[-1][1].append(y)
        else:
            out.append(([x], [y]))
    return out


def _kl_series(details: Mapping[str, Any]) -> list[tuple[str, list[list[float]]]]:
    series = []
    for i, s in enumerate(details.get("series") or []):
        if isinstance(s, Mapping):
            pts = _pairs(s.get("per_position"), 2)
            if pts:
                series.append((str(s.get("label") or f"recording {i + 1}"), pts))
    if not series:
        pts = _pairs(details.get("per_position"), 2)
        if pts:
            series.append(("KL(pos)", pts))
    return series


def kl_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """One PNG per cell and KL-carrying check: per-position KL on a log axis, lines broken
    at gaps, the check's limit and noise floor drawn, boundaries as vertical lines."""
    plots = []
    for cell in cells:
        for check, prefix in KL_CHECKS.items():
            verdict = cell.get("checks", {}).get(check)
            if verdict is None or (check != "kl" and not _kl_series(verdict.get("details") or {})):
                continue
            plots.append(_kl_plot(cell, check, prefix, verdict, plot_dir))
    return plots


def _kl_plot(cell: Mapping[str, Any], check: str, prefix: str, verdict: Mapping[str, Any], plot_dir: Path) -> Plot:
    what = "KL per token position" if check == "kl" else "PD vs non-PD KL per token position"
    key, title = f"{prefix}_{safe_name(cell['id'])}", f"{what}: {cell['id']}"
    fig = kl_figure(cell, check, verdict)
    if fig is None:
        why = f"check {verdict.get('status')}" + (f": {verdict['reason']}" if verdict.get("reason") else "")
        return Plot(key, title, note=f"no per-position KL recorded ({why})")
    return Plot(key, title, _save(fig, plot_dir / f"{key}.png"))


def kl_figure(cell: Mapping[str, Any], check: str, verdict: Mapping[str, Any]) -> Figure | None:
    """The KL-per-position figure of one verdict (None without a curve)."""
    details = verdict.get("details") or {}
    series = _kl_series(details)
    if not series:
        return None
    metrics = verdict.get("metrics") or {}
    fig = Figure(figsize=(7, 3.2))
    ax = fig.add_subplot()
    ax.set_yscale("log")
    floored = False
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")
    for i, (label, pts) in enumerate(series):
        colour = colours[i % len(colours)]
        for j, (xs, ys) in enumerate(segments(pts)):
            shown = [max(y, LOG_FLOOR) for y in ys]
            floored |= any(y <= LOG_FLOOR for y in ys)
            ax.plot(xs, shown, marker=".", markersize=3, linewidth=1, color=colour, label=label if j == 0 else None, gid=f"kl:{label}")
    for name, style, colour, text in (("topk_limit", "-", "tab:red", "limit"), ("noise_floor", ":", "grey", "noise floor")):
        value = metrics.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            ax.axhline(value, color=colour, linestyle=style, linewidth=1, label=f"{text} {value:.2g}", gid=name)
    boundaries = [b for b in details.get("boundaries") or [] if isinstance(b, (int, float)) and not isinstance(b, bool)]
    for i, b in enumerate(boundaries):
        ax.axvline(b, color="tab:red", linestyle="--", linewidth=0.6, alpha=0.6, label="chunk/track boundary" if i == 0 else None, gid="boundary")
    ax.set_xlabel("token position")
    ax.set_ylabel("top-k KL (log)" + (f"; 0 drawn at {LOG_FLOOR:g}" if floored else ""))
    ax.set_title(f"{cell['id']} {check} ({verdict.get('status')})", fontsize=9)
    ax.legend(fontsize=6, loc="best")
    return fig


# ------------------------------------------------------------------ pool occupancy


def occupancy_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """One PNG per strategy (and per PD strategy): mamba and KV pool usage over time, one line per cell."""
    groups: dict[tuple[str, str], list[tuple[str, list[list[float]]]]] = {}
    for cell in cells:
        for check, prefix in TIMELINE_CHECKS.items():
            verdict = cell.get("checks", {}).get(check)
            if verdict is None:
                continue
            rows = _pairs((verdict.get("details") or {}).get("timeline"), 3)
            if check != "leaks" and not rows:
                continue
            groups.setdefault((prefix, str(cell.get("strategy", "?"))), []).append((cell["id"], rows))
    plots = []
    for (prefix, strategy), series in groups.items():
        what = "Pool occupancy over time" if prefix == "pool" else "PD decode-server pool occupancy over time"
        key, title = f"{prefix}_{safe_name(strategy)}", f"{what}: {strategy}"
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
        ax_mamba.set_title(f"{what.lower()}: {strategy}", fontsize=9)
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


def gsm8k_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """Accuracy-mode cells as accuracy with Wilson intervals; agreement-mode cells (CPU
    twins) in their own plot, as the fraction of answers identical to the baseline."""
    plots = [gsm8k_plot(cells, plot_dir)]
    agreement = gsm8k_agreement_plot(cells, plot_dir)
    if agreement is not None:
        plots.append(agreement)
    return plots


def _gsm8k_verdicts(cells: Sequence[Mapping[str, Any]], mode: str) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    out = []
    for cell in cells:
        verdict = cell.get("checks", {}).get("gsm8k")
        if verdict is None:
            continue
        is_agreement = (verdict.get("metrics") or {}).get("mode") == "agreement"
        if is_agreement == (mode == "agreement"):
            out.append((cell, verdict))
    return out


def gsm8k_plot(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> Plot:
    """One PNG: accuracy per accuracy-mode cell as a point with its Wilson interval as error bar."""
    key, title = "gsm8k_accuracy", "GSM8K accuracy with Wilson intervals"
    rows = []
    agreement_only = bool(_gsm8k_verdicts(cells, "agreement"))
    for cell, verdict in _gsm8k_verdicts(cells, "accuracy"):
        m, d = verdict.get("metrics") or {}, verdict.get("details") or {}
        acc, n = m.get("accuracy"), m.get("n")
        if not isinstance(acc, (int, float)) or isinstance(acc, bool) or not math.isfinite(acc):
            continue
        low, high = m.get("wilson_low"), d.get("wilson_high")
        if not isinstance(low, (int, float)) or not isinstance(high, (int, float)):
            low, high = wilson_interval(float(acc), int(n or 0))
        rows.append((cell["id"], float(acc), float(low), float(high), verdict.get("status")))
    if not rows:
        note = "no GSM8K accuracy recorded in this run"
        if agreement_only:
            note += " (agreement mode on the CPU twins: see the agreement plot; accuracy of random-weight twins means nothing)"
        return Plot(key, title, note=note)
    fig = Figure(figsize=(7, 1.2 + 0.35 * len(rows)))
    ax = fig.add_subplot()
    colours = {"pass": "tab:green", "fail": "tab:red", "skip": "tab:grey", "error": "tab:orange"}
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


def gsm8k_agreement_plot(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> Plot | None:
    """Agreement mode: per cell, the fraction of completions identical to the baseline's."""
    found = _gsm8k_verdicts(cells, "agreement")
    if not found:
        return None
    key, title = "gsm8k_agreement", "GSM8K agreement mode (CPU twins): answers identical to the baseline cell"
    rows = []
    for cell, verdict in found:
        value = (verdict.get("metrics") or {}).get("agreement")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            rows.append((cell["id"], float(value), (verdict.get("metrics") or {}).get("n"), verdict.get("status")))
    if not rows:
        return Plot(key, title, note="agreement mode ran but recorded no agreement fraction")
    fig = Figure(figsize=(7, 1.2 + 0.35 * len(rows)))
    ax = fig.add_subplot()
    colours = {"pass": "tab:green", "fail": "tab:red", "skip": "tab:grey", "error": "tab:orange"}
    for y, (cid, value, n, status) in enumerate(rows):
        ax.barh(y, value, color=colours.get(status, "black"), height=0.6)
        ax.text(min(value, 0.98), y, f" {value:.2f} of n={n}", va="center", ha="right" if value > 0.5 else "left", fontsize=7)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of GSM8K completions identical to the baseline (1 = all)")
    ax.set_title(title, fontsize=9)
    return Plot(key, title, _save(fig, plot_dir / f"{key}.png"))


# ------------------------------------------------------------------ perf ratios
def perf_plots(cells: Sequence[Mapping[str, Any]], plot_dir: Path) -> list[Plot]:
    """The ratio plot as a report :class:`Plot` (none without perf blocks)."""
    if not any(isinstance(c.get("perf"), Mapping) for c in cells):
        return []
    key, title = "perf_ratios", "Perf ratios per model and strategy (inside one run; bars: interval)"
    path = ratio_plot(cells, plot_dir / f"{key}.png")
    return [Plot(key, title, path, "" if path else "perf ran but no ratio could be computed (no sample or no sibling cell)")]


def ratio_plot(cells: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """One panel per ratio: a bar per (model, strategy, variant) with its interval; 1 marked."""
    names = [r.name for r in RATIOS if any(cell_ratio(c, r.name) is not None for c in cells)]
    if not names:
        return None
    fig = Figure(figsize=(8, 2.2 * len(names)))
    axes = fig.subplots(len(names), 1, squeeze=False)[:, 0]
    colours = {"no_buffer": "tab:grey", "extra_buffer": "tab:blue", "extra_buffer_lazy": "tab:orange"}
    for ax, name in zip(axes, names):
        rows = [(c, c["perf"]) for c in cells if cell_ratio(c, name) is not None]
        for x, (cell, block) in enumerate(rows):
            value = float(block["ratios"][name])
            lo, hi = (block.get("ratio_bounds") or {}).get(name) or (value, value)
            ax.bar(x, value, color=colours.get(str(cell.get("strategy")), "tab:purple"), width=0.7)
            ax.errorbar(x, value, yerr=[[max(0.0, value - lo)], [max(0.0, hi - value)]], fmt="none", ecolor="black", capsize=3, linewidth=0.8)
        ax.axhline(1.0, color="black", linewidth=0.6, linestyle=":")
        labels = [f"{model_label(c)}\n{c.get('strategy')} {variant_label(c)}" for c, _ in rows]
        ax.set_xticks(range(len(rows)), labels, fontsize=5, rotation=30, ha="right")
        ax.set_title(f"{name}: {RATIO_BY_NAME[name].text} ({'lower' if RATIO_BY_NAME[name].worse == 'higher' else 'higher'} is better)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    return path
