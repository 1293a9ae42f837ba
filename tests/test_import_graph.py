"""No import circles in ``conformance/``, between modules or between packages.

Every ``import`` counts: at module level and inside functions and methods (a deferred
import hides a cycle from Python, not from this test).  Relative imports are resolved, and
``from pkg import name`` is an edge to the submodule ``pkg.name`` where there is one, else
to ``pkg``.  Package nodes are the direct subpackages and top-level modules of
``conformance``; an import inside one of them is internal.  The finder is shown to fail on
a seeded cycle, so a green run cannot be vacuous.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "conformance"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``where`` (``path:line``)."""

    source: str
    target: str
    where: str


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) for every ``.py`` under the package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imported(node: ast.Import | ast.ImportFrom, base: str, mods: dict) -> list[str]:
    """The modules an import statement takes something from: for ``from m import n``, the
    submodule ``m.n`` where there is one, else ``m``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        parts = base.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        module = ".".join(parts + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" if f"{module}.{alias.name}" in mods else module for alias in node.names]


def import_edges(root: Path, package: str = PACKAGE) -> list[Edge]:
    """Every import between two modules of the package, wherever in the file it stands."""
    mods = _modules(root, package)
    edges = []
    for name, (path, is_pkg) in mods.items():
        base = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                where = f"{path.relative_to(root)}:{node.lineno}"
                edges += [Edge(name, t, where) for t in dict.fromkeys(_imported(node, base, mods)) if t in mods and t != name]
    return edges


def package_of(module: str, package: str = PACKAGE) -> str:
    """The package-level node of a module: ``conformance.<first part>``."""
    return ".".join(module.split(".")[:2]) if module.startswith(package + ".") else module


def package_edges(edges: list[Edge], package: str = PACKAGE) -> list[Edge]:
    """The module edges lifted to package nodes, without those inside one node."""
    lifted = (Edge(package_of(e.source, package), package_of(e.target, package), e.where) for e in edges)
    return [e for e in lifted if e.source != e.target]


def find_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Cycles (each as its edges, in order) covering every node of every strongly connected
    component with more than one node: a shortest cycle through each node not yet shown."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    cycles = []
    for comp in _components(graph):
        shown: set[str] = set()
        for node in comp:
            if node not in shown:
                cycle = _cycle_through(graph, node, set(comp))
                shown.update(e.source for e in cycle)
                cycles.append(cycle)
    return cycles


def _components(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursion depth <= the longest import chain
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return components


def _cycle_through(graph: dict[str, dict[str, Edge]], start: str, inside: set[str]) -> list[Edge]:
    """A shortest cycle through ``start`` (breadth-first inside its component)."""
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, e in sorted(graph[v].items()):
                if w == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if w in inside and w not in came:
                    came[w] = e
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(inside)}")


def describe(cycles: list[list[Edge]]) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join([cycle[0].source] + [e.target for e in cycle]))
        lines += [f"    {e.source} -> {e.target} at {e.where}" for e in cycle]
    return "\n".join(lines)


# ------------------------------------------------------------------ the kit
@pytest.fixture(scope="module")
def kit_edges() -> list[Edge]:
    return import_edges(ROOT)


def test_the_graph_sees_the_kit(kit_edges: list[Edge]) -> None:
    sources = {e.source for e in kit_edges}
    assert len(_modules(ROOT, PACKAGE)) > 100 and len(sources) > 100, "the import graph found no modules: wrong root?"
    assert any(e.source == "conformance.checks.kl" and e.target == "conformance.recordings" for e in kit_edges)


def test_no_cycle_among_modules(kit_edges: list[Edge]) -> None:
    cycles = find_cycles(kit_edges)
    assert not cycles, f"import cycles among modules:\n{describe(cycles)}"


def test_no_cycle_among_packages(kit_edges: list[Edge]) -> None:
    cycles = find_cycles(package_edges(kit_edges))
    assert not cycles, f"import cycles among packages:\n{describe(cycles)}"


# ------------------------------------------------------------------ the finder on seeded cycles
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_finder_sees_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/a.py": "from fake import b\n",
        "fake/b.py": "def late():\n    from . import a\n    return a\n",
        "fake/c.py": "import fake.a\n",
    })
    cycles = find_cycles(import_edges(root, "fake"))
    assert describe(cycles).splitlines()[0] == "fake.a -> fake.b -> fake.a"
    assert [e.where for e in cycles[0]] == [str(Path("fake/a.py")) + ":1", str(Path("fake/b.py")) + ":2"]


def test_finder_sees_a_cycle_between_packages_only(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/x/__init__.py": "",
        "fake/x/m.py": "from ..y.n import thing\n",
        "fake/x/k.py": "",
        "fake/y/__init__.py": "",
        "fake/y/n.py": "thing = 1\n",
        "fake/y/o.py": "class C:\n    def f(self):\n        import fake.x.k\n",
    })
    edges = import_edges(root, "fake")
    assert not find_cycles(edges), "modules alone make no cycle here"
    cycles = find_cycles(package_edges(edges, "fake"))
    assert describe(cycles).splitlines()[0] == "fake.x -> fake.y -> fake.x"


def test_finder_tells_a_submodule_from_a_name_in_the_package(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "fake/__init__.py": "from fake import a\n",
        "fake/a.py": "from fake import b\nfrom . import VERSION\n",
        "fake/b.py": "import os\n",
    })
    edges = import_edges(root, "fake")
    assert {(e.source, e.target) for e in edges} == {("fake", "fake.a"), ("fake.a", "fake.b"), ("fake.a", "fake")}
    assert [describe([c]).splitlines()[0] for c in find_cycles(edges)] == ["fake -> fake.a -> fake"]
    root = _write(tmp_path / "clean", {"fake/__init__.py": "", "fake/a.py": "from fake import b\n", "fake/b.py": "import os\n"})
    assert find_cycles(import_edges(root, "fake")) == []


# ------------------------------------------------------------------ imports at the top
#: At most this many imports of the kit's own modules stand inside a function, each with a
#: ``# deferred: why`` comment on its line (an optional heavy dependency: torch, SGLang's pools).
MAX_DEFERRED = 10


def deferred_imports(root: Path, package: str = PACKAGE) -> list[tuple[str, int, str]]:
    """(file, line, source line) of every import of ``package`` made inside a function."""
    out = []
    for path, _ in _modules(root, package).values():
        text = path.read_text()
        lines = text.splitlines()

        def visit(body: list[ast.stmt], in_function: bool) -> None:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(node.body, True)
                    continue
                if in_function and isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    relative = isinstance(node, ast.ImportFrom) and node.level > 0
                    if relative or any(n.split(".")[0] == package for n in names):
                        out.append((str(path.relative_to(root)), node.lineno, lines[node.lineno - 1].strip()))
                    continue
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        visit(sub, in_function)

        visit(ast.parse(text, str(path)).body, False)
    return out


def deferred_problems(found: list[tuple[str, int, str]], limit: int = MAX_DEFERRED) -> list[str]:
    problems = [f"{f}:{n}: a deferred import without a '# deferred: why' comment: {src}" for f, n, src in found if "# deferred:" not in src]
    if len(found) > limit:
        problems.append(f"{len(found)} imports of the kit inside functions (at most {limit}): move them to the top")
    return problems


def test_the_kits_imports_stand_at_the_top() -> None:
    found = deferred_imports(ROOT)
    assert not deferred_problems(found), "\n".join(deferred_problems(found))


def test_the_deferred_import_count_sees_a_hidden_import(tmp_path: Path) -> None:
    root = _write(tmp_path, {
        "fake/__init__.py": "",
        "fake/a.py": "def f():\n    from fake import b  # deferred: heavy\n    return b\n",
        "fake/b.py": "class C:\n    def g(self):\n        if True:\n            import fake.a\n",
    })
    found = deferred_imports(root, "fake")
    assert [(f, n) for f, n, _ in found] == [("fake/a.py", 2), ("fake/b.py", 4)]
    assert deferred_problems(found) == ["fake/b.py:4: a deferred import without a '# deferred: why' comment: import fake.a"]
    assert deferred_problems(found, limit=1)[-1] == "2 imports of the kit inside functions (at most 1): move them to the top"
