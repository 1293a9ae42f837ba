"""The real-SGLang fault catalogue without a server: every fault is a module naming the SGLang
symbols it hooks, every hook resolves in the installed SGLang and takes effect through
SGLang's own hook registry, the fault reaches (and is proven in) the servers the kit
launches however it is selected, and the index faults compute what they claim on SGLang's
own track-plan function.  (The damage each does on a real server: test_sglang_fault_probes.)"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.sglang_plugins import activation
from conformance.sglang_plugins.faults import catalogue, spec

ROOT = Path(__file__).resolve().parents[1]
KNOWN_REGRESSIONS = ("26941", "15829", "27118", "20522")
BUG_CLASSES = ("lazy", "alloc-fail", "copy-on-write", "off-by-one", "index misalignment", "locked node", "double", "abort", "cached_tokens", "precision")


def _cell(family: str = "qwen3-next", strategy: str = "extra_buffer"):
    return next(c for c in load_matrix().cells if c.model.family == family and c.strategy.name == strategy and c.fault.name == "none")


def test_catalogue_has_twelve_or_more_faults_one_module_each() -> None:
    faults = catalogue.faults()
    assert len(faults) >= 12
    for name, fault in faults.items():
        module = importlib.import_module(f"conformance.sglang_plugins.faults.{name}")
        assert module.FAULT is fault and module.NAME == name
        targets = [v for k, v in vars(module).items() if k.endswith("TARGET") and isinstance(v, str)]
        assert targets and {h.target for h in fault.hooks} <= set(targets) | {getattr(module, "LRU", "") + s for s in (".get_prev_no_lock", ".cursor_next")}
        assert all(h.target.startswith("sglang.srt.") for h in fault.hooks)
        assert len(fault.description) > 60 and fault.real_bug and fault.observable and (fault.suites or fault.seen_by)
    text = " ".join(f.real_bug + " " + f.description for f in faults.values())
    assert all(pr in text for pr in KNOWN_REGRESSIONS)
    assert all(word in text for word in BUG_CLASSES), [w for w in BUG_CLASSES if w not in text]


def test_every_fault_is_first_shown_harmful_by_a_direct_probe() -> None:
    from test_sglang_fault_probes import PROBES
    from test_sglang_leak_agreement import FAULT as LEAK_AGREEMENT_FAULT
    from test_sglang_pd_fault_probes import PD_PROBES
    from test_sglang_hicache_fault_probes import HICACHE_FAULTS  # probed one by one there (parametrized)
    from test_sglang_program_fault_probes import PROGRAM_PROBES
    from test_perf_ab import AB_PROBED  # two servers: the paired A/B probe
    from test_sglang_tree_audit import FAULT as TREE_AUDIT_FAULT  # named by the tree audit, not by a suite

    assert set(PROBES) | set(PROGRAM_PROBES) | set(PD_PROBES) | set(HICACHE_FAULTS) | set(AB_PROBED) | {LEAK_AGREEMENT_FAULT, TREE_AUDIT_FAULT} == set(catalogue.faults())


def test_unknown_fault_is_one_line() -> None:
    with pytest.raises(KitError, match=r"HYBRID_CONFORMANCE_SGLANG_FAULT='nope': unknown SGLang fault \(known: session_pingpong_leak, "):
        catalogue.get_fault("nope")


def test_every_hook_target_resolves_in_the_installed_sglang() -> None:
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    for fault in catalogue.faults().values():
        for hook in fault.hooks:
            owner, _, attr = hook.target.rpartition(".")
            assert hasattr(pkgutil.resolve_name(owner), attr), hook.target


def test_no_fault_hooks_a_target_of_the_observe_plugins_per_node_evidence() -> None:
    """The observe plugin proves its per-node hooks took effect by the symbol changing; a fault on
    the same symbol broke that proof (a first evict_priority_inverted on the tree's insert: the
    server's start line said state_evictions false, and the eviction-order check judged nothing)."""
    from conformance.sglang_plugins import observe

    per_node = {observe.INSERT_TARGET, observe.STATE_FREE_TARGET, observe.TREE_RESET_TARGET, *observe.state_hook_plan()[0]}
    shared = [(name, h.target) for name, f in catalogue.faults().items() for h in f.hooks if h.target in per_node]
    assert not shared, shared


INSTALL_ALL = """
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from conformance.sglang_plugins.faults import catalogue, spec
out = {}
for name, fault in catalogue.faults().items():
    assert spec.install(fault, "detokenizer") == {}
    HookRegistry.reset()  # one fault per server; here they stack on the same targets
    out[name] = spec.install(fault, "scheduler")["hooks"]
missing = [h.target for f in catalogue.faults().values() for h in f.hooks if not spec._takes_effect(h)]
print(json.dumps({"installed": out, "missing": missing}))
"""


def test_installing_every_fault_takes_effect_through_sglangs_hook_registry() -> None:
    """In a fresh interpreter (the hooks patch SGLang process-wide): every fault's hooks go
    through SGLang's HookRegistry and are found on the patched SGLang symbols."""
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", INSTALL_ALL], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["missing"] == []
    assert set(result["installed"]) == set(catalogue.faults())


def test_a_hook_that_does_not_take_effect_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    from sglang.srt.plugins.hook_registry import HookRegistry

    fault = spec.sglang_fault("probe_only", "x" * 61, "bug", "seen", (spec.Hook("sglang.srt.mem_cache.allocator.mamba.MambaSlotAllocator.available_size", "after", lambda r, *a: r),))
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, *a, **k: None))  # SGLang would only log a failed patch
    monkeypatch.setattr(HookRegistry, "apply_hooks", classmethod(lambda cls: None))
    with pytest.raises(spec.FaultInstallError, match=r"^fault probe_only: hook did not take effect on sglang\.srt\.mem_cache\.allocator\.mamba\.MambaSlotAllocator\.available_size"):
        spec.install(fault, "scheduler")


