"""The PD transfer-failure check and its workload (``conformance/checks/transfer_failures.py``,
``conformance/workloads/transfer_failures.py``), the ``disagg_transfer_fail`` cells (SGLang's
switch on the decode server only, bound by the disagg suite only) and the mutants plan of
the seeded decode-side fault.  The real-SGLang catch is
``hybrid-conformance mutants --target sglang-cpu --only pd_decode_failed_transfer_slot_kept``
(and the direct probe in tests/test_sglang_pd_fault_probes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conformance.checks.transfer_failures import transfer_failure_verdict
from conformance.client import SGLangClient
from conformance.errors import KitError
from conformance.matrix.faults import DISAGG_FAILURE_ENV
from conformance.matrix.cells import load_matrix
from conformance.recordings import TransferFailureRecording, TransferOutcome
from conformance.workloads.transfer_failures import record_transfer_failures

ROOT = Path(__file__).resolve().parents[1]
FAILED = "Decode transfer failed for request rank=0 decode_req.req.rid='r1' decode_req.req.bootstrap_room=7"
SERVED = TransferOutcome(200, "length", "", 12)
ABORTED = TransferOutcome(200, "abort", FAILED, 0)


def _rec(outcomes, follow=(TransferOutcome(200, "length", "", 1),)) -> TransferFailureRecording:
    return TransferFailureRecording(tuple(outcomes), tuple(follow), 0.1, 12)


def test_served_and_failed_requests_with_a_served_follow_up_pass() -> None:
    v = transfer_failure_verdict(_rec([SERVED, ABORTED, TransferOutcome(500, "http", FAILED)]))
    assert v.status == "pass", v.reason
    assert v.metrics["served"] == 1 and v.metrics["transfer_failed"] == 2 and v.metrics["unexpected"] == 0


def test_the_prefill_side_line_of_a_failed_handshake_counts_as_sglangs_failure() -> None:
    prefill = ("Prefill bootstrap failed for request rank=0 req.rid='r2' req.bootstrap_room=9 with exception "
               "KVTransferError(bootstrap_room=9): Request 9 timed out after 20.0s in KVPoll.Bootstrapping")
    v = transfer_failure_verdict(_rec([SERVED, TransferOutcome(500, "http", prefill)]))
    assert v.status == "pass" and v.metrics["transfer_failed"] == 1, v.reason
    assert v.details["failure_messages"] == ["Prefill bootstrap failed for request"]


def test_no_failed_transfer_refuses_to_pass() -> None:
    v = transfer_failure_verdict(_rec([SERVED, SERVED]))
    assert v.status == "fail" and "never exercised" in v.reason


def test_a_request_ending_otherwise_fails() -> None:
    for odd in (TransferOutcome(0, "error", "POST /generate: no answer within 120s"),
                TransferOutcome(200, "abort", "Abort in waiting queue"),
                TransferOutcome(200, "length", "", 5)):  # served short
        v = transfer_failure_verdict(_rec([SERVED, ABORTED, odd]))
        assert v.status == "fail" and "neither served nor" in v.reason, (odd, v.reason)


def test_no_served_follow_up_fails() -> None:
    v = transfer_failure_verdict(_rec([SERVED, ABORTED], follow=[ABORTED] * 3))
    assert v.status == "fail" and "no follow-up request was served in 3 tries" in v.reason


def test_nothing_sent_is_a_stated_skip() -> None:
    assert transfer_failure_verdict(_rec([])).status == "skip"


def _client(answers) -> SGLangClient:
    """A client whose /generate answers come from ``answers`` (status, body) in order."""
    it = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = next(it)
        return httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)

    client = SGLangClient("http://fake", batches=False)
    client._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handler))
    return client


def test_the_workload_keeps_each_end_as_sglang_gave_it() -> None:
    ok = {"output_ids": [1] * 12, "meta_info": {"finish_reason": {"type": "length", "length": 12}}}
    abort = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": FAILED}}}
    one = {"text": "x", "meta_info": {"finish_reason": {"type": "length", "length": 1}, "completion_tokens": 1}}  # no output_ids
    client = _client([(200, ok), (200, abort), (500, {"error": {"message": FAILED}}), (200, abort), (200, one)])
    rec = record_transfer_failures(client, [[1, 2], [3, 4], [5, 6]], new_tokens=12, failure_prob=0.1, follow_up_prompt=[7], follow_up_tries=5)
    assert sorted(o.finish for o in rec.outcomes) == ["abort", "http", "length"]
    assert [o.finish for o in rec.follow_up] == ["abort", "length"]  # retried until served
    assert transfer_failure_verdict(rec).status == "pass"


def test_the_load_is_sent_again_only_while_no_request_failed() -> None:
    ok = {"output_ids": [1] * 12, "meta_info": {"finish_reason": {"type": "length", "length": 12}}}
    one = {"output_ids": [1], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    failed = (500, {"error": {"message": FAILED}})
    # round 1: both served; round 2: one failed -> no round 3; then the follow-up
    rec = record_transfer_failures(_client([(200, ok), (200, ok), (200, ok), failed, (200, one)]), [[1], [2]], new_tokens=12,
                                   failure_prob=0.01, follow_up_prompt=[3], follow_up_tries=3, rounds=3)
    assert len(rec.outcomes) == 4 and [o.finish for o in rec.follow_up] == ["length"]
    assert transfer_failure_verdict(rec).status == "pass"
    # never a failure: exactly `rounds` rounds, then the check refuses to pass on nothing
    rec = record_transfer_failures(_client([(200, ok)] * 6 + [(200, one)]), [[1], [2]], new_tokens=12,
                                   failure_prob=0.01, follow_up_prompt=[3], follow_up_tries=3, rounds=3)
    assert len(rec.outcomes) == 6
    v = transfer_failure_verdict(rec)
    assert v.status == "fail" and "never exercised" in v.reason


def test_a_request_without_an_answer_is_kept_as_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = SGLangClient("http://fake", batches=False)
    client._http = httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handler))
    rec = record_transfer_failures(client, [[1]], new_tokens=4, failure_prob=0.1, follow_up_prompt=[2], follow_up_tries=2)
    assert rec.outcomes[0].finish == "error" and "no answer" in rec.outcomes[0].message
    assert transfer_failure_verdict(rec).status == "fail"


def _transfer_fail_cell(strategy: str = "no_buffer"):
    cells = [c for c in load_matrix().cells if DISAGG_FAILURE_ENV in c.env and c.strategy.name == strategy]
    assert cells, "the matrix has no disagg_transfer_fail cell"
    return cells[0]


def test_the_switch_reaches_the_decode_server_only() -> None:
    from conformance.targets.pd_launch import PDPorts, sglang_cpu_pd_spec
    from conformance.targets.sglang_cpu import SGLangCpuTarget

    cell = _transfer_fail_cell()
    spec = sglang_cpu_pd_spec(cell, SGLangCpuTarget(dtype="float32"), ports=PDPorts(1, 2, 3, 4, 5))
    assert spec.decode.env[DISAGG_FAILURE_ENV] == cell.env[DISAGG_FAILURE_ENV]
    assert DISAGG_FAILURE_ENV not in spec.prefill.env
    assert cell.fault.pd_roles == ("decode",) and float(cell.env[DISAGG_FAILURE_ENV]) > 0
    # the fault's pd_env goes to both PD servers: SGLang's bootstrap timeout ends a prefill
    # request whose decode side failed its handshake within the run
    timeout = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
    assert dict(cell.fault.pd_env) == {timeout: "20"}
    assert spec.prefill.env[timeout] == spec.decode.env[timeout] == "20" and timeout not in cell.env


def test_pd_env_values_must_be_strings(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text((ROOT / "fixtures" / "matrix.toml").read_text().replace(
        'SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT = "20"', "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT = 20", 1))
    with pytest.raises(KitError, match=r"faults\.disagg_transfer_fail.*pd_env values must be strings"):
        load_matrix(path)


def test_a_bad_pd_role_or_suite_in_the_matrix_is_one_line(tmp_path: Path) -> None:
    text = (ROOT / "fixtures" / "matrix.toml").read_text()
    for bad, says in (('pd_roles = ["decode"]', 'pd_roles = ["router"]'), ('suites = ["disagg"]', 'suites = ["nosuch"]')):
        path = tmp_path / "m.toml"
        path.write_text(text.replace(bad, says, 1))
        with pytest.raises(KitError, match=r"faults\.disagg_transfer_fail") as e:
            load_matrix(path)
        assert "\n" not in str(e.value)


def test_only_the_disagg_suite_binds_the_transfer_fail_cells() -> None:
    cmd = [sys.executable, "-m", "pytest", "conformance/suites/disagg", "conformance/suites/leaks", "--collect-only", "-q", "-p", "no:cacheprovider",
           "--target", "sglang-cpu", "--tier", "standard", "--faults", "disagg_transfer_fail"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    ids = [line for line in out.splitlines() if "::" in line and "disagg_transfer_fail]" in line]
    assert ids and all(line.startswith("conformance/suites/disagg/") for line in ids), out[-2000:]
    assert sum("test_pd_transfer_failures[" in line for line in ids) == 2
    assert "test_leaks.py::test_load_returns_to_idle[no-cell-of-this-suite]" in out  # a stated skip, not an empty selection


def test_the_decode_fault_runs_on_its_transfer_fail_cell() -> None:
    from conformance.mutants.catalogue import sglang_cpu_plans
    from conformance.sglang_plugins.faults.catalogue import faults

    name = "pd_decode_failed_transfer_slot_kept"
    assert faults()[name].group == "pd" and faults()[name].cell_fault == "disagg_transfer_fail"
    plan = sglang_cpu_plans((name,))[name]
    assert (plan.faults, plan.tier, plan.suites, plan.strategies) == ("disagg_transfer_fail", "standard", ("disagg",), "no_buffer")
    json.dumps(plan.__dict__)


def test_the_decode_fault_loses_the_frees_of_failed_transfers_only() -> None:
    pytest.importorskip("sglang")
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    from conformance.sglang_plugins.faults import pd_decode_failed_transfer_slot_kept as fault

    class Allocator:
        def __init__(self) -> None:
            self.freed: list[int] = []

        def free(self, index) -> None:
            self.freed.append(int(index.numel()))

    allocator = Allocator()
    queue = SimpleNamespace(scheduler=SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_allocator=allocator)))

    def release(q, decode_req):  # SGLang's release: the request's mamba slot goes back to the pool
        q.scheduler.req_to_token_pool.mamba_allocator.free(torch.tensor([3]))

    served = SimpleNamespace(req=SimpleNamespace(finished_reason=FINISH_LENGTH(length=4)))
    failed = SimpleNamespace(req=SimpleNamespace(finished_reason=FINISH_ABORT(FAILED)))
    fault.lose_frees_on_failure(release, queue, served)
    fault.lose_frees_on_failure(release, queue, decode_req=failed)
    assert allocator.freed == [1]  # the served request's slot came back, the failed one's did not
    assert "free" not in vars(allocator)  # the allocator's own free is back after the call
