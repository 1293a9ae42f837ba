"""report.json, schema 1: build it from cell verdicts, validate it, load it from disk.

The shape is a contract read by ``compare``, the Markdown/HTML renderers and by
users' own tooling::

    {"schema": 1, "target", "launches", "wall_s", "complete", "versions",
     "cells": [{"id", "model", "family", "strategy", "fault", [page_size, ...], ["served_model"],
                "checks": {name: {"status", "metrics": {...}, ["reason"], ["details"]}},
                ["server": {"version", ..., "worker", "launch", "alive_at_end"}],
                ["perf": {"ttft_cold_s", "ttft_hit_s", "decode_tok_s", "repeats", "ratios": {name: value}, ...}]}],
     ["cells_not_run"], ["incomplete_reasons"], ["tests": {passed, failed, skipped, errors}],
     ["machine"], ["twins"], ["preflight"], ["disagg": [...]], ["pool": ...], ["summary"], ["generated_at"]}

``complete`` is false when the run did not test everything it selected (interrupted,
stopped early, refused at preflight, nothing selected); ``versions`` holds at least
``kit``, ``sglang``, ``torch`` and ``transformers`` (null when not installed).  A check's
status is ``pass``, ``fail`` (a finding), ``skip`` (a stated reason) or ``error`` (the
check did not complete: the test raised, its setup failed).  Every metric the contract
names for a check is present (``null`` when not measured); every status but ``pass``
carries a ``reason``.  A cell whose ``perf`` check ran has a ``perf`` block
(``conformance.report.perf``: medians, spreads, ``ratios`` inside the run).  A cell the run declared not
applicable is ``{"id", "not_applicable": reason, "checks": {}}``.  Non-finite floats become
``null`` so the file is strict JSON.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from conformance.errors import KitError
from conformance.report.perf import attach_perf_blocks, validate_perf_block

SCHEMA_VERSION = 1
STATUSES = ("pass", "fail", "skip", "error")
VERSION_KEYS = ("kit", "sglang", "torch", "transformers")
TEST_COUNTS = ("passed", "failed", "skipped", "errors")
CELL_KEYS = ("id", "model", "family", "strategy", "fault")  # "id" required, the rest strings when present
OPTIONAL_CELL_KEYS = ("page_size", "track_interval", "cache_variant", "tier")

# The metrics the contract promises per check, in display order.
CHECK_METRICS: dict[str, tuple[str, ...]] = {
    "kl": ("tokens", "k3_mean", "topk_kl_mean", "max_token_kl", "hit_fraction", "noise_floor"),
    "prefix_branching": ("requests", "hits_expected", "hits_observed", "mismatches"),
    "leaks": ("mamba_used_at_idle", "kv_used_at_idle", "leak_log_lines", "lazy_resident_ratio"),
    "gsm8k": ("n", "accuracy", "wilson_low", "agreement"),
    "perf": ("ttft_cold_s", "ttft_hit_s", "decode_tok_s", "repeats"),
}
CHECK_ORDER = tuple(CHECK_METRICS)


class ReportError(KitError):
    """A report is malformed; the message is one line naming the file and the field."""


# ------------------------------------------------------------------ build


def build_report(
    target: str,
    launches: int,
    wall_s: float,
    cells: list[dict],
    *,
    disagg: list[dict] | None = None,
    pool: Any = None,
) -> dict:
    """Assemble a schema-1 report from ``Cell.describe()`` dicts with ``"checks"`` added.

    Each ``checks`` value is a ``Verdict.to_json()`` dict (a ``Verdict`` is converted).
    Entries sharing an id are merged.  Missing contract metrics are filled with
    ``None``; a ``fail``/``skip`` without a reason gets ``"no reason recorded"``.
    The result is validated (:class:`ReportError` on a contract breach) and returned.
    """
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "target": target,
        "launches": launches,
        "wall_s": wall_s,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cells": [_normalise_cell(c) for c in _merge_duplicates(cells)],
    }
    attach_perf_blocks(report["cells"])
    if disagg is not None:
        report["disagg"] = [_normalise_cell(c) for c in _merge_duplicates(disagg)]
    if pool is not None:
        report["pool"] = _jsonable(pool)
    report["summary"] = status_counts(report["cells"] + report.get("disagg", []))
    report = _jsonable(report)
    validate_report(report)
    return report


def _merge_duplicates(cells: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per cell id: later entries add checks and fields the first one lacks."""
    by_id: dict[Any, dict[str, Any]] = {}
    for cell in cells:
        first = by_id.get(cell.get("id"))
        if first is None:
            by_id[cell.get("id")] = dict(cell, checks=dict(cell.get("checks") or {}))
            continue
        for key, value in cell.items():
            if key == "checks":
                first["checks"] = {**dict(value or {}), **first["checks"]}
            else:
                first.setdefault(key, value)
    return list(by_id.values())


