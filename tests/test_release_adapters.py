"""What lets real SGLang on CPU run on releases before 0.5.22 (issue 24), without a server:

* the extra_buffer device gate hook (``conformance/sglang_plugins/cpu/device_gate.py``):
  found only where the method asserts on ``is_cuda() or is_musa()`` and reads ``is_musa``
  once; while the method runs for ``--device cpu`` it answers that one question, and
  nothing else (shown on a stand-in of SGLang's method, failing without the hook);
* stand-ins that moved between releases (``Binding.alternates``): every home that exists
  is hooked, a required symbol with no home refuses in one line;
* ``--sglang-source``: a checkout is named by its commit, bad paths are one line through
  the installed console script, the flag is stripped for the re-run, the report records it;
* the torch factories drop ``pin_memory`` only.

The launches themselves (0.5.12, 0.5.13, ... in their venvs) are in docs/history.md and
the issue note; they take minutes each and need PyPI venvs.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from conformance.errors import KitError
from conformance.sglang_plugins.cpu import device_gate, install
from conformance.sglang_plugins.cpu.spec import Binding

GATED = '''
def is_cuda():
    return False

def is_musa():
    return False

def is_npu():
    return False

class ServerArgs:
    device = "cpu"

    def _validate_mamba_extra_buffer(self, view):
        assert (
            is_cuda() or is_musa() or is_npu()
        ), "extra_buffer needs CUDA/MUSA/NPU/ROCm (FLA)."
        return "validated"
'''


def _fake_gated_module(monkeypatch, tmp_path, package: str, name: str, source: str, qualname: str,
                       targets: tuple, platform_targets: tuple = ()):
    """A throwaway package module holding a gate; the device gate looks only there."""
    import importlib

    pkg = tmp_path / package
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(f"{package}.{name}")
    target = f"{package}.{name}.{qualname}"
    monkeypatch.setattr(device_gate, "TARGETS", tuple(t.format(target=target) for t in targets))
    monkeypatch.setattr(device_gate, "PLATFORM_TARGETS", tuple(t.format(target=target) for t in platform_targets))
    monkeypatch.setattr("conformance.sglang_plugins.platform.platform_answers_extra_buffer", lambda: False)
    return module, target


@pytest.fixture
def fake_server_args(monkeypatch, tmp_path):
    yield _fake_gated_module(monkeypatch, tmp_path, "fakesglang_i24", "server_args", GATED,
                             "ServerArgs._validate_mamba_extra_buffer", ("{target}",))
    sys.modules.pop("fakesglang_i24.server_args", None)
    sys.modules.pop("fakesglang_i24", None)


def test_device_gate_answers_only_is_musa_while_the_method_runs(fake_server_args):
    module, target = fake_server_args
    assert device_gate.gate_location() == target
    args = module.ServerArgs()
    original = module.ServerArgs._validate_mamba_extra_buffer
    with pytest.raises(AssertionError, match="extra_buffer needs CUDA"):  # the gate, unhooked
        original(args, None)
    assert device_gate.answer_device(original, args, None) == "validated"
    assert module.is_musa() is False and module.is_cuda() is False  # restored, and never touched
    args.device = "cuda"
    with pytest.raises(AssertionError):  # only --device cpu is answered
        device_gate.answer_device(original, args, None)


def test_device_gate_refuses_a_method_that_reads_is_musa_elsewhere(fake_server_args, monkeypatch):
    module, target = fake_server_args
    source = GATED.replace('return "validated"', 'return "musa" if is_musa() else "validated"')
    with open(module.__file__, "w") as f:
        f.write(source)
    import importlib
    import linecache

    linecache.clearcache()
    importlib.reload(module)
    assert device_gate.gate_location() is None
    done = device_gate.install()  # no gate found: nothing hooked, and no_buffer cells still start
    assert "no extra_buffer device gate found" in done and "nothing hooked" in done


PLATFORM_GATED = '''
class _Platform:
    is_cuda = False
    is_musa = False
    is_npu = False
    is_hip = False
    is_xpu = False
    is_cpu = True

_PLATFORM = _Platform()

def get_platform():
    return _PLATFORM

def validate_mamba_extra_buffer(view, model_arch, *, mamba_cache_chunk_size_of):
    assert (
        get_platform().is_cuda
        or get_platform().is_musa
        or get_platform().is_npu
        or get_platform().is_hip
        or get_platform().is_xpu
    ), "extra_buffer needs CUDA/MUSA/NPU/ROCm/XPU (FLA)."
    return ("validated", get_platform().is_cpu, mamba_cache_chunk_size_of())
'''


@pytest.fixture
def fake_mamba_hook(monkeypatch, tmp_path):
    """The 0.5.19-0.5.21 shape: a module function asserting ``get_platform().is_*``."""
    yield _fake_gated_module(monkeypatch, tmp_path, "fakesglang_i24p", "mamba_hook", PLATFORM_GATED,
                             "validate_mamba_extra_buffer", (), ("{target}",))
    sys.modules.pop("fakesglang_i24p.mamba_hook", None)
    sys.modules.pop("fakesglang_i24p", None)


def test_platform_gate_answers_only_is_musa_while_the_function_runs(fake_mamba_hook):
    from types import SimpleNamespace

    module, target = fake_mamba_hook
    assert device_gate.gate_location() == target
    view = SimpleNamespace(device="cpu")
    original = module.validate_mamba_extra_buffer
    with pytest.raises(AssertionError, match="extra_buffer needs CUDA"):  # the gate, unhooked
        original(view, "Qwen3NextForCausalLM", mamba_cache_chunk_size_of=lambda: 64)
    assert device_gate.answer_platform(original, view, "Qwen3NextForCausalLM", mamba_cache_chunk_size_of=lambda: 64) == (
        "validated", True, 64)  # every other platform fact is the real one
    assert module.get_platform() is module._PLATFORM and module._PLATFORM.is_musa is False  # restored, never touched
    view.device = "cuda"
    with pytest.raises(AssertionError):  # only --device cpu is answered
        device_gate.answer_platform(original, view, "Qwen3NextForCausalLM", mamba_cache_chunk_size_of=lambda: 64)


def test_platform_gate_refuses_a_function_that_reads_is_musa_elsewhere(fake_mamba_hook):
    module, target = fake_mamba_hook
    with open(module.__file__, "w") as f:
        f.write(PLATFORM_GATED.replace("get_platform().is_cpu,", "get_platform().is_musa,"))
    import importlib
    import linecache

    linecache.clearcache()
    importlib.reload(module)
    assert device_gate.gate_location() is None


def test_device_gate_defers_to_a_platform_that_answers(monkeypatch):
    monkeypatch.setattr("conformance.sglang_plugins.platform.platform_answers_extra_buffer", lambda: True)
    assert device_gate.gate_location() == "platform"
    assert "no hook" in device_gate.install()


def test_bindings_hook_every_home_that_exists(monkeypatch):
    fake = types.ModuleType("fake_i24_homes")
    fake.old_home = lambda: "sglang"
    monkeypatch.setitem(sys.modules, "fake_i24_homes", fake)

    def impl():
        return "kit"

    def legacy_impl():
        return "kit, old signature"

    moved = Binding("fake_i24_homes.new_home", impl, "replace", alternates=("fake_i24_homes.old_home", ("fake_i24_homes.older", legacy_impl)))
    assert moved.homes == (("fake_i24_homes.new_home", impl), ("fake_i24_homes.old_home", impl), ("fake_i24_homes.older", legacy_impl))
    assert [h for h, _ in moved.homes if install._resolves(h, moved.how)] == ["fake_i24_homes.old_home"]
    assert install._resolves("fake_i24_homes.absent", "constant") and not install._resolves("no_such_module_i24.x", "constant")
    registered = []
    monkeypatch.setattr(install, "bindings", lambda: (moved, Binding("fake_i24_homes.CHUNK", 64, "constant")))
    monkeypatch.setattr(install, "_register_replace", lambda target, fn: registered.append((target, fn)))
    monkeypatch.setattr(install.torch_device, "install", lambda: [])
    monkeypatch.setattr(install.device_gate, "install", lambda: "n/a")
    fake_kernel = types.ModuleType("sgl_kernel")
    fake_kernel._hybrid_conformance_installed = True
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake_kernel)
    import sglang.srt.plugins.hook_registry as registry

    monkeypatch.setattr(registry.HookRegistry, "apply_hooks", classmethod(lambda cls: setattr(fake, "old_home", impl)))
    done = install.install("scheduler")
    assert registered == [("fake_i24_homes.old_home", impl)] and fake.CHUNK == 64
    assert done["bound"] == ["fake_i24_homes.CHUNK"]
    missing = Binding("fake_i24_homes.gone", impl, "replace")
    monkeypatch.setattr(install, "bindings", lambda: (missing,))
    with pytest.raises(install.InstallError, match="lacks what the kit's CPU stand-ins hook .*fake_i24_homes.gone"):
        install.install("scheduler")
    monkeypatch.setattr(install, "bindings", lambda: (Binding("fake_i24_homes.gone", impl, "replace", required=False),))
    assert install.install("scheduler")["absent"] == ["fake_i24_homes.gone"]


def test_torch_factories_drop_pin_memory_only():
    import torch

    from conformance.sglang_plugins.cpu.torch_device import _unpinned

    tensor = _unpinned(torch.tensor)
    t = tensor([1, 2], dtype=torch.int64, pin_memory=True)
    assert t.tolist() == [1, 2] and t.dtype == torch.int64 and not t.is_pinned()
    assert _unpinned(torch.zeros)(3, pin_memory=True).tolist() == [0.0, 0.0, 0.0]


def test_a_device_module_sglang_bound_before_the_patch_is_rebound_to_cpu(monkeypatch):
    """0.5.17's HiCache controller binds ``device_module = get_device_module()`` at import; a
    server forked from a pre-imported launcher imported it before the CPU plugin: its streams
    were CUDA streams ("CUDA driver version is insufficient") until rebound."""
    import sys
    import types

    import torch

    from conformance.sglang_plugins.cpu.torch_device import rebind_device_modules

    bound, other = types.ModuleType("sglang.fake_cache_controller"), types.ModuleType("fake_elsewhere")
    bound.device_module = other.device_module = torch.cuda
    monkeypatch.setitem(sys.modules, bound.__name__, bound)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert "sglang.fake_cache_controller.device_module" in rebind_device_modules()
    assert bound.device_module is torch.cpu and other.device_module is torch.cuda  # only SGLang's modules


def test_a_memoised_get_device_module_that_cached_cuda_is_cleared(monkeypatch):
    """0.5.17's ``sglang.srt.utils.common.get_device_module`` is an lru_cache: a call before the
    patch caches ``torch.cuda`` and a module imported after the patch (HiCache's
    ``hybrid_cache_controller``) would bind it; the rebind clears the memo, and leaves a memo
    that cached nothing (and a module outside SGLang) alone."""
    import functools
    import sys
    import types

    import torch

    from conformance.sglang_plugins.cpu.torch_device import rebind_device_modules

    answer = [torch.cuda]
    common, empty, other = (types.ModuleType(n) for n in ("sglang.fake_common", "sglang.fake_empty", "fake_elsewhere"))
    for m in (common, empty, other):
        m.get_device_module = functools.lru_cache(maxsize=None)(lambda: answer[0])
        monkeypatch.setitem(sys.modules, m.__name__, m)
    assert common.get_device_module() is other.get_device_module() is torch.cuda  # called before the patch
    answer[0] = torch.cpu  # what the patched torch.get_device_module() answers now
    assert rebind_device_modules() == ["sglang.fake_common.get_device_module (cache cleared)"]
    assert common.get_device_module() is torch.cpu and other.get_device_module() is torch.cuda


def test_source_checkout_is_named_by_its_commit(tmp_path):
    from conformance.commands import sglang_source

    with pytest.raises(KitError, match="not an SGLang checkout"):
        sglang_source.checkout(tmp_path)
    (tmp_path / "python").mkdir()
    (tmp_path / "python" / "pyproject.toml").write_text('[project]\nname = "sglang"\nversion = "0.5.23"\n')
    with pytest.raises(KitError, match="not a git checkout"):
        sglang_source.checkout(tmp_path)
    git = ["git", "-C", str(tmp_path), "-c", "user.email=k@k", "-c", "user.name=k"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    co = sglang_source.checkout(tmp_path)
    assert len(co.commit) == 40 and co.version == "0.5.23" and co.label == f"src-{co.commit[:12]}"
    assert co.venv_name == f"sglang-src-{co.commit[:12]}"
    argv = ["run", "--sglang-source", str(tmp_path), "--tier", "premerge", "--sglang-source=x"]
    assert sglang_source.without_flag(argv) == ["run", "--tier", "premerge"]


def test_report_versions_record_the_checkout(monkeypatch):
    from conformance.report import versions

    monkeypatch.delenv(versions.SOURCE_ENV, raising=False)
    assert "sglang_commit" not in versions.versions()
    monkeypatch.setenv(versions.SOURCE_ENV, "/src/sglang@0123456789abcdef")
    v = versions.versions()
    assert v["sglang_source"] == "/src/sglang" and v["sglang_commit"] == "0123456789abcdef"


@pytest.mark.parametrize("verb", ["run", "fuzz", "mutants", "history"])
def test_sglang_source_bad_path_is_one_line_through_the_console_script(verb, tmp_path):
    out = subprocess.run(["hybrid-conformance", verb, "--sglang-source", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "not an SGLang checkout (no python/pyproject.toml)" in lines[0] and "Traceback" not in out.stderr


def test_history_keeps_sglang_source_as_a_column_and_run_re_runs(monkeypatch, tmp_path):
    """history adds the checkout as a column (never re-runs itself in the checkout's venv);
    run/fuzz/mutants re-run in it."""
    from conformance import cli
    from conformance.commands import history

    seen = {}
    monkeypatch.setattr(history, "history", lambda releases, **k: seen.update(releases=releases, sources=k["sources"]) or ([], {}))
    monkeypatch.setattr(history, "rerun_in_source", lambda argv, path: seen.update(rerun=(argv, path)) or 0)
    monkeypatch.setattr("conformance.commands.sglang_source.checkout", lambda p: type("C", (), {"label": "src-x", "path": p, "commit": "c", "version": "v"})())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["history", "--releases", "0.5.23", "--sglang-source", "ck", "--checks", "validate"]) == 0
    assert seen == {"releases": ["0.5.23"], "sources": ["ck"]}
    assert cli.main(["run", "--tier", "premerge", "--sglang-source", "ck"]) == 0
    assert seen["rerun"] == (["run", "--tier", "premerge", "--sglang-source", "ck"], "ck")


def test_old_track_copy_copies_masked_rows_and_skips_freed_ones():
    import torch

    from conformance.sglang_plugins.cpu.triton_spots import track_mamba_states_if_needed

    conv, ssm = torch.arange(8.0).reshape(4, 2), torch.arange(4.0).reshape(4, 1) * 10
    idx, mask, track = torch.tensor([0, 1, 2]), torch.tensor([True, False, True]), torch.tensor([3, 3, -1])
    track_mamba_states_if_needed(conv, ssm, idx, mask, track, 3, check_freed_slots=True)
    assert conv[3].tolist() == [0.0, 1.0] and ssm[3].tolist() == [0.0] and conv[2].tolist() == [4.0, 5.0]


def test_observe_counts_track_slots_on_the_req_before_req_kv():
    from types import SimpleNamespace as NS

    from conformance.sglang_plugins.observe import track_slots

    assert track_slots(NS(mamba_ping_pong_track_buffer=[5, 6])) == 2  # 0.5.12: state on the Req, both held
    assert track_slots(NS(kv=NS(mamba_ping_pong_track_buffer=[5, 6], mamba_ping_pong_empty=[False, True]))) == 1
    assert track_slots(NS(mamba_ping_pong_track_buffer=None)) == 0
    # 0.5.16: req.kv exists (KV lengths only) while the buffer stays on the Req; lazy marks an empty entry -1
    assert track_slots(NS(kv=NS(kv_committed_len=3), mamba_ping_pong_track_buffer=[5, 6])) == 2
    assert track_slots(NS(kv=NS(kv_committed_len=3), mamba_ping_pong_track_buffer=[5, -1])) == 1


def test_observe_eviction_targets_resolve_per_release_or_are_none():
    """The eviction counter hooks ``UnifiedRadixCache._evict`` where it exists, else each
    tree's public ``evict``; a target the release lacks resolves to None (never raises)."""
    import pkgutil

    pytest.importorskip("sglang")
    from conformance.sglang_plugins import observe

    assert observe._resolve(pkgutil, "sglang.srt.mem_cache.no_such_module.Tree.evict") is None
    assert observe._resolve(pkgutil, "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.no_such_method") is None
    found = [t for t in (observe.EVICT_TARGET, *observe.LEGACY_EVICT_TARGETS) if observe._resolve(pkgutil, t) is not None]
    assert found, "no eviction path of the installed sglang is known to the observe plugin"
    hooks, plans, missing = observe.state_hook_plan()  # per-node evidence: every tree class of the release fully hooked
    assert plans and not missing and hooks, (plans, missing)
    assert all(observe._resolve(pkgutil, t) is not None for t in hooks)


def test_all_layer_track_copy_stand_in_copies_every_layer_and_skips_freed_slots():
    """0.5.22's decode-path ``track_mamba_states_all_layers`` (its own Triton kernel there)."""
    import torch

    from conformance.sglang_plugins.cpu.triton_spots import track_mamba_states_all_layers

    conv, ssm = torch.arange(24.0).reshape(2, 4, 3), torch.arange(8.0).reshape(2, 4, 1)
    track_mamba_states_all_layers(conv, ssm, torch.tensor([0, 1, 2]), torch.tensor([True, False, True]), torch.tensor([3, 3, -1]), 3,
                                  check_freed_slots=True)
    assert conv[:, 3].tolist() == [[0.0, 1.0, 2.0], [12.0, 13.0, 14.0]] and ssm[:, 3].tolist() == [[0.0], [4.0]]
    assert conv[:, 2].tolist() == [[6.0, 7.0, 8.0], [18.0, 19.0, 20.0]]  # the freed (-1) track slot: nothing copied


def test_an_override_sets_a_constant_in_every_home_that_binds_it_and_a_constant_keeps_the_releases(monkeypatch):
    """``how="override"``: SGLang's own value is replaced in each module that binds it (one
    that imported it by name holds a copy), a module without it is left alone; ``how="constant"``
    never replaces a value the release binds."""
    base, importer, other = (types.ModuleType(n) for n in ("fake_i45_base", "fake_i45_importer", "fake_i45_other"))
    base.RESERVE = importer.RESERVE = 10 * 1024**3
    base.KEEP = 7
    for m in (base, importer, other):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    reserve = Binding("fake_i45_base.RESERVE", 512, "override", alternates=("fake_i45_importer.RESERVE", "fake_i45_other.RESERVE"), required=False)
    monkeypatch.setattr(install, "bindings", lambda: (reserve, Binding("fake_i45_base.KEEP", 64, "constant")))
    monkeypatch.setattr(install.torch_device, "install", lambda: [])
    monkeypatch.setattr(install.device_gate, "install", lambda: "n/a")
    fake_kernel = types.ModuleType("sgl_kernel")
    fake_kernel._hybrid_conformance_installed = True
    monkeypatch.setitem(sys.modules, "sgl_kernel", fake_kernel)
    import sglang.srt.plugins.hook_registry as registry

    monkeypatch.setattr(registry.HookRegistry, "apply_hooks", classmethod(lambda cls: None))
    done = install.install("scheduler")
    assert base.RESERVE == importer.RESERVE == 512 and not hasattr(other, "RESERVE")
    assert base.KEEP == 7
    assert done["bound"] == ["fake_i45_base.RESERVE", "fake_i45_importer.RESERVE"]
