"""The target registry and the one source of options: every target answers what the kit
asks of it (the answers the name comparisons and flag tests used to give), the CLI and the
pytest plugin declare the same selection options, no module outside the registry and the
option parser compares a target's name, no module outside ``conformance/targets/`` branches
on a target's fields, and no module outside the registry and the matrix spells a list of
target names (both scanned in the AST, each rule shown failing on a seeded snippet)."""

from __future__ import annotations

import argparse
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
           t.idle_deadline_s, t.suites, t.runs_by_default("perf"))
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
    flags = (t.perf_label({}).endswith("(not SGLang; reports unknown version)"), needs.gpus, not t.serves_http(), needs.sglang, needs.probe,
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
    assert TARGETS["reference"].lookahead(cell, {}) == 0
    assert TARGETS["sglang-cpu"].lookahead(cell, {"disable_overlap_schedule": False}) == 1
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