def not_applicable(cell: Mapping[str, Any]) -> bool:
    """A cell the run declared not applicable (no check ran, a ``not_applicable`` reason)."""
    return not cell.get("checks") and bool(cell.get("not_applicable"))


def _normalise_cell(cell: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(cell)
    checks = {}
    for name, verdict in dict(cell.get("checks") or {}).items():
        v = verdict.to_json() if hasattr(verdict, "to_json") else dict(verdict)
        metrics = dict(v.get("metrics") or {})
        for key in CHECK_METRICS.get(name, ()):
            metrics.setdefault(key, None)
        v["metrics"] = metrics
        if v.get("status") in ("fail", "skip", "error") and not v.get("reason"):
            v["reason"] = "no reason recorded"
        checks[name] = v
    out["checks"] = checks
    return out


def status_counts(cells: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """How many check verdicts of each status the cells hold."""
    counts = dict.fromkeys(STATUSES, 0)
    for cell in cells:
        for verdict in cell.get("checks", {}).values():
            if verdict.get("status") in counts:
                counts[verdict["status"]] += 1
    return counts


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy scalars -> Python, tuples -> lists, NaN/inf -> None."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# ------------------------------------------------------------------ validate


def validate_report(report: Any, source: str = "report") -> None:
    """Raise :class:`ReportError` (one line: source, field, rule) unless ``report`` is schema 1."""

    def fail(where: str, rule: str) -> ReportError:
        return ReportError(f"{source}: {where}: {rule}")

    if not isinstance(report, Mapping):
        raise fail("top level", f"expected a JSON object, got {type(report).__name__}")
    if report.get("schema") != SCHEMA_VERSION:
        raise fail("schema", f"unsupported schema {report.get('schema')!r} (this kit reads schema {SCHEMA_VERSION})")
    for key in ("target", "launches", "wall_s", "cells"):
        if key not in report:
            raise fail("top level", f"missing required key {key!r}")
    if not isinstance(report["target"], str):
        raise fail("target", f"must be a string, got {report['target']!r}")
    if not _is_int(report["launches"]) or report["launches"] < 0:
        raise fail("launches", f"must be a non-negative integer, got {report['launches']!r}")
    if not _is_number(report["wall_s"]) or report["wall_s"] < 0:
        raise fail("wall_s", f"must be a non-negative number, got {report['wall_s']!r}")
    if "complete" in report and not isinstance(report["complete"], bool):
        raise fail("complete", f"must be true or false, got {report['complete']!r}")
    if "versions" in report:
        if not isinstance(report["versions"], Mapping):
            raise fail("versions", "must be an object")
        for key in VERSION_KEYS:
            if key not in report["versions"]:
                raise fail("versions", f"missing {key!r}")
    if "tests" in report:
        if not isinstance(report["tests"], Mapping) or any(not _is_int(report["tests"].get(k)) for k in TEST_COUNTS):
            raise fail("tests", f"must hold integer counts {', '.join(TEST_COUNTS)}")
    for key in ("cells_not_run", "cells_partly_run"):
        if key in report and not (isinstance(report[key], list) and all(isinstance(c, str) for c in report[key])):
            raise fail(key, "must be a list of cell ids")
    for group in ("cells", "disagg"):
        if group not in report:
            continue
        if not isinstance(report[group], list):
            raise fail(group, "must be a list")
        seen: set[str] = set()
        for i, cell in enumerate(report[group]):
            _validate_cell(cell, f"{group}[{i}]", fail)
            if cell["id"] in seen:
                raise fail(f"{group}[{i}]", f"duplicate cell id {cell['id']!r}")
            seen.add(cell["id"])


def _validate_cell(cell: Any, where: str, fail) -> None:
    if not isinstance(cell, Mapping):
        raise fail(where, "expected an object")
    if not isinstance(cell.get("id"), str) or not cell["id"]:
        raise fail(where, f"'id' must be a non-empty string, got {cell.get('id')!r}")
    for key in CELL_KEYS[1:]:
        if key in cell and not isinstance(cell[key], str):
            raise fail(where, f"{key!r} must be a string, got {cell[key]!r}")
    where = f"cell {cell['id']}"
    checks = cell.get("checks")
    if not isinstance(checks, Mapping):
        raise fail(where, "'checks' must be an object")
    for name, verdict in checks.items():
        at = f"{where} check {name}"
        if not isinstance(verdict, Mapping):
            raise fail(at, "expected an object")
        if verdict.get("status") not in STATUSES:
            raise fail(at, f"status must be one of {', '.join(STATUSES)}, got {verdict.get('status')!r}")
        if verdict["status"] != "pass" and not isinstance(verdict.get("reason"), str):
            raise fail(at, f"a {verdict['status']} needs a 'reason' string")
        metrics = verdict.get("metrics")
        if not isinstance(metrics, Mapping):
            raise fail(at, "'metrics' must be an object")
        for key in CHECK_METRICS.get(name, ()):
            if key not in metrics:
                raise fail(at, f"missing metric {key!r}")
            if metrics[key] is not None and not _is_number(metrics[key]):
                raise fail(at, f"metric {key!r} must be a number or null, got {metrics[key]!r}")
        if "details" in verdict and not isinstance(verdict["details"], Mapping):
            raise fail(at, "'details' must be an object")
    if "perf" in cell:
        validate_perf_block(cell["perf"], where, fail)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------ disk


def dump_report(report: Mapping[str, Any]) -> str:
    """Strict-JSON text of a report (indented, key order kept)."""
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


def load_report(path: str | Path) -> dict:
    """Read and validate a report.json; any problem is one :class:`ReportError` line."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ReportError(f"{p}: report file not found") from None
    except OSError as e:
        raise ReportError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    validate_report(report, str(p))
    return report


# ------------------------------------------------------------------ display helpers


def check_names(cells: Iterable[Mapping[str, Any]]) -> list[str]:
    """Check names present in any cell: the contract's order first, then the rest sorted."""
    present: set[str] = set()
    for cell in cells:
        present.update(cell.get("checks", {}))
    return [c for c in CHECK_ORDER if c in present] + sorted(present - set(CHECK_ORDER))


def key_numbers(check: str, verdict: Mapping[str, Any]) -> str:
    """The few numbers worth a glance in a summary table cell, as short text."""
    m = verdict.get("metrics") or {}
    d = verdict.get("details") or {}
    parts: list[str] = []
    if check == "kl":
        parts = [_kv("topk", m.get("topk_kl_mean")), _kv("k3", m.get("k3_mean")), _kv("max", m.get("max_token_kl"))]
    elif check == "prefix_branching":
        if m.get("hits_observed") is not None or m.get("hits_expected") is not None:
            parts = [f"hits {_num(m.get('hits_observed'))}/{_num(m.get('hits_expected'))}"]
        parts.append(_kv("mism", m.get("mismatches")))
    elif check == "leaks":
        parts = [_kv("mamba", m.get("mamba_used_at_idle")), _kv("kv", m.get("kv_used_at_idle")), _kv("lazy", m.get("lazy_resident_ratio"))]
    elif check == "perf":
        parts = [_kv("cold", m.get("ttft_cold_s")), _kv("hit", m.get("ttft_hit_s")), _kv("dec", m.get("decode_tok_s"))]
    elif check == "gsm8k" and m.get("mode") == "agreement":
        agree = m.get("agreement")
        parts = [f"agreement mode: {agree:.0%} identical to baseline" if isinstance(agree, (int, float)) else "agreement mode", _kv("n", m.get("n"))]
    elif check == "gsm8k":
        acc = m.get("accuracy")
        if acc is not None:
            low, high = m.get("wilson_low"), d.get("wilson_high")
            interval = f" [{_num(low)}, {_num(high)}]" if low is not None and high is not None else ""
            parts = [f"acc {_num(acc)}{interval}", _kv("n", m.get("n"))]
    else:
        parts = [_kv(k, v) for k, v in list(m.items())[:3] if _is_number(v)]
    return " ".join(p for p in parts if p)


def _kv(name: str, value: Any) -> str:
    return "" if value is None else f"{name}={_num(value)}"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def count_line(report: Mapping[str, Any]) -> str:
    """The one counts line every format prints: check verdicts, then pytest's test counts."""
    counts = report.get("summary") or status_counts(list(report["cells"]) + list(report.get("disagg", [])))
    line = "checks: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
    tests = report.get("tests")
    if isinstance(tests, Mapping):
        line += "; tests: " + ", ".join(f"{tests.get(k, 0)} {k}" for k in TEST_COUNTS)
    return line


def completeness_line(report: Mapping[str, Any]) -> str | None:
    """None for a complete run; else one line saying what did not run and why."""
    if report.get("complete", True):
        return None
    why = "; ".join(report.get("incomplete_reasons") or []) or "not every selected test ran"
    missing = list(report.get("cells_not_run") or [])
    partly = list(report.get("cells_partly_run") or [])
    tail = ""
    if missing:
        tail += f"; cells not run: {', '.join(missing[:6])}" + (f" (+{len(missing) - 6})" if len(missing) > 6 else "")
    if partly:
        tail += f"; cells partly run: {', '.join(partly[:6])}" + (f" (+{len(partly) - 6})" if len(partly) > 6 else "")
    return f"INCOMPLETE: {why}{tail}"


def versions_line(report: Mapping[str, Any]) -> str | None:
    """kit, SGLang, torch, transformers versions and the twins' weight hashes, in one line."""
    v = report.get("versions")
    if not isinstance(v, Mapping):
        return None
    parts = [f"{k} {v.get(k) or 'not installed'}" for k in VERSION_KEYS]
    servers = sorted({str(c.get("server", {}).get("version")) for c in report.get("cells", []) if isinstance(c.get("server"), Mapping) and c["server"].get("version")})
    if servers:
        parts.append(f"server {', '.join(servers)}")
    twins = report.get("twins")
    if isinstance(twins, Mapping) and twins:
        parts.append("twins " + ", ".join(f"{n} {str((t or {}).get('weights_sha256') or 'not generated')[:12]}" for n, t in twins.items()))
    return "; ".join(parts)


def model_label(cell: Mapping[str, Any]) -> str:
    """The model a cell served: the twin's name (with the model it stands for) where twins ran."""
    served, model = cell.get("served_model"), cell.get("model", "")
    if served and served != model and not str(served).startswith(("/", "http")) and "/" not in str(served):
        return f"{served} (for {model})"
    return str(model or served or "")


def variant_label(cell: Mapping[str, Any]) -> str:
    """What tells a cell apart inside its model x strategy square: page, interval, fault, variant."""
    parts = []
    if cell.get("page_size") is not None:
        parts.append(f"p{cell['page_size']}")
    if cell.get("track_interval") is not None:
        parts.append(f"t{cell['track_interval']}")
    if cell.get("fault") not in (None, "none"):
        parts.append(str(cell["fault"]))
    if cell.get("cache_variant") not in (None, "radix"):
        parts.append(str(cell["cache_variant"]))
    return " ".join(parts) or str(cell.get("id", ""))


def cell_status(cell: Mapping[str, Any]) -> str:
    """The worst status among a cell's checks (fail > error > pass > skip)."""
    rank = {"fail": 3, "error": 2, "pass": 1, "skip": 0}
    statuses = [v.get("status") for v in cell.get("checks", {}).values()]
    return max(statuses, key=lambda s: rank.get(s, 0)) if statuses else "skip"
