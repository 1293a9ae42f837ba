"""The PD launch commands: SGLang's three commands per cell, checked by SGLang's own parser
(``extra_buffer_lazy`` refused on the prefill side, as 0.5.23 does), the router command's
shape (and ``sglang_router``'s parser when installed), and the reference PD commands."""

from __future__ import annotations

import argparse
import shlex
from types import SimpleNamespace

import pytest

from conformance.errors import KitError
from conformance.matrix.cells import load_matrix
from conformance.targets.disagg import not_applicable, pd_spec_for, validate_pd_spec, validate_router_argv
from conformance.targets.pd_launch import (
    LAZY_REFUSAL,
    ROUTER_AS_IS_FLAGS,
    ROUTER_READY_PATH,
    ROUTER_LAUNCHER,
    PDPorts,
    reference_pd_spec,
    sglang_pd_spec,
)
from conformance.targets.sglang import SGLangTarget

PORTS = PDPorts(prefill=30000, decode=30001, router=30100, bootstrap=8998)


def _cells(strategy=None, family=None):
    m = load_matrix()
    return [c for c in m.cells if c.fault.name == "none" and c.cache_variant.name == "radix" and c.page_size == 1
            and c.track_interval == 256 and (strategy is None or c.strategy.name == strategy)
            and (family is None or c.model.family == family)]


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_sglang_pd_commands_share_the_bootstrap_port_and_split_the_gpus():
    cell = _cells("extra_buffer", "qwen3-next")[0]  # tp 4
    spec = sglang_pd_spec(cell, target=SGLangTarget(), ports=PORTS, gpus=list(range(8)), transfer_backend="nixl")
    pre, dec = spec.prefill.argv, spec.decode.argv
    assert _flag(pre, "--disaggregation-mode") == "prefill" and _flag(dec, "--disaggregation-mode") == "decode"
    assert _flag(pre, "--disaggregation-bootstrap-port") == _flag(dec, "--disaggregation-bootstrap-port") == "8998"
    assert _flag(pre, "--disaggregation-transfer-backend") == _flag(dec, "--disaggregation-transfer-backend") == "nixl"
    assert _flag(pre, "--base-gpu-id") == "0" and _flag(dec, "--base-gpu-id") == "4"
    assert spec.prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert _flag(pre, "--port") == "30000" and _flag(dec, "--port") == "30001"
    assert _flag(pre, "--mamba-radix-cache-strategy") == "extra_buffer"
    router = shlex.join(spec.router.argv)
    assert router.startswith(ROUTER_LAUNCHER + " --pd-disaggregation")
    assert "--prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001" in router
    assert spec.prefill.health_path == spec.decode.health_path == "/health"
    plan = spec.describe()
    assert plan["prefill"]["command"] == pre and plan["router"]["health"] == "http://127.0.0.1:30100/readiness"
    assert plan["bootstrap_port"] == 8998 and plan["transfer_backend"] == "nixl"


def test_sglang_pd_without_a_backend_leaves_sglangs_default():
    spec = sglang_pd_spec(_cells("no_buffer", "nemotron-h")[0], target=SGLangTarget(), ports=PORTS)
    assert "--disaggregation-transfer-backend" not in spec.prefill.argv
    assert "--disable-overlap-schedule" in spec.prefill.argv and "CUDA_VISIBLE_DEVICES" not in spec.prefill.env


def test_bad_backend_and_too_few_gpus_are_one_line_errors():
    cell = _cells("extra_buffer", "qwen3-next")[0]
    with pytest.raises(KitError, match="unknown value 'tcp'"):
        sglang_pd_spec(cell, target=SGLangTarget(), ports=PORTS, transfer_backend="tcp")
    with pytest.raises(KitError, match="PD needs 8 GPUs"):
        sglang_pd_spec(cell, target=SGLangTarget(), ports=PORTS, gpus=[0, 1, 2, 3])
    opts = SimpleNamespace(target="sglang", twins=False, gpus_per_worker=8, sglang_launcher="python -m sglang.launch_server")
    with pytest.raises(KitError, match=r"PD needs 12 GPUs per worker \(tp 4 each for the non-PD server, prefill and decode\)"):
        pd_spec_for(cell, opts)


