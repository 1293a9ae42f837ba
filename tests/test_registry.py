"""The target registry and the one source of options: every target answers what the kit
asks of it (the answers the name comparisons and flag tests used to give), the CLI and the
pytest plugin declare the same selection options, no module outside the registry and the
option parser compares a target's name, no module outside ``conformance/targets/`` branches
on a target's fields, and no module outside the registry and the matrix spells a list of
target names (both scanned in the AST, each rule shown failing on a seeded snippet)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.matrix import cells as matrix

from conformance.session import options
from conformance.errors import KitError
from conformance.targets import registry
from conformance.targets.registry import PERF_AB, POOL, TARGETS, VALIDATE, target_for

ROOT = Path(__file__).resolve().parents[1]


def test_every_matrix_target_has_one_target_object() -> None:
    assert tuple(TARGETS) == matrix.TARGETS
    assert POOL.name == "pool" and not POOL.serves_http()
    with pytest.raises(KitError, match="unknown value 'nope'"):
        target_for("nope")


# name: (serves_twins, serves_twins with --twins, on_cpu, exact in float32, exact in bfloat16, idle deadline, own suites, perf)
ANSWERS = {
    "reference": (True, True, True, True, True, 5.0, (), False),
    "sglang": (False, True, False, False, False, 45.0, ("perf",), True),
    "sglang-cpu": (True, True, True, True, False, 45.0, ("agreement", "perf"), True),
    "pool": (False, False, True, False, False, 45.0, (), False),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_target_answers_as_the_name_comparisons_did(name: str) -> None:
    t = TARGETS[name]
    got = (t.serves_twins(False), t.serves_twins(True), t.on_cpu(), t.exact_mode({"dtype": "float32"}), t.exact_mode({"dtype": "bfloat16"}),
           t.engine.idle_deadline_s, t.suites, t.runs_by_default("perf"))
    assert got == ANSWERS[name]


# name: the eleven flags the record had before its records and questions, as it answered them:
# (kit_engine, on_gpu, pool_only, needs_sglang, probes_sglang, kit_plugins, serves_pd, pd_probe_refusal, perf, takes_dtype,
#  validates_commands), then (sglang_flags, pd_sglang_flags)
FORMER_FLAGS = {
    "reference": ((True, False, False, False, False, False, True, False, False, False, False), ((), ())),
    "sglang": ((False, True, False, True, True, False, True, False, True, False, True), ((), ("--disaggregation-mode",))),
    "sglang-cpu": ((False, False, False, True, True, True, True, True, True, True, False), (("--device",), ("--disaggregation-mode",))),
    "pool": ((False, False, True, True, False, False, True, False, False, False, False), ((), ())),
}


@pytest.mark.parametrize("name", sorted(FORMER_FLAGS))
def test_the_records_and_questions_answer_as_the_former_flags(name: str) -> None:
    t, needs = TARGETS[name], TARGETS[name].needs()
    flags = (t.engine.perf_label(name, {}).endswith("(not SGLang; reports unknown version)"), needs.gpus, not t.serves_http(), needs.sglang, needs.probe,
             t.loads_kit_plugins(), True,  # every target answered serves_pd (the GSM8K need of PD cells no longer asks it)
             needs.pd_transport, t.runs_by_default("perf"), t.replay_options("bfloat16") == " --dtype bfloat16", t.accepts(VALIDATE))
    assert (flags, (needs.sglang_flags, needs.pd_sglang_flags)) == FORMER_FLAGS[name]


def test_the_name_lists_the_fronts_offer_come_from_the_registry() -> None:
    assert registry.MUTANT_TARGETS == ("reference", "pool", "sglang-cpu") and registry.FUZZ_TARGET == "reference"
    assert registry.HTTP_TARGETS == ("reference", "sglang", "sglang-cpu") and registry.PERF_TARGETS == ("sglang", "sglang-cpu")
    assert registry.accepting(PERF_AB) == ("sglang-cpu",) and registry.accepting(VALIDATE) == ("sglang",)
    assert registry.KIT_ENGINE_TARGETS == ("reference",) and registry.option_users("dtype") == ("sglang-cpu",)
    from conformance.cli import build_parser

    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    choices = {verb: next(a for a in verbs[verb]._actions if "--target" in a.option_strings) for verb in ("mutants", "fuzz", "replay", "perf-ab", "known-bugs")}
    assert {v: (tuple(a.choices), a.default) for v, a in choices.items()} == {
        "mutants": (("reference", "pool", "sglang-cpu"), "reference"), "fuzz": (matrix.TARGETS, "reference"),
        "replay": (("reference", "sglang", "sglang-cpu"), "reference"), "perf-ab": (("sglang-cpu",), "sglang-cpu"),
        "known-bugs": (("reference", "sglang", "sglang-cpu"), "reference"),
    }


def test_pd_answers() -> None:
    from conformance.targets.pd_launch import LAZY_REFUSAL

    lazy = next(c for c in matrix.load_matrix().cells if not c.strategy.pd)
    assert TARGETS["reference"].pd_not_applicable(lazy) == LAZY_REFUSAL
    assert TARGETS["sglang-cpu"].pd_not_applicable(lazy) is None and POOL.pd_not_applicable(lazy) is None
    eager = next(c for c in matrix.load_matrix().cells if c.strategy.pd and "pool" in c.targets)
    with pytest.raises(KitError, match="target 'pool' does not serve PD cells"):
        POOL.pd_spec(eager, SimpleNamespace(target="pool"))
    assert POOL.pd_refusal() is None and TARGETS["reference"].pd_refusal() is None


def test_lookahead_and_served_model() -> None:
    cell = matrix.load_matrix().select(target="sglang", models=["qwen3-next"], strategies=["extra_buffer"], tier="premerge")[0]
    assert TARGETS["reference"].engine.lookahead(cell, {}) == 0
    assert TARGETS["sglang-cpu"].engine.lookahead(cell, {"disable_overlap_schedule": False}) == 1
    assert TARGETS["sglang"].served_model(cell) == cell.model.hf_path and TARGETS["sglang"].served_model(cell, twins=True) == cell.model.twin
    assert TARGETS["pool"].served_model(cell) is None


def test_cli_and_plugin_declare_the_same_selection_options() -> None:
    from conformance.cli import build_parser

    run = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["run"]
    cli = {o: a for a in run._actions for o in a.option_strings}
    group = SimpleNamespace(flags={}, addoption=lambda flag, **kw: group.flags.__setitem__(flag, kw))
    options.add_pytest_options(group, options.PLUGIN_OPTIONS)
    shared = set(group.flags) & set(cli)
    assert {"--target", "--models", "--strategies", "--faults", "--page-sizes", "--tier", "--matrix", "--sglang-launcher",
            "--gpus-per-worker", "--twins", "--dtype", "--gsm8k-dir", "--report-dir"} <= shared
    for flag in shared:
        assert tuple(cli[flag].choices or ()) == tuple(group.flags[flag].get("choices") or ()), flag
    assert "default: sglang-cpu" in group.flags["--target"]["help"]


def test_a_verb_and_the_plugin_resolve_one_command_line_to_the_same_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.cli import build_parser

    for env in ("HYBRID_CONFORMANCE_TARGET", "HYBRID_CONFORMANCE_SGLANG_LAUNCHER", "HYBRID_CONFORMANCE_GSM8K_DIR"):
        monkeypatch.delenv(env, raising=False)
    given = {"--target": "sglang", "--models": "qwen3-next, nemotron-h", "--page-sizes": "1,64", "--tier": "premerge",
             "--gpus-per-worker": "4", "--gsm8k-dir": "/data", "--report-dir": "out", "--server-options": "mixed_chunk=on"}
    args = build_parser().parse_args(["run", *(x for pair in given.items() for x in pair), "--twins"])
    plugin = options.resolve(lambda flag: True if flag == "--twins" else int(given[flag]) if flag == "--gpus-per-worker" else given.get(flag))
    cli = options.options_from_args(args)
    assert cli == plugin and cli.models == ("qwen3-next", "nemotron-h") and cli.page_sizes == (1, 64) and cli.log_dir == Path("out/logs")
    assert options.options_from_args(build_parser().parse_args(["plan"])) == options.resolve(lambda flag: None)  # the defaults agree
    known_bugs = options.options_from_args(build_parser().parse_args(["known-bugs"]))  # a verb without --gpus-per-worker
    assert known_bugs.gpus_per_worker == options.GPUS.default and known_bugs.target == registry.FUZZ_TARGET


def test_run_forwards_the_targets_own_options_only_to_it() -> None:
    from conformance.cli import build_parser

    gpu = options.forward(build_parser().parse_args(["run", "--target", "sglang", "--models", "qwen3-next", "--twins"]))
    assert gpu == ["--models=qwen3-next", "--sglang-launcher=python -m sglang.launch_server", "--gpus-per-worker=1", "--twins"]
    cpu = options.forward(build_parser().parse_args(["run", "--target", "sglang-cpu", "--dtype", "bfloat16"]))
    assert cpu == ["--dtype=bfloat16"]


@pytest.mark.parametrize("argv, refusal", [
    (["--target", "sglang-cpu", "--sglang-launcher", "sglang serve"], "--sglang-launcher applies to --target sglang; the sglang-cpu target"),
    (["--target", "reference", "--dtype", "bfloat16"], "--dtype applies to --target sglang-cpu; the reference target"),
    (["--target", "sglang-cpu", "--twins"], "--twins applies to --target sglang;"),
])
def test_an_option_the_target_does_not_use_is_refused_not_dropped(argv, refusal) -> None:
    from conformance.cli import build_parser

    with pytest.raises(KitError, match=re.escape(refusal)):
        options.forward(build_parser().parse_args(["run", *argv]))


#: A target name compared (==, !=, in, not in) with something called ``target``, or a
#: dispatch table keyed by target names (two or more).
COMPARISON = re.compile(r"""target\)?\s*(==|!=|\bnot in\b|\bin\b)\s*[(\[{]?\s*["'](reference|sglang-cpu|sglang|pool)["']"""
                        r"""|["'](reference|sglang-cpu|sglang|pool)["']\s*(==|!=)\s*[\w.]*target"""
                        r"""|\{\s*["'](reference|sglang-cpu|sglang|pool)["']\s*:[^}]*,\s*["'](reference|sglang-cpu|sglang|pool)["']\s*:""")
#: Where names may be compared: the registry and the option parser.
ALLOWED = {"conformance/targets/registry.py", "conformance/session/options.py"}


def test_the_comparison_pattern_sees_each_form() -> None:
    for line in ('if options.target == "sglang":', 'if endpoint.target in ("reference", "sglang-cpu"):',
                 'if plan.target != "pool":', 'if "sglang-cpu" == self.target:', 'x = {"reference": a, "pool": b}[target]'):
        assert COMPARISON.search(line), line
    for line in ('import sglang', 'md.version("sglang")', 'report["pool"] = pool', 'TARGETS["reference"]'):
        assert not COMPARISON.search(line), line


def test_no_target_name_comparison_outside_the_registry() -> None:
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "conformance").rglob("*.py")) if str(p.relative_to(ROOT)) not in ALLOWED
             for i, line in enumerate(p.read_text().splitlines(), 1) if COMPARISON.search(line)]
    assert not found, "\n".join(found)


