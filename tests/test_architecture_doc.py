"""docs/architecture.md stays true to the tree: every package under ``conformance/`` is
named in it, and every module or package path it names exists."""

from __future__ import annotations

import ast
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


# ------------------------------------------------------------------ the doc's claims

def layers(text: str) -> dict[str, int]:
    """The "Dependency direction" list: package node (``conformance.x``) -> its layer number."""
    section = text.split("## Dependency direction", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"(\d+)\. (.*)", line.strip())
        if m:
            for name in re.findall(r"`([\w]+)/?`", m.group(2)):
                out[f"conformance.{name}"] = int(m.group(1))
    return out


def layer_problems(text: str, edges: list) -> list[str]:
    """Package edges that go down the list (or sideways), and packages the list leaves out."""
    order = layers(text)
    nodes = {e.source for e in edges} | {e.target for e in edges}
    problems = [f"{n} is in no layer" for n in sorted(nodes - set(order) - {"conformance"})]
    problems += [f"{e.source} (layer {order[e.source]}) imports {e.target} (layer {order[e.target]}) at {e.where}"
                 for e in edges if e.source in order and e.target in order and order[e.target] >= order[e.source]]
    return problems


def test_every_package_import_goes_up_the_documented_layers():
    from test_import_graph import import_edges, package_edges

    problems = layer_problems(DOC.read_text(), package_edges(import_edges(ROOT)))
    assert not problems, "docs/architecture.md's layers: " + "; ".join(problems)


def test_the_layer_check_finds_an_edge_down_the_list():
    from test_import_graph import Edge

    text = "## Dependency direction\n\n1. `errors`\n2. `matrix/`\n\n## next"
    up = Edge("conformance.matrix", "conformance.errors", "m.py:1")
    down = Edge("conformance.errors", "conformance.matrix", "e.py:1")
    assert layer_problems(text, [up]) == []
    assert layer_problems(text, [up, down]) == ["conformance.errors (layer 1) imports conformance.matrix (layer 2) at e.py:1"]
    assert layer_problems(text, [Edge("conformance.ghost", "conformance.errors", "g.py:1")]) == ["conformance.ghost is in no layer"]


def sglang_importers(root: Path) -> set[str]:
    """Modules of the kit whose code imports ``sglang`` or ``sglang_router`` (any import statement)."""
    out = set()
    for path in (root / "conformance").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] in ("sglang", "sglang_router") for n in names):
                out.add(str(path.relative_to(root)))
    return out


def test_only_the_documented_modules_import_sglang():
    text = DOC.read_text()
    claim = text.split("Only these modules import SGLang's Python packages:", 1)[1].split("\n\n", 1)[0]
    allowed = set(re.findall(r"`(conformance/[\w/]+(?:\.py|/))`", claim))
    outside = sorted(m for m in sglang_importers(ROOT) if not any(m == a or (a.endswith("/") and m.startswith(a)) for a in allowed))
    assert not outside, f"modules import SGLang outside the documented list: {outside}"
    assert "conformance/targets/zygote.py" in sglang_importers(ROOT), "the scan finds a known importer (not vacuous)"