def test_pd_gpus_follow_the_non_pd_servers_gpus(monkeypatch):
    from conformance.targets import sglang as sglang_target

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setattr(sglang_target, "cuda_device_count", lambda: 6)  # a six-GPU box
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cell = _cells("no_buffer", "nemotron-h")[0]  # tp 1
    opts = SimpleNamespace(target="sglang", twins=False, gpus_per_worker=3, sglang_launcher="python -m sglang.launch_server")
    spec = pd_spec_for(cell, opts, ports=PORTS)
    assert spec.prefill.env["CUDA_VISIBLE_DEVICES"] == "4,5"  # worker gw1 owns 3-5; its non-PD server has 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6,7")  # a mask the runner set: mapped into, not overwritten
    assert pd_spec_for(cell, opts, ports=PORTS).prefill.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert _flag(spec.prefill.argv, "--base-gpu-id") == "0" and _flag(spec.decode.argv, "--base-gpu-id") == "1"


def test_lazy_cells_are_not_applicable_in_one_line():
    lazy = _cells("extra_buffer_lazy", "granite-h")[0]
    assert not_applicable(lazy) == LAZY_REFUSAL and "\n" not in LAZY_REFUSAL
    assert not_applicable(_cells("extra_buffer", "granite-h")[0]) is None
    with pytest.raises(KitError, match="extra_buffer_lazy is refused under PD"):
        pd_spec_for(lazy, SimpleNamespace(target="reference"))


def test_reference_pd_commands_start_the_roles_and_the_router():
    cell = _cells("extra_buffer", "falcon-h1")[0]
    spec = reference_pd_spec(cell, ports=PORTS, role_env={"prefill": {"HYBRID_CONFORMANCE_FAULT": "pd_state_off_by_one"}})
    pre = spec.prefill.argv
    assert pre[1:3] == ["-m", "conformance.reference.pd"] and _flag(pre, "--disaggregation-mode") == "prefill"
    assert _flag(pre, "--decode-url") == "http://127.0.0.1:30001" and _flag(pre, "--model") == cell.model.twin
    assert _flag(spec.decode.argv, "--disaggregation-mode") == "decode" and "--decode-url" not in spec.decode.argv
    assert spec.prefill.env["HYBRID_CONFORMANCE_FAULT"] == "pd_state_off_by_one" and "HYBRID_CONFORMANCE_FAULT" not in spec.decode.env
    assert spec.router.argv[1:3] == ["-m", "conformance.reference.router"]
    assert _flag(spec.router.argv, "--prefill") == "http://127.0.0.1:30000" and _flag(spec.router.argv, "--port") == "30100"


# ------------------------------------------------------------------ parsers
def test_router_command_shape_and_parser():
    spec = sglang_pd_spec(_cells("no_buffer", "qwen3-next")[0], target=SGLangTarget(), ports=PORTS)
    ok = validate_router_argv(spec.router.argv)
    assert ok.ok, ok.message
    try:
        import sglang_router.router_args  # noqa: F401

        assert ok.message == "ok (sglang_router's parser)"
    except ImportError:
        assert ok.message.startswith("ok (shape only")
    base = shlex.split(ROUTER_LAUNCHER)
    assert not validate_router_argv([*base, "--prefill", "http://a:1", "--decode", "http://b:2"]).ok
    two = validate_router_argv([*base, "--pd-disaggregation", "--prefill", "http://a:1", "--prefill", "http://c:3", "--decode", "http://b:2"])
    assert not two.ok and "exactly one --prefill" in two.message
    assert "takes a URL" in validate_router_argv([*base, "--pd-disaggregation", "--prefill", "a:1", "--decode", "http://b:2"]).message