# ------------------------------------------------------------------ the AST rules
#: The module that holds the ``Target`` records, and its names that give one.
REGISTRY = "conformance.targets.registry"
TARGET_GIVERS = {"target_for": "call", "TARGETS": "mapping", "_ALL": "mapping", "POOL": "record"}
#: Where a module may ask a target's fields in a test: inside the targets package.
BRANCHES_ALLOWED_UNDER = "conformance/targets/"
#: Where target names may be listed: the registry, and the matrix's ``TARGETS`` it asserts against.
LISTS_ALLOWED = {"conformance/targets/registry.py", "conformance/matrix/cells.py"}
#: (module, constant) -> why a list that spells two target names there is not a list of targets.
LISTS_EXEMPT = {
    ("conformance/commands/history.py", "CHECKS"): "`history --checks` values (a CLI contract): check names, two of them "
                                                   "named after the target their rows run",
}


def _tests(tree: ast.AST) -> list[ast.expr]:
    """Every expression Python tests for truth: if/elif/while/assert tests, ternary tests,
    comprehension conditions, the operands of ``and``/``or`` and of ``not``."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            out.append(node.test)
        elif isinstance(node, ast.comprehension):
            out += node.ifs
        elif isinstance(node, ast.BoolOp):
            out += node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(node.operand)
    return out


class _TargetExprs:
    """Which expressions of one module hold a ``Target`` record: a call of the registry's
    ``target_for``, an item of its ``TARGETS``, its ``POOL``, and the names a function binds to
    those (assignment, a loop over ``TARGETS.values()``/``.items()``, a parameter annotated ``Target``)."""

    def __init__(self, tree: ast.Module) -> None:
        self.local: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == REGISTRY:
                self.local.update({a.asname or a.name: TARGET_GIVERS[a.name] for a in node.names if a.name in TARGET_GIVERS})

    def holds(self, e: ast.expr, bound: set[str]) -> bool:
        kind = self.local.get(e.func.id if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) else "")
        if kind == "call":
            return True
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and self.local.get(e.value.id) == "mapping":
            return True
        if isinstance(e, ast.Name):
            return e.id in bound or self.local.get(e.id) == "record"
        return isinstance(e, ast.IfExp) and self.holds(e.body, bound) and self.holds(e.orelse, bound)

    def iterates_records(self, it: ast.expr) -> bool:
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("values", "items"):
            it = it.func.value
        return isinstance(it, ast.Name) and self.local.get(it.id) == "mapping"

    def bound_in(self, scope: ast.AST) -> set[str]:
        bound: set[str] = set()
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound |= {a.arg for a in (*scope.args.args, *scope.args.kwonlyargs)
                      if a.annotation is not None and ast.unparse(a.annotation).rsplit(".", 1)[-1].strip("'\"") == "Target"}
        for _ in range(2):  # a name bound from a name bound earlier
            for n in ast.walk(scope):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) and self.holds(n.value, bound):
                    bound.add(n.targets[0].id)
                if isinstance(n, (ast.For, ast.comprehension)) and self.iterates_records(n.iter):
                    last = n.target.elts[-1] if isinstance(n.target, ast.Tuple) else n.target
                    if isinstance(last, ast.Name):
                        bound.add(last.id)
        return bound


def target_branches(source: str, path: str = "<snippet>") -> list[str]:
    """``path:line: chain`` for every read of a ``Target`` record's field (or a field of its
    records, ``target.engine.plugins``) inside a truth test; a call that answers
    (``target.serves_http()``, ``target.engine.perf_label(...)``) is not a read."""
    tree = ast.parse(source)
    exprs = _TargetExprs(tree)
    parent = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    found = set()
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))]:
        bound = exprs.bound_in(scope)
        for test in _tests(scope):
            for a in ast.walk(test):
                if not (isinstance(a, ast.Attribute) and exprs.holds(a.value, bound)):
                    continue
                top = a
                while isinstance(parent.get(id(top)), ast.Attribute):
                    top = parent[id(top)]
                up = parent.get(id(top))
                if not (isinstance(up, ast.Call) and up.func is top):
                    found.add(f"{path}:{a.lineno}: {ast.unparse(top)}")
    return sorted(found)


def target_name_lists(source: str, path: str = "<snippet>") -> list[tuple[str, str | None]]:
    """(``path:line: names``, the constant it is assigned to) for every tuple, list or set
    literal with two or more different target-name strings, and every dict literal keyed by two or more."""
    tree = ast.parse(source)
    assigned = {id(n.value): n.targets[0].id for n in ast.walk(tree)
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    out = []
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else []
        names = list(dict.fromkeys(e.value for e in items if isinstance(e, ast.Constant) and e.value in matrix.TARGETS))
        if len(names) >= 2:
            out.append((f"{path}:{node.lineno}: {', '.join(names)}", assigned.get(id(node))))
    return out


def _kit_modules() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "conformance").rglob("*.py"))]


def test_no_module_outside_the_targets_branches_on_a_targets_fields() -> None:
    found = [f for rel, text in _kit_modules() if not rel.startswith(BRANCHES_ALLOWED_UNDER) for f in target_branches(text, rel)]
    assert not found, "ask the target (a method on conformance.targets.registry.Target) instead of testing its fields:\n" + "\n".join(found)


def test_the_branch_rule_sees_the_kit_ask_its_targets() -> None:
    """Not vacuous on the tree: the scanner finds the modules that hold Target records."""
    holders = [rel for rel, text in _kit_modules() if not rel.startswith(BRANCHES_ALLOWED_UNDER) and _TargetExprs(ast.parse(text)).local]
    assert len(holders) >= 15, holders


@pytest.mark.parametrize("snippet", [
    "from conformance.targets.registry import target_for\nif target_for(o).server:\n    pass\n",
    "from conformance.targets.registry import target_for as tf\ndef f(o):\n    t = tf(o)\n    return 1 if t.engine.plugins else 2\n",
    "from conformance.targets.registry import TARGETS\nnames = [n for n, t in TARGETS.items() if t.faults]\n",
    "from conformance.targets.registry import TARGETS\nok = TARGETS['sglang'].placement.cuda and 1\n",
    "from conformance.targets.registry import POOL\nwhile not POOL.forwards:\n    break\n",
    "from conformance.targets.registry import Target\ndef f(t: Target, dest):\n    assert dest in t.forwards\n",
    "from conformance.targets.registry import POOL, target_for\ndef f(o, pool):\n    t = POOL if pool else target_for(o)\n    u = t\n    return [x for x in () if u.name == 'pool']\n",
])
def test_the_branch_rule_fails_on_a_seeded_branch(snippet: str) -> None:
    assert target_branches(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "from conformance.targets.registry import target_for\nif target_for(o).serves_http() and target_for(o).engine.plugin_log(p):\n    pass\n",
    "from conformance.targets.registry import target_for\nflags = target_for(o).forwards\nif flags:\n    pass\n",  # data, then a test of a local
    "from conformance.programs.bind import target_for\nif target_for(ep, cold).exact:\n    pass\n",  # another module's target_for
    "def f(target):\n    if target.kit_plugins:\n        pass\n",  # nothing says it is a Target record
])
def test_the_branch_rule_passes_a_call_that_answers(snippet: str) -> None:
    assert not target_branches(snippet), snippet


def test_no_list_of_target_names_outside_the_registry() -> None:
    found = [(where, const) for rel, text in _kit_modules() if rel not in LISTS_ALLOWED for where, const in target_name_lists(text, rel)
             if (rel, const) not in LISTS_EXEMPT]
    assert not found, "derive the list from conformance.targets.registry:\n" + "\n".join(where for where, _ in found)


def test_every_exempt_list_is_still_there() -> None:
    for rel, const in LISTS_EXEMPT:
        assert const in {c for _, c in target_name_lists((ROOT / rel).read_text(), rel)}, (rel, const)


@pytest.mark.parametrize("snippet", [
    "MUTANT_TARGETS = ('reference', 'pool', 'sglang-cpu')\n",
    "CATALOGUES = {'reference': 1, 'sglang-cpu': 2}\n",
    "def f(t):\n    return t in ['sglang', 'sglang-cpu']\n",
    "CHOICES = {'pool', 'reference', 'other'}\n",
])
def test_the_list_rule_fails_on_a_seeded_list(snippet: str) -> None:
    assert target_name_lists(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "AB_TARGETS = ('sglang-cpu',)\n",
    "pairs = (('served', a), ('reference', b))\n",
    "v = {'sglang': md.version('sglang'), 'torch': 1}\n",
    "argv = ['pytest', '--target', 'pool', '-m', 'pool']\n",
])
def test_the_list_rule_passes_one_name_or_other_words(snippet: str) -> None:
    assert not target_name_lists(snippet), snippet
