"""docs/architecture.md stays true to the tree: every package under ``conformance/`` is
named in it, and every module or package path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

#: ``conformance/x/y.py``, ``conformance/x/``, ``conformance/x`` and ``conformance.x.y`` in the doc.
_PATH = re.compile(r"conformance(?:/[A-Za-z_][\w]*)+(?:\.py)?/?|conformance(?:\.[A-Za-z_]\w*)+")


def packages(root: Path) -> list[str]:
    """Every package under ``conformance/`` as ``conformance/a/b``."""
    base = root / "conformance"
    return sorted(str(p.parent.relative_to(root)) for p in base.rglob("__init__.py") if p.parent != base)


def named_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))


def _exists(root: Path, name: str) -> bool:
    if "/" not in name:  # dotted: a module or a package, or an attribute of a module (a.b.Cls)
        parts = name.split(".")
        for n in range(len(parts), 1, -1):
            path = root.joinpath(*parts[:n])
            if path.with_suffix(".py").is_file():  # a module, or one attribute of it
                return n >= len(parts) - 1
            if (path / "__init__.py").is_file():  # a package: named whole
                return n == len(parts)
        return False
    path = root / name.rstrip("/")
    return path.is_file() if name.endswith(".py") else (path.is_dir() or path.with_suffix(".py").is_file())


def _mentions(text: str, package: str) -> bool:
    dotted = package.replace("/", ".")
    return re.search(rf"(?<![\w/.]){re.escape(package)}(?![\w])|(?<![\w.]){re.escape(dotted)}(?![\w])", text) is not None


def doc_problems(root: Path, text: str) -> list[str]:
    """What in ``text`` is untrue of the tree at ``root``: unnamed packages, missing paths."""
    problems = [f"package {p}/ is not named" for p in packages(root) if not _mentions(text, p)]
    problems += [f"{name} does not exist" for name in sorted(named_paths(text)) if not _exists(root, name)]
    return problems


def test_architecture_doc_matches_the_tree():
    problems = doc_problems(ROOT, DOC.read_text())
    assert not problems, "docs/architecture.md: " + "; ".join(problems)


def test_the_doc_check_finds_an_unnamed_package_and_a_missing_module(tmp_path):
    for pkg in ("conformance", "conformance/named", "conformance/unnamed"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "conformance/named/real.py").write_text("")
    text = "`conformance/named/` holds `conformance/named/real.py` and `conformance/named/gone.py`; `conformance.named.ghost`."
    assert doc_problems(tmp_path, text) == [
        "package conformance/unnamed/ is not named",
        "conformance.named.ghost does not exist",
        "conformance/named/gone.py does not exist",
    ]
    assert doc_problems(tmp_path, text + " conformance/unnamed/") == doc_problems(tmp_path, text)[1:]
