"""The target registry and the one source of options: every target answers what the kit
asks of it (the answers the name comparisons used to give), the CLI and the pytest plugin
declare the same selection options, and no module outside the registry and the option
parser compares a target's name."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.matrix import cells as matrix

from conformance.session import options
from conformance.errors import KitError
from conformance.targets.registry import POOL, TARGETS, target_for

ROOT = Path(__file__).resolve().parents[1]


def test_every_matrix_target_has_one_target_object() -> None:
    assert tuple(TARGETS) == matrix.TARGETS
    assert POOL.name == "pool" and POOL.pool_only and not POOL.serves_http
    with pytest.raises(KitError, match="unknown value 'nope'"):
        target_for("nope")


# name: (serves_twins, serves_twins with --twins, on_gpu, exact in float32, exact in bfloat16, idle deadline, own suites, perf)
ANSWERS = {
    "reference": (True, True, False, True, True, 5.0, (), False),
    "sglang": (False, True, True, False, False, 45.0, ("perf",), True),
    "sglang-cpu": (True, True, False, True, False, 45.0, ("agreement", "perf"), True),
    "pool": (False, False, False, False, False, 45.0, (), False),
}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_each_target_answers_as_the_name_comparisons_did(name: str) -> None:
    t = TARGETS[name]
    got = (t.serves_twins(False), t.serves_twins(True), t.on_gpu, t.exact_mode({"dtype": "float32"}), t.exact_mode({"dtype": "bfloat16"}),
           t.idle_deadline_s, t.suites, t.perf)
    assert got == ANSWERS[name]


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
    assert known_bugs.gpus_per_worker == options.GPUS.default and known_bugs.target == options.FUZZ_TARGET


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
