"""The SGLang-facing adapter layer: feature probes and what follows from them, the
release-tolerant validator's n/a and granite rewrite, the per-release install pins.

The probe of the installed SGLang is checked against what that release really has (no
recorded answers); the derived answers are checked on constructed Features records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.sglang_api import probes, validate
from conformance.sglang_api.release_pins import pins_for, release_of

ROOT = Path(__file__).resolve().parents[1]
H = "openai-harmony==0.0.4"
OLD = probes.Features(
    version="0.5.12", strategy_flag=probes.OLD_STRATEGY_FLAG, strategies=("auto", "no_buffer", "extra_buffer"),
    mamba_radix_cache=True, release_insert_kwarg="is_insert", general_plugins=True, oot_platforms=True, hook_registry=True,
    extra_buffer_gate="server_args", tree_class="MambaRadixCache",
)
NEW = probes.Features(
    version="0.5.23", strategy_flag=probes.NEW_STRATEGY_FLAG, strategies=("auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"),
    req_kv=True, checkpoint_kv_cache=True, unified_components=True, release_insert_kwarg="checkpoint",
    override_platform=True, granite_new_layer_names=True, general_plugins=True, oot_platforms=True,
    platform_extra_buffer_answer=True, hook_registry=True, extra_buffer_gate="platform", tree_class="UnifiedRadixCache",
    tree_cores=("python", "rust"), test_switches=("SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL"),
)


def test_probes_module_does_not_import_sglang():
    code = "import sys, conformance.sglang_api.probes, conformance.sglang_api.validate; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-500:]


def test_summary_is_one_line_naming_each_probe_and_its_consequence():
    line = OLD.summary()
    assert "\n" not in line and line.startswith("sglang 0.5.12: ")
    assert "lazy strategy absent -> lazy cells not applicable" in line
    assert "pool driver legacy" in line and "release_kv_cache(*, is_insert)" in line
    assert "granite configs rewritten" in line and "tree MambaRadixCache" in line
    assert "extra_buffer device gate in ServerArgs._handle_mamba_radix_cache (answered by the CPU plugin's hook)" in line
    split = dataclasses.replace(OLD, extra_buffer_gate_method="_validate_mamba_extra_buffer").summary()
    assert "extra_buffer device gate in ServerArgs._validate_mamba_extra_buffer (answered" in split  # 0.5.14 onwards
    hook = dataclasses.replace(OLD, extra_buffer_gate_method="arg_groups.mamba_hook.validate_mamba_extra_buffer").summary()
    assert "extra_buffer device gate in arg_groups.mamba_hook.validate_mamba_extra_buffer (answered" in hook  # 0.5.19-0.5.21
    no_gauge = dataclasses.replace(OLD, mamba_used_gauge=False).summary()  # 0.5.11: sglang:mamba_usage only
    assert "no sglang:mamba_used_tokens gauge -> the observe plugin publishes SGLang's PoolStats mamba terms in its place" in no_gauge
    assert "mamba_used_tokens" not in OLD.summary()
    assert "lazy strategy present" in NEW.summary() and "pool driver kv" in NEW.summary()
    assert "answered by the kit's out-of-tree platform" in NEW.summary()
    assert NEW.sglang_cpu_capable and OLD.sglang_cpu_capable


def test_sglang_cpu_gap_names_the_missing_extension_point():
    import dataclasses

    no_plugins = dataclasses.replace(OLD, general_plugins=False)
    assert no_plugins.sglang_cpu_gap == "sglang 0.5.12 has no general plugins (sglang.srt.plugins.load_plugins)"
    assert "sglang-cpu not applicable (sglang 0.5.12 has no general plugins" in no_plugins.summary()
    no_hooks = dataclasses.replace(OLD, hook_registry=False)
    assert "no hook registry" in no_hooks.sglang_cpu_gap and not no_hooks.sglang_cpu_capable
    ungated = dataclasses.replace(OLD, extra_buffer_gate=None)
    assert "extra_buffer cells not applicable on sglang-cpu" in ungated.summary()
    assert OLD.sglang_cpu_gap is None and NEW.sglang_cpu_gap is None


def test_pool_driver_follows_the_lifecycle_probes():
    assert NEW.pool_driver == "kv" and OLD.pool_driver == "legacy"
    half = probes.Features(version="x", req_kv=True, release_insert_kwarg="is_insert")  # no driver fits
    assert half.pool_driver is None and "pool tier not applicable" in half.summary()
    broken = probes.Features(version="0.5.12", import_error="ValueError: 'qwen3_asr' is already used by a Transformers config")
    assert not broken.importable and broken.pool_driver is None
    assert "not importable" in broken.summary() and "qwen3_asr" in broken.summary()


def test_not_applicable_names_the_flag_and_its_choices():
    reason = OLD.not_applicable("extra_buffer_lazy")
    assert reason == "sglang 0.5.12: --mamba-scheduler-strategy has no 'extra_buffer_lazy' (choices: auto, no_buffer, extra_buffer)"
    assert OLD.not_applicable("extra_buffer") is None and NEW.not_applicable("extra_buffer_lazy") is None


def test_installed_sglang_probe_matches_its_code():
    features = probes.probe()
    if not features.importable:
        pytest.skip(f"sglang not importable here: {features.import_error}")
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache import common

    assert features.gather_track_indices == hasattr(schedule_batch, "_gather_mamba_track_indices")
    assert features.checkpoint_kv_cache == hasattr(common, "checkpoint_kv_cache")
    assert features.lazy == ("extra_buffer_lazy" in features.strategies)
    assert features.pool_driver in ("kv", "legacy")


def test_granite_config_is_rewritten_only_for_releases_that_refuse_the_new_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_CONFORMANCE_POOL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "granite"
    folder.mkdir()
    cfg = {"model_type": "granitemoehybrid", "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert validate.config_for_release(folder, NEW) == folder
    legacy = validate.config_for_release(folder, OLD)
    assert legacy != folder
    assert json.loads((legacy / "config.json").read_text())["layer_types"] == ["mamba", "attention", "mamba"]
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "layer_types": ["linear_attention"]}))
    assert validate.config_for_release(other, OLD) == other
    (folder / "model.safetensors").write_text("weights")
    served = validate.config_for_release(folder, OLD, serving=True)
    assert served not in (folder, legacy) and (served / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert json.loads((served / "config.json").read_text())["layer_types"] == ["mamba", "attention", "mamba"]
    assert not (legacy / "model.safetensors").exists()  # the validator's copy stays config-only
    assert validate.config_for_release(folder, NEW, serving=True) == folder


def test_strategy_a_release_predates_is_na_not_refused(monkeypatch):
    args = ["--model-path", "x", probes.OLD_STRATEGY_FLAG, "extra_buffer_lazy"]
    monkeypatch.setattr(validate, "_parser_refusal", lambda a: None)  # SGLang's own line when its parser is here
    v = validate._strategy_na(args, OLD)
    assert v is not None and v.status == "na" and not v.ok
    assert "has no 'extra_buffer_lazy'" in v.message
    assert validate._strategy_na(["--model-path", "x", probes.OLD_STRATEGY_FLAG, "no_buffer"], OLD) is None
    wrong_flag = validate._strategy_na(["--model-path", "x", probes.NEW_STRATEGY_FLAG, "no_buffer"], OLD)
    assert wrong_flag.status == "na" and "it takes --mamba-scheduler-strategy" in wrong_flag.message


def test_validation_status_defaults_from_ok():
    assert validate.Validation(True, "ok").status == "ok"
    assert validate.Validation(False, "AssertionError: x").status == "refused"
    assert validate.Validation(False, "y", status="na").status == "na"


@pytest.mark.parametrize(
    "release, pins",
    [("0.5.11", ("transformers==5.6.0", H)), ("0.5.12", ("transformers==5.6.0", H)), ("0.5.13", ("transformers==5.8.1", H)),
     ("0.5.17", ("transformers==5.8.1", H)), ("0.5.18", ("transformers==5.12.1", H)), ("0.5.22", ()), ("0.5.23", ()), ("0.6.1", ())],
)
def test_release_pins_by_range(release, pins):
    assert pins_for(release) == pins


def test_release_pins_refuse_older_releases_and_parse_specs():
    with pytest.raises(ValueError, match="older than the oldest supported release 0.5.11"):
        pins_for("0.5.10")
    assert release_of("sglang==0.5.13") == "0.5.13" and release_of("0.5.13") == "0.5.13"
    assert release_of("../python") is None and release_of("sglang>=0.5") is None
    out = subprocess.run([sys.executable, str(ROOT / "conformance/sglang_api/release_pins.py"), "0.5.13"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"transformers==5.8.1 {H}"
    bad = subprocess.run([sys.executable, str(ROOT / "conformance/sglang_api/release_pins.py"), "0.4.0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "older than the oldest" in bad.stderr


def test_setup_script_installs_the_release_pins():
    script = (ROOT / "ci" / "setup-cpu.sh").read_text()
    assert 'conformance/sglang_api/release_pins.py' in script
    assert 'SGLANG_PIN="sglang==$SGLANG_PIN"' in script  # HYBRID_CONFORMANCE_SGLANG=0.5.13 works as typed


def test_unusable_sglang_fails_when_the_pool_tier_was_asked_for(monkeypatch):
    from types import SimpleNamespace

    from conformance.sglang_api import pool

    monkeypatch.setattr(pool, "_API", None)
    monkeypatch.setattr(pool, "_ERROR", "sglang 0.5.11 is not importable (ImportError: x)")
    monkeypatch.delenv(pool.REQUIRE_ENV, raising=False)
    from conformance.session.suite_support import pool_tier_asked

    reference = SimpleNamespace(option=SimpleNamespace(target="reference", markexpr=""))
    with pytest.raises(pytest.skip.Exception, match="pool tier needs sglang: sglang 0.5.11"):
        pool.require(pool_tier_asked(reference))
    for option in (SimpleNamespace(target="pool", markexpr=""), SimpleNamespace(target="reference", markexpr="pool and lazy_alloc_fail")):
        with pytest.raises(pytest.fail.Exception, match="pool tier asked for but cannot run: sglang 0.5.11 is not importable"):
            pool.require(pool_tier_asked(SimpleNamespace(option=option)))
    monkeypatch.setenv(pool.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception):
        pool.require()


def test_pool_tier_on_an_unimportable_sglang_exits_non_zero_with_one_line(tmp_path):
    """A stand-in sglang that fails to import the way an old release does with the kit's
    transformers: an explicit pool run fails naming it; an ordinary run skips its pool tests
    (and, having judged nothing else, is not green)."""
    stub = tmp_path / "sglang"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ValueError(\"'qwen3_asr' is already used by a Transformers config, pick another name.\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop("HYBRID_CONFORMANCE_REQUIRE_SGLANG", None)
    base = [sys.executable, "-m", "pytest", str(ROOT / "conformance/suites/leaks/test_pool_invariants.py"), "--tier", "premerge",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-k", "branch_at_chunk_boundary and no_buffer", f"--report-dir={tmp_path / 'r'}"]
    explicit = subprocess.run(base + ["--target", "pool"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert explicit.returncode == 1, explicit.stdout[-2000:]
    assert "pool tier asked for but cannot run" in explicit.stdout and "qwen3_asr" in explicit.stdout
    assert "Traceback" not in explicit.stdout
    ordinary = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # not asked for: the pool tests skip (never fail); a run that judged nothing else is not green
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["tests"]["skipped"] >= 1 and report["tests"]["failed"] == 0 and "failed" not in ordinary.stdout, ordinary.stdout[-2000:]
    assert ordinary.returncode == 1 and report["incomplete_reasons"] == ["nothing was judged: every check of every cell skipped"]


def test_probe_answers_are_kept_per_installation(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRID_CONFORMANCE_PROBE_CACHE", str(tmp_path))
    if probes._cache_file() is None:
        pytest.skip("sglang is not installed here: nothing to key the answers on")
    calls = []
    monkeypatch.setattr(probes, "_probe", lambda: calls.append(1) or NEW)
    probes.probe.cache_clear()
    try:
        assert probes.probe() == NEW and len(calls) == 1
        probes.probe.cache_clear()
        assert probes.probe() == NEW and len(calls) == 1  # answered from the file
        probes._cache_file().unlink()
        probes.probe.cache_clear()
        assert probes.probe() == NEW and len(calls) == 2  # probed again
        monkeypatch.setattr(probes, "_probe", lambda: calls.append(1) or probes.Features(version="0.5.12", import_error="ValueError: x"))
        probes._cache_file().unlink()
        probes.probe.cache_clear()
        assert not probes.probe().importable and not probes._cache_file().exists()  # a failed import is never kept
    finally:
        probes.probe.cache_clear()


def test_probe_answers_are_asked_again_when_an_axis_asks_a_new_flag(monkeypatch, tmp_path):
    """The parser flags asked come from conformance.matrix.axes: a kept answer that never asked a new
    axis value's flag would call it unrecognized (it did, for --mamba-max-states-per-path)."""
    monkeypatch.setenv("HYBRID_CONFORMANCE_PROBE_CACHE", str(tmp_path))
    if probes._cache_file() is None:
        pytest.skip("sglang is not installed here: nothing to key the answers on")
    before = probes._cache_file()
    monkeypatch.setattr(probes, "PARSER_FLAGS", (*probes.PARSER_FLAGS, "--a-new-axis-flag"))
    assert probes._cache_file() != before