def test_router_passes_sglang_answers_on_as_they_came():
    """No router retry (it would hide a failed SGLang request or run it twice) and no circuit
    breaker (it would answer 503 'No prefill workers available' after SGLang's failures)."""
    spec = sglang_pd_spec(_cells("no_buffer", "qwen3-next")[0], target=SGLangTarget(), ports=PORTS)
    assert set(ROUTER_AS_IS_FLAGS) == {"--disable-retries", "--disable-circuit-breaker"}
    assert all(flag in spec.router.argv for flag in ROUTER_AS_IS_FLAGS)
    # started = its workers registered (its /health is liveness only: 200 before any worker is known)
    assert spec.router.health_path == ROUTER_READY_PATH == "/readiness"
    router_args = pytest.importorskip("sglang_router.router_args", reason="sglang_router not installed: its parser cannot be asked")
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = spec.router.argv[len(shlex.split(ROUTER_LAUNCHER)):]
    parsed = router_args.RouterArgs.from_cli_args(parser.parse_args(args), use_router_prefix=False)
    assert parsed.disable_retries and parsed.disable_circuit_breaker
    default = router_args.RouterArgs.from_cli_args(parser.parse_args([a for a in args if a not in ROUTER_AS_IS_FLAGS]), use_router_prefix=False)
    assert not default.disable_retries and not default.disable_circuit_breaker  # the flags are what turns them off


def test_router_parser_rejects_an_unknown_flag():
    pytest.importorskip("sglang_router.router_args", reason="sglang_router not installed: its parser cannot be asked")
    base = shlex.split(ROUTER_LAUNCHER)
    v = validate_router_argv([*base, "--pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://b:2", "--no-such-flag"])
    assert not v.ok and "sglang_router's parser rejected" in v.message


@pytest.fixture(scope="module")
def sglang_parser():
    pytest.importorskip("sglang.srt.server_args", reason="SGLang is not importable here")


@pytest.mark.parametrize("family", ["qwen3-next", "nemotron-h", "granite-h", "falcon-h1"])
def test_sglangs_parser_accepts_pd_for_no_buffer_and_extra_buffer_and_refuses_lazy(sglang_parser, family):
    for cell in _cells(family=family):
        spec = sglang_pd_spec(cell, target=SGLangTarget(), ports=PORTS, transfer_backend="mooncake")
        result = validate_pd_spec(spec, cell)
        assert result["decode"].ok, (cell.id, result["decode"].message)  # decode: radix cache off, lazy resolves
        assert result["router"].ok, (cell.id, result["router"].message)
        if cell.strategy.pd:
            assert result["prefill"].ok, (cell.id, result["prefill"].message)
            assert not_applicable(cell) is None
        else:  # the kit's n/a line agrees with SGLang's own refusal
            assert not result["prefill"].ok
            assert "extra_buffer_lazy unsupported under PD disaggregation" in result["prefill"].message
            assert not_applicable(cell) == LAZY_REFUSAL


# ------------------------------------------------------------------ sglang-cpu
CPU_PORTS = PDPorts(prefill=30000, decode=30001, router=30100, bootstrap=8998, router_metrics=30200)


def test_sglang_cpu_pd_commands_are_the_cells_cpu_command_plus_mooncake_over_tcp(sglang_parser):
    from conformance.sglang_plugins import activation
    from conformance.targets.pd_launch import CPU_TRANSFER_ENV, transport

    cell = _cells("extra_buffer", "qwen3-next")[0]
    opts = SimpleNamespace(target="sglang-cpu", dtype="float32", twins=False)
    spec = pd_spec_for(cell, opts, ports=CPU_PORTS)
    pre, dec, router = spec.prefill, spec.decode, spec.router
    assert _flag(pre.argv, "--disaggregation-mode") == "prefill" and _flag(dec.argv, "--disaggregation-mode") == "decode"
    for s in (pre, dec):
        assert _flag(s.argv, "--device") == "cpu" and _flag(s.argv, "--disaggregation-transfer-backend") == "mooncake"
        assert _flag(s.argv, "--disaggregation-bootstrap-port") == "8998"
        assert s.env["MC_FORCE_TCP"] == CPU_TRANSFER_ENV["MC_FORCE_TCP"] == "1" and s.env[activation.PD_ENV] == "1"
        assert s.env["SGLANG_PLATFORM"] == activation.PLATFORM_NAME and activation.CPU_PLUGIN in s.plugins
        assert s.health_path == "/health"  # a prefill-only server has no /health_generate answer of its own
    assert _flag(router.argv, "--prefill") == "http://127.0.0.1:30000" and router.argv[router.argv.index("--prefill") + 2] == "8998"
    assert _flag(router.argv, "--prometheus-port") == "30200"  # not the default 29000 every router on the machine takes
    assert not spec.router_batches and transport(spec) == {"backend": "mooncake", "protocol": "tcp"}
    assert validate_pd_spec(spec, cell)["prefill"].ok and validate_pd_spec(spec, cell)["decode"].ok
    ref = pd_spec_for(cell, SimpleNamespace(target="reference"), ports=PORTS)
    assert ref.router_batches and transport(ref) == {"backend": "reference", "protocol": "http"}


