"""The tree audit on real SGLang (``conformance/sglang_plugins/tree_audit.py``, run by the
observe plugin before every batch and at idle publishes): on a clean ``sglang-cpu`` server
whose 48-slot mamba pool overflows (branching prompts, evictions, a flush), every audit
passes and audits ran (the non-vacuous side); with the seeded tree-structure fault the audit
names the broken rule and the node's path.  One server each (marker ``fault_probe``:
deselected by default, ``-m fault_probe`` runs it)."""

from __future__ import annotations

import json

import pytest
from sglang_cpu_probes import aborted_decode_then_idle, cell_for, fresh_idle_metrics, probe_server, prompts, tail

from conformance.programs.evidence import RequestLog
from conformance.sglang_contract.metric_names import KIT_TREE_AUDIT_SECONDS_TOTAL, KIT_TREE_AUDITS_TOTAL
from conformance.workloads.runners import generate_tokens

pytestmark = [pytest.mark.fault_probe, pytest.mark.timeout(900)]

#: the seeded structure fault this file probes directly (tests/test_sglang_faults.py counts it)
FAULT = "child_under_wrong_key"


def drive(server) -> tuple[RequestLog, dict[str, float]]:
    """Branching prompts past the mamba pool (evictions, splits), a flush, more prompts;
    then the per-request log and the idle gauges."""
    bases = prompts((96,) * 8, seed=44)
    for i, b in enumerate(bases):
        generate_tokens(server.client, [b + tail(40, f"a{i}"), b + tail(24, f"b{i}")], 4)
    for p in prompts((150,) * 40, seed=45):  # past the 48-slot pool: SGLang's eviction walk runs
        generate_tokens(server.client, [p], 2)
    server.client.flush_cache(attempts=40, pause_s=0.25)
    for i, b in enumerate(bases[:4]):
        generate_tokens(server.client, [b + tail(30, f"c{i}")], 3)
    values = fresh_idle_metrics(server.client)
    log = RequestLog(server.report.with_name(server.report.name.removesuffix(".plugins.jsonl") + ".requests.jsonl"))
    log.refresh()
    return log, values


def test_a_clean_tree_passes_every_audit(tmp_path) -> None:
    with probe_server(cell_for("qwen3-next", "extra_buffer"), tmp_path) as server:
        log, values = drive(server)
        audits, cost = values.get(KIT_TREE_AUDITS_TOTAL, 0), values.get(KIT_TREE_AUDIT_SECONDS_TOTAL, 0)
        print(json.dumps({"audits": audits, "seconds": cost, "ms_per_audit": 1000 * cost / max(audits, 1),
                          "rules": log.tree_rules, "violations": log.tree_violations[:5], "errors": log.tree_audit_errors}))
        assert audits > 0, "no audit ran: a clean verdict would be vacuous"
        assert not log.tree_audit_errors
        assert log.tree_violations == []


@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_clean_tree_passes_every_audit_on_each_core(tmp_path, core) -> None:
    """The same on each tree core (``tree_core`` axis): the Python core runs every rule, the Rust core those it can feed."""
    options = (("tree_core", core),) if core == "python" else ()  # the plain cell runs 0.5.23's default core, rust
    with probe_server(cell_for("qwen3-next", "extra_buffer", options=options), tmp_path) as server:
        log, values = drive(server)
        audits, cost = values.get(KIT_TREE_AUDITS_TOTAL, 0), values.get(KIT_TREE_AUDIT_SECONDS_TOTAL, 0)
        print(json.dumps({"core": core, "audits": audits, "ms_per_audit": 1000 * cost / max(audits, 1), "rules": log.tree_rules,
                          "stored": sum(map(len, log.states_stored.values())), "evicted": sum(map(len, log.states_evicted.values()))}))
        assert audits > 0 and not log.tree_audit_errors and log.tree_violations == []
        assert [tree.endswith("/" + core) for tree in log.tree_rules] == [True]
        assert "slot_owned" in next(iter(log.tree_rules.values()))  # the padding was taken at the first idle audit
        assert log.per_node and log.states_stored and log.states_evicted  # the per-node records work on this core


@pytest.mark.fault_probe_fast  # CI keeps the audit's catch on real SGLang (one server, ~40 s)
def test_the_audit_names_a_child_filed_under_the_wrong_key(tmp_path) -> None:
    """The seeded structure fault (``child_under_wrong_key``, Python tree core): SGLang's own
    sanity check (strict idle checks on) passes it and the server lives; the audit names the
    rule ``child_key`` and the node's path."""
    with probe_server(cell_for("qwen3-next", "extra_buffer", options=(("tree_core", "python"),)), tmp_path, fault="child_under_wrong_key") as server:
        for p in prompts((96,) * 6, seed=46):
            generate_tokens(server.client, [p], 2)
        values = fresh_idle_metrics(server.client)
        log = RequestLog(server.report.with_name(server.report.name.removesuffix(".plugins.jsonl") + ".requests.jsonl"))
        log.refresh()
        print(json.dumps({"fired": server.fired("child_under_wrong_key"), "audits": values.get(KIT_TREE_AUDITS_TOTAL),
                          "violations": log.tree_violations}))
        assert server.fired("child_under_wrong_key") >= 1
        wrong = [v for v in log.tree_violations if v["rule"] == "child_key"]
        assert len(wrong) == 1 and wrong[0]["path"], log.tree_violations
        assert server.process.exit_reason() is None  # SGLang's own checks did not see it


def test_the_audit_names_a_leaked_slot_before_the_server_goes_idle(tmp_path) -> None:
    """A seeded leak (``abort_leak``: an aborted request's release loses its mamba frees; SGLang's
    strict idle check off, so the server lives): the slots it leaks are counted used, held by no
    tree node and no request, and the audit's ``slot_owned`` names each of them."""
    with probe_server(cell_for("qwen3-next", "extra_buffer"), tmp_path, fault="abort_leak", strict=False) as server:
        aborted_decode_then_idle(server.client)
        log = RequestLog(server.report.with_name(server.report.name.removesuffix(".plugins.jsonl") + ".requests.jsonl"))
        log.refresh()
        fired = server.fired("abort_leak")
    owned = [v for v in log.tree_violations if v["rule"] == "slot_owned"]
    print(json.dumps({"fired": fired, "violations": log.tree_violations}))
    assert fired >= 1 and owned and all("no tree node and no request holds it" in v["line"] for v in owned), log.tree_violations