# ------------------------------------------------------------------ reaching the server
def test_fault_selected_in_the_kits_environment_reaches_the_sglang_cpu_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.targets.sglang_cpu import SGLangCpuTarget

    cell = _cell()
    monkeypatch.delenv(SGLANG_FAULT_ENV, raising=False)
    clean = SGLangCpuTarget().launch_spec(cell, port=1)
    assert SGLANG_FAULT_ENV not in clean.env and activation.FAULT_PLUGIN not in clean.plugins
    monkeypatch.setenv(SGLANG_FAULT_ENV, "cow_skipped")  # as `mutants` sets it
    spec_ = SGLangCpuTarget().launch_spec(cell, port=1)
    assert spec_.env[SGLANG_FAULT_ENV] == "cow_skipped"
    assert activation.FAULT_PLUGIN in spec_.plugins and activation.FAULT_PLUGIN in spec_.env["SGLANG_PLUGINS"].split(",")
    monkeypatch.setenv(SGLANG_FAULT_ENV, "nope")
    with pytest.raises(KitError, match="unknown SGLang fault"):
        SGLangCpuTarget().launch_spec(cell, port=1)


def test_the_gpu_sglang_target_loads_a_fault_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.targets.sglang import SGLangTarget

    cell = _cell()
    target = SGLangTarget(strategy_flag="--mamba-radix-cache-strategy")
    monkeypatch.delenv(SGLANG_FAULT_ENV, raising=False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    assert target.launch_spec(cell, port=1).plugins == ()
    monkeypatch.setenv(SGLANG_FAULT_ENV, "double_free")
    gpu = target.launch_spec(cell, port=1, gpus=[0])
    assert gpu.plugins == (activation.FAULT_PLUGIN,) and gpu.env[SGLANG_FAULT_ENV] == "double_free"
    assert "SGLANG_PLUGINS" not in gpu.env  # no whitelist set: every installed plugin loads, ours included
    monkeypatch.setenv("SGLANG_PLUGINS", "site_plugin")
    assert target.launch_spec(cell, port=1).env["SGLANG_PLUGINS"] == f"site_plugin,{activation.FAULT_PLUGIN}"


def test_fired_is_reported_sparsely_from_the_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report = tmp_path / "plugins.jsonl"
    monkeypatch.setenv(activation.REPORT_ENV, str(report))
    monkeypatch.setattr(spec, "_FIRED", {})
    for _ in range(120):
        spec.fired("double_free", slots=1)
    records = [r for r in activation.read_report(report) if r["status"] == "fired"]
    assert [r["count"] for r in records] == [*range(1, 11), 100] and spec.fire_count("double_free") == 120
    assert all(r["plugin"] == activation.FAULT_PLUGIN and r["fault"] == "double_free" for r in records)


def test_suppressed_frees_forgets_and_restores() -> None:
    import torch

    from conformance.sglang_api import pool as sglang_api

    api = sglang_api.require()
    alloc = api.MambaSlotAllocator(8, "cpu")
    taken = alloc.alloc(3)
    with spec.suppressed_frees(alloc) as lost:
        alloc.free(taken)
    assert lost.lost == 3 and alloc.available_size() == 5
    alloc.free(torch.tensor([1]))
    assert alloc.available_size() == 6


# ------------------------------------------------------------------ the index faults, on SGLang's own plan builder
def _plan(mamba2: bool, extend_lens: list[int], chunk: int):
    from conformance.sglang_api import pool as sglang_api

    sglang_api.require()
    from sglang.srt.layers.attention.mamba.prefill_track_metadata import build_prefill_track_plan

    n = len(extend_lens)
    # track at the last chunk boundary of each extend, via the intermediate states (+1)
    track = [(e // chunk) * chunk + 1 for e in extend_lens]
    args = ([True] * n, track, extend_lens, [0] * n, chunk)
    return build_prefill_track_plan(*args, mamba2=mamba2), args


def test_gdn_h_offset_floor_reads_the_wrong_chunk_state_after_a_ragged_row() -> None:
    from conformance.sglang_plugins.faults import gdn_h_offset_floor

    plan, args = _plan(False, [300, 200, 128], 64)
    right = list(plan.h_src)  # per-sequence offsets: ceil(300/64)=5, ceil(200/64)=4
    assert right == [4, 5 + 3, 5 + 4 + 2]
    wrong = gdn_h_offset_floor.floor_offsets(plan, *args, mamba2=False).h_src
    assert wrong == [4, 4 + 3, 4 + 3 + 2]  # floor: 300//64=4, 200//64=3 -> every later row off by one per ragged row


def test_mamba2_track_index_global_uses_the_flat_grid_where_sglang_recomputes() -> None:
    from conformance.sglang_plugins.faults import mamba2_track_index_global

    plan, args = _plan(True, [300, 200], 128)
    assert plan.recompute_rows == [1] and plan.recompute_end_locs == [300 + 128]  # off the flat grid: recomputed
    faulty = mamba2_track_index_global.global_index(plan, *args, mamba2=True)
    assert faulty.recompute_rows == [] and dict(zip(faulty.h_rows, faulty.h_src))[1] == 428 // 128  # h[3]: state at flat 384, inside row 1 at 84