def test_sglang_cpu_pd_refusal_is_sglangs_own_line_and_none_when_mooncake_builds(monkeypatch):
    from conformance.sglang_api import probes
    from conformance.targets.disagg import target_refusal

    monkeypatch.setattr(probes, "probe", lambda: SimpleNamespace(pd_transfer_refusal="Please install mooncake by following ..."))
    line = target_refusal("sglang-cpu")
    assert line.startswith("not applicable on sglang-cpu: SGLang's PD transfer engine refuses this machine: Please install mooncake")
    monkeypatch.setattr(probes, "probe", lambda: SimpleNamespace(pd_transfer_refusal=None))
    assert target_refusal("sglang-cpu") is None and target_refusal("reference") is None


def test_the_pd_bridge_targets_sglangs_cuda_branch_and_turns_it_off(sglang_parser):
    """The bridged CUDA assumption is still there in this release (else the bridge is stale),
    and the hook makes a sender take SGLang's host-index branch."""
    import inspect
    import pkgutil

    pytest.importorskip("sglang.srt.disaggregation.mooncake.conn", reason="SGLang's Mooncake backend is not importable here")
    from sglang.srt.disaggregation import prefill

    from conformance.sglang_plugins.cpu import pd_bridge

    source = inspect.getsource(prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk)
    assert "supports_host_tensor_indices" in source and "pin_memory=True" in source and "torch.cuda.Event" in source
    owner, attr = pd_bridge.SENDER_INIT.rsplit(".", 1)
    sender_cls = pkgutil.resolve_name(owner)
    assert sender_cls.supports_host_tensor_indices is True and hasattr(sender_cls, attr)
    sender = SimpleNamespace(supports_host_tensor_indices=True)
    pd_bridge.sender_on_host(None, sender)
    assert sender.supports_host_tensor_indices is False


def test_the_early_send_bridge_targets_sglangs_cuda_event_and_restores_overlap(sglang_parser):
    """SGLang's early send of a cached prefix still records a torch.cuda.Event under the
    overlap scheduler (else the bridge is stale); the hook runs it with overlap off for that
    call only, whatever the call does."""
    import inspect

    from sglang.srt.disaggregation import prefill

    from conformance.sglang_plugins.cpu import pd_bridge

    source = inspect.getsource(prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk)
    assert "if self.enable_overlap:" in source and "torch.cuda.Event()" in source and "forward_stream" in source
    scheduler = SimpleNamespace(enable_overlap=True)
    seen = []
    assert pd_bridge.early_send_without_event(lambda s, req, allow_send=True: seen.append((s.enable_overlap, req, allow_send)) or "sent", scheduler, "r", allow_send=False) == "sent"
    assert seen == [(False, "r", False)] and scheduler.enable_overlap is True

    def boom(s, req):
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        pd_bridge.early_send_without_event(boom, scheduler, "r")
    assert scheduler.enable_overlap is True
    assert [t for t, _ in pd_bridge.BRIDGES] == [pd_bridge.SENDER_INIT, pd_bridge.EARLY_SEND]
