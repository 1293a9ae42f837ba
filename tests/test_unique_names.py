"""One name, one thing, across ``conformance/``: no two top-level classes share a name, and an
env-var constant (``*_ENV``) names one variable wherever it is bound (an assignment, or an
import ``as`` that name).  Both scans are shown failing on a seeded tree."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*_ENV")


def _modules(root: Path, package: str) -> dict[str, tuple[Path, ast.Module]]:
    """Dotted module name -> (file, syntax tree) for every ``.py`` under ``root/package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (path.relative_to(root), ast.parse(path.read_text(), str(path)))
    return out


def duplicate_classes(root: Path, package: str = "conformance") -> dict[str, list[str]]:
    """Top-level class name -> the files defining it, for names defined more than once."""
    where = defaultdict(list)
    for path, tree in _modules(root, package).values():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path))
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def env_constant_values(root: Path, package: str = "conformance") -> dict[str, dict[str, str]]:
    """``*_ENV`` name -> {value: where} for each module-level binding: ``NAME = "VALUE"``, and
    ``from m import OTHER as NAME`` (the value ``OTHER`` is assigned in ``m``)."""
    mods = _modules(root, package)
    assigned: dict[tuple[str, str], str] = {}
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for module, (path, tree) in mods.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name) and _ENV_NAME.fullmatch(target.id):
                        assigned[(module, target.id)] = node.value.value
                        out[target.id].setdefault(node.value.value, f"{path}:{node.lineno}")
    for module, (path, tree) in mods.items():
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and not node.level:
                for alias in node.names:
                    value = assigned.get((node.module or "", alias.name))
                    if alias.asname and alias.asname != alias.name and _ENV_NAME.fullmatch(alias.asname) and value is not None:
                        out[alias.asname].setdefault(value, f"{path}:{node.lineno}")
    return dict(out)


def env_clashes(root: Path, package: str = "conformance") -> dict[str, dict[str, str]]:
    """The ``*_ENV`` names bound to more than one value."""
    return {name: values for name, values in sorted(env_constant_values(root, package).items()) if len(values) > 1}


def test_no_two_top_level_classes_share_a_name() -> None:
    dups = duplicate_classes(ROOT)
    assert not dups, f"class names defined more than once in conformance/: {dups}"


def test_each_env_constant_names_one_variable() -> None:
    values = env_constant_values(ROOT)
    assert "HYBRID_CONFORMANCE_SGLANG_FAULT" in values["SGLANG_FAULT_ENV"], "the scan sees the kit's env constants (not vacuous)"
    clashes = env_clashes(ROOT)
    assert not clashes, f"*_ENV constants bound to different variables: {clashes}"


def test_the_scans_find_a_seeded_duplicate_class_and_an_env_alias(tmp_path: Path) -> None:
    files = {
        "fake/__init__.py": "",
        "fake/a.py": 'FAULT_ENV = "A_FAULT"\nSGLANG_FAULT_ENV = "SGLANG_FAULT"\nclass Fault:\n    pass\n',
        "fake/b.py": "from fake.a import SGLANG_FAULT_ENV as FAULT_ENV\nfrom fake.a import FAULT_ENV\nclass Fault:\n    def f(self):\n        class Inner: ...\n",
        "fake/c.py": "class Inner:\n    pass\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert duplicate_classes(tmp_path, "fake") == {"Fault": [str(Path("fake/a.py")), str(Path("fake/b.py"))]}
    assert env_clashes(tmp_path, "fake") == {"FAULT_ENV": {"A_FAULT": str(Path("fake/a.py")) + ":1", "SGLANG_FAULT": str(Path("fake/b.py")) + ":1"}}
    (tmp_path / "fake/b.py").write_text("from fake.a import SGLANG_FAULT_ENV\nfrom fake.a import FAULT_ENV\n")
    assert env_clashes(tmp_path, "fake") == {}