def test_a_pool_run_that_ran_nothing_exits_non_zero(tmp_path):
    if not probes.probe().importable:
        pytest.skip("sglang not importable here")
    argv = [sys.executable, "-m", "pytest", str(ROOT / "conformance/suites/leaks/test_pool_invariants.py"), "--target", "pool",
            "--tier", "premerge", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", f"--report-dir={tmp_path}",
            "-k", "test_pool_scenario and session_reuse and no_buffer"]  # a selection the kit never runs
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-2000:]
    assert re.search(r"pool tier ran nothing: all \d+ selected tests were skipped \(first: scenario session_reuse applies to", out.stdout), out.stdout[-2000:]
    ran = subprocess.run(argv[:-1] + ["test_pool_scenario and refused_after_match and no_buffer"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0 and "ran nothing" not in ran.stdout, ran.stdout[-2000:]


def test_fault_hook_targets_are_probed_with_sglangs_own_line():
    """A seeded fault's hook target that a release renamed is answered by the probe (SGLang's
    import/attribute error), and ``mutants`` reports that fault not applicable, unscored."""
    features = probes.probe()
    if not features.importable:
        pytest.skip(f"sglang not importable here: {features.import_error}")
    assert features.missing_hook_targets == ()  # 0.5.23, the release the catalogue was written on
    renamed = "sglang.srt.managers.schedule_batch.ScheduleBatch._no_such_prepare_for_extend"
    ((target, line),) = probes._unresolved((renamed,))
    assert target == renamed and line.startswith("AttributeError: ") and "_no_such_prepare_for_extend" in line
    ((_, gone),) = probes._unresolved(("sglang.srt.no_such_module.fn",))
    assert "no_such_module" in gone and gone.split(":")[0] in ("AttributeError", "ModuleNotFoundError")


def test_mutants_reports_a_fault_whose_hook_is_missing_as_not_applicable(monkeypatch):
    from conformance.errors import KitError
    from conformance.mutants import command
    from conformance.sglang_plugins.faults.catalogue import get_fault

    target = get_fault("double_free").hooks[0].target
    old = probes.Features(version="0.5.99", missing_hook_targets=((target, "AttributeError: gone"),))
    monkeypatch.setattr(probes, "probe", lambda: old)
    assert command.sglang_not_applicable(("double_free", "cow_skipped")) == {"double_free": f"sglang 0.5.99 has no {target}: AttributeError: gone"}
    assert "1 missing -> their faults not applicable" in old.summary()
    with pytest.raises(KitError, match=r"^mutants: no selected fault applies to the installed SGLang \(sglang 0\.5\.99 has no "):
        command.run_mutants(target="sglang-cpu", only="double_free", report_dir=Path("/nonexistent"))


def test_start_asserts_are_probed_from_the_class_source_without_importing(tmp_path, monkeypatch):
    """The two start-up asserts are read from SGLang's source text of the named class only: a
    seeded class with the line answers True; the same line in another class, or no module, False."""
    pkg = tmp_path / "fakesglang_p45"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "backend.py").write_text(
        "raise ImportError('never imported')\n"
        "class Other(object):\n    x = 'must encode to exactly one token'\n"
        f"class Mamba2AttnBackend(Base):\n    def __init__(self):\n        assert a >= b, 'x {probes.MAMBA2_TRACK_FLOOR} (y)'\n"
        "class After(object):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    text = probes._class_source("fakesglang_p45.backend", "Mamba2AttnBackend")
    assert probes.MAMBA2_TRACK_FLOOR in text and probes.THINK_END_SINGLE not in text and "class After" not in text
    assert probes._class_source("fakesglang_p45.backend", "ReasonerGrammarBackend") == ""
    assert probes._class_source("fakesglang_p45.absent", "Mamba2AttnBackend") == ""


def test_a_forced_retract_cell_is_na_where_the_release_lacks_sglangs_retract_switch(monkeypatch):
    """``forced_retract`` sets SGLang's own SGLANG_TEST_RETRACT*: a release whose ``Envs``
    does not declare them would ignore the switch, so its cells are ``na`` before launch with
    the probe's line; where it declares them (0.5.23) the cell launches."""
    from conformance.matrix.cells import load_matrix
    from conformance.targets.registry import target_for

    cell = next(c for c in load_matrix().cells if c.fault.name == "forced_retract")
    declared = dataclasses.replace(NEW, test_switches=("SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL"))
    lacking = dataclasses.replace(NEW, version="0.5.9", test_switches=("SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL",))
    assert declared.test_switch_missing(dict(cell.fault.env)) is None
    line = lacking.test_switch_missing(dict(cell.fault.env))
    assert line.startswith("sglang 0.5.9: sglang.srt.environ.Envs has no SGLANG_TEST_RETRACT") and "ignore" in line
    assert dataclasses.replace(NEW, test_switches=()).test_switch_missing(dict(cell.fault.env)) is None  # declares none: not judged
    assert lacking.test_switch_missing({"HYBRID_CONFORMANCE_SGLANG_FAULT": "x"}) is None  # only SGLang's own switches
    target = target_for("sglang-cpu")
    monkeypatch.setattr(probes, "probe", lambda: lacking)
    assert target.option_refusal(cell) == line
    monkeypatch.setattr(probes, "probe", lambda: declared)
    assert target.option_refusal(cell) is None


def test_installed_sglang_declares_the_retract_switches():
    features = probes.probe()
    if not features.importable:
        pytest.skip(f"sglang not importable here: {features.import_error}")
    assert {"SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL"} <= set(features.test_switches or ())


_FINALIZE = '''
class MambaComponent:
    def finalize_match_result(self, result, params):
        # HiCache can still use prefix matches. We skip
        # branching-state fill in that mode.
        if self.cache.cache_controller is None and result:
            pass
'''


@pytest.mark.parametrize("has_registry, guarded, said", [
    (True, True, "MambaComponent.finalize_match_result: HiCache can still use prefix matches. We skip branching-state fill in that mode."),
    (True, False, None),   # 0.5.17+: branching states filled with HiCache on too
    (False, True, None),   # 0.5.12: HiCache on a hybrid model is HiMambaRadixCache, not the unified tree
])
def test_the_hicache_branch_point_rule_is_probed_with_sglangs_own_words(tmp_path, monkeypatch, has_registry, guarded, said):
    """The release's own source says whether a hybrid model's HiCache tree stores a Mamba
    state at a branch point; the probe answers with SGLang's comment where it does not."""
    name = f"fakesg_{int(has_registry)}{int(guarded)}"  # a package per case: imported modules are cached
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "component.py").write_text(_FINALIZE if guarded else _FINALIZE.replace("self.cache.cache_controller is None and ", ""))
    (pkg / "registry.py").write_text("def default_radix_cache_factory(ctx):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = {"sglang.srt.mem_cache.registry": f"{name}.registry" if has_registry else f"{name}.absent",
             "sglang.srt.mem_cache.unified_cache_components.mamba_component": f"{name}.component"}
    real = probes._module
    monkeypatch.setattr(probes, "_module", lambda name: real(names.get(name, name)))
    assert probes._hicache_branching_skipped() == said


def test_the_prefix_oracle_owes_no_branch_point_state_where_the_release_stores_none():
    """With branching off (a HiCache cell on a release that skips branching states), a
    request admitted on a longer KV prefix than its Mamba hit gets no branch point, so its
    prefill stores only its own checkpoints; with branching on it branches at 192."""
    from conformance.checks.prefix_oracle import PrefixOracle

    first, second = tuple(range(300)), tuple(range(200)) + tuple(range(1000, 1100))
    points = {}
    for branching in (True, False):
        oracle = PrefixOracle("extra_buffer", 64, 1, 256, branching=branching)
        oracle.record_prefill(first)
        points[branching] = oracle.admit(second).branching_seqlen
    assert points == {True: 192, False: None}
