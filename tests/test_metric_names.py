"""The ``/metrics`` names are spelled in one module, ``conformance/sglang_contract/metric_names.py``:
no string literal elsewhere in ``conformance/`` spells an ``sglang:`` or ``hybrid_conformance:``
metric name (docstrings and comments may mention them).  Its names are true: SGLang's own are
in SGLang's metrics collector, the kit's are published by its observe plugin."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from conformance.sglang_contract import metric_names

ROOT = Path(__file__).resolve().parents[1]
HOME = Path("conformance/sglang_contract/metric_names.py")
#: ``sglang:name``, ``hybrid_conformance:name`` or a bare prefix, not ``needs sglang: x``.
_NAME = re.compile(r"(?<![\w.-])(?:sglang|hybrid_conformance):(?:\w|$)")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def spelled_names(root: Path, skip: Path | None = HOME) -> list[str]:
    """``path:line: literal`` for each string literal under ``root/conformance`` (f-string parts
    included, docstrings not) that spells a metric name, outside ``skip``."""
    out = []
    for path in sorted((root / "conformance").rglob("*.py")):
        rel = path.relative_to(root)
        if rel == skip:
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and _NAME.search(node.value):
                out.append(f"{rel}:{node.lineno}: {node.value[:80]!r}")
    return out


def test_only_the_metric_names_module_spells_a_metric_name() -> None:
    spelled = spelled_names(ROOT)
    assert not spelled, f"metric names spelled outside {HOME} (import its constant): {spelled}"


def test_the_scan_sees_the_names_where_they_are_spelled() -> None:
    home = [s for s in spelled_names(ROOT, skip=None) if s.startswith(str(HOME))]
    assert any("'sglang:mamba_used_tokens'" in s for s in home) and any("'hybrid_conformance:'" in s for s in home)


def test_the_scan_finds_a_seeded_literal_and_passes_prose(tmp_path: Path) -> None:
    pkg = tmp_path / "conformance"
    pkg.mkdir()
    (pkg / "seeded.py").write_text(
        '"""Reads ``sglang:num_running_reqs`` (a docstring may say so)."""\n'
        'RUNNING = "sglang:num_running_reqs"\n'
        'KIT = "hybrid_conformance:"\n'
        'def f(gauge, e):\n'
        '    """The gauge ``sglang:kv_used_tokens``."""\n'
        '    # a comment: sglang:kv_used_tokens\n'
        '    note = f"pool tier needs sglang: {e}"\n'
        '    return f"sglang:mamba_used_tokens is {gauge}", f"{gauge} > 0", note\n'
    )
    assert spelled_names(tmp_path) == [
        "conformance/seeded.py:2: 'sglang:num_running_reqs'",
        "conformance/seeded.py:3: 'hybrid_conformance:'",
        "conformance/seeded.py:8: 'sglang:mamba_used_tokens is '",
    ]


def _constants(prefix: str) -> dict[str, str]:
    return {k: v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str) and v.startswith(prefix)}


def test_sglangs_own_names_are_in_its_metrics_collector() -> None:
    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector") if importlib.util.find_spec("sglang") else None
    if spec is None or not spec.origin:
        pytest.skip("SGLang's metrics collector is not installed")
    source = Path(spec.origin).read_text()
    own = {k: v for k, v in _constants("sglang:").items() if v not in metric_names.REFERENCE_ONLY}
    assert own and len(own) + len(metric_names.REFERENCE_ONLY) == len(_constants("sglang:"))
    missing = [v for v in own.values() if f'"{v}"' not in source]
    assert not missing, f"not in SGLang's metrics collector ({spec.origin}): {missing}"
    assert not [v for v in metric_names.REFERENCE_ONLY if f'"{v}"' in source], "a reference-only name is SGLang's own now"


def test_the_kits_names_are_published_by_its_observe_plugin() -> None:
    from conformance.sglang_plugins import observe

    published = {metric_names.KIT_PREFIX + n for n in (*observe.READERS, *observe.TRACK_GAUGES, *observe.POOL_GAUGES,
                                                        *observe.EVIDENCE_GAUGES, observe.AUDIT_COST_GAUGE, "idle_publish_seq")}
    kit = set(_constants(metric_names.KIT_PREFIX).values()) - {metric_names.KIT_PREFIX}
    assert kit and not kit - published, sorted(kit - published)
