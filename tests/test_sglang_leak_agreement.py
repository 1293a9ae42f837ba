"""The leak check on a real SGLang leak, and the reference engine agreeing with real SGLang.

One real SGLang server on CPU (``qwen3-next`` / ``extra_buffer``) runs with the seeded
fault ``pingpong_leak_on_finish`` and SGLang's strict idle check switched OFF
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0``): SGLang keeps serving, so only the
kit's idle invariant, read before any flush, can see the leak.  The same scenario then
runs on the reference engine with its equivalent seeded leak: both read the leak before
``/flush_cache`` and 0 after it (SGLang's flush rebuilds its free lists; the reference
engine's flush does the same), and the leak check fails on both.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
from sglang_cpu_probes import EXTRA_BUFFER_QWEN, cell_for, probe_server, prompts

from conformance.checks.leaks import leak_verdict
from conformance.recordings import IdleProbe
from conformance.client import SGLangClient
from conformance.sglang_contract.metric_names import MAMBA_USED_TOKENS
from conformance.targets.launcher import ServerProcess, free_port
from conformance.targets.reference import FAULT_ENV as REFERENCE_FAULT_ENV
from conformance.targets.reference import ReferenceTarget
from conformance.workloads.idle import idle_probe
from conformance.workloads.runners import generate_tokens

pytestmark = [pytest.mark.fault_probe, pytest.mark.fault_probe_fast, pytest.mark.timeout(1800)]

FAULT = "pingpong_leak_on_finish"  # the same name, and the same bug, in both catalogues
REQUESTS = 4


def leak_scenario(client: SGLangClient) -> IdleProbe:
    """Flush, finish a batch of requests, then SGLang's idle invariant before and after a flush."""
    client.flush_cache()
    generate_tokens(client, prompts((300, 200, 150, 260), seed=11), 8)
    return idle_probe(client, f"{REQUESTS} finished requests", requests=REQUESTS, deadline_s=45.0)


@pytest.fixture(scope="module")
def leaky_sglang(tmp_path_factory: pytest.TempPathFactory):
    with probe_server(cell_for(*EXTRA_BUFFER_QWEN), tmp_path_factory.mktemp("sglang"), fault=FAULT, strict=False) as server:
        yield server


@contextlib.contextmanager
def leaky_reference(tmp_path: Path) -> Iterator[tuple[SGLangClient, ServerProcess]]:
    spec = ReferenceTarget().launch_spec(cell_for(*EXTRA_BUFFER_QWEN), port=free_port())
    env = {**spec.env, REFERENCE_FAULT_ENV: FAULT}
    proc = ServerProcess(name="reference server", argv=spec.argv, env=env, health_url=spec.base_url + spec.health_path, log_path=tmp_path / "reference.log",
                         start_timeout_s=spec.start_timeout_s, entry=spec.entry, entry_argv=spec.entry_argv, preload=spec.preload)
    with proc:
        client = SGLangClient(spec.base_url, liveness=proc.exit_reason)
        try:
            yield client, proc
        finally:
            client.close()


def test_leak_check_fails_on_a_real_sglang_leak_with_sglangs_strict_check_off(leaky_sglang) -> None:
    probe = leak_scenario(leaky_sglang.client)
    assert leaky_sglang.fired(FAULT) >= REQUESTS
    assert leaky_sglang.process.alive() and leaky_sglang.client.health(), "SGLang's strict idle check is off: the server must keep serving"
    leaked, after = probe.values[MAMBA_USED_TOKENS], probe.after_flush.get(MAMBA_USED_TOKENS)
    assert leaked >= REQUESTS and after == 0, f"before flush {leaked:g}, after {after}: the flush rebuilds SGLang's free lists"
    with_log = leak_verdict([probe], log_text=leaky_sglang.log(), alive=True, require_load_evidence=False)
    invariant_only = leak_verdict([probe], log_text="", alive=True, require_load_evidence=False)
    for verdict in (with_log, invariant_only):
        assert verdict.status == "fail" and "idle invariant broken before any flush" in verdict.reason, verdict.reason
        assert verdict.metrics["mamba_used_at_idle"] == leaked


@pytest.mark.scheduled(reason="a second real-SGLang leak run; CI keeps the leak check's own catch on real SGLang")
def test_reference_engine_and_real_sglang_agree_on_the_seeded_leak(leaky_sglang, tmp_path: Path) -> None:
    real = leak_scenario(leaky_sglang.client)
    with leaky_reference(tmp_path) as (client, _):
        ref = leak_scenario(client)
    rows = {"sglang-cpu": real, "reference": ref}
    for target, probe in rows.items():
        before, after = probe.values[MAMBA_USED_TOKENS], probe.after_flush.get(MAMBA_USED_TOKENS)
        assert before > 0 and after == 0, f"{target}: mamba used {before:g} before the flush, {after} after"
        assert not probe.reached and any("leaked" in p for p in probe.problems), (target, probe.problems)
        assert leak_verdict([probe], alive=True, require_load_evidence=False).status == "fail"
    # the fault leaks one track slot per finished request whose state was cached, two otherwise
    leaked = {t: p.values[MAMBA_USED_TOKENS] for t, p in rows.items()}
    assert real.values[MAMBA_USED_TOKENS] == ref.values[MAMBA_USED_TOKENS] and REQUESTS <= real.values[MAMBA_USED_TOKENS] <= 2 * REQUESTS, leaked
