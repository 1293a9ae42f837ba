"""The programs' coverage counters (conformance/programs/coverage.py): the observe plugin's
pressure records, the counters read from them, and the rule that a nightly pressure cell
whose counters stayed 0 is red (issue 44); no server."""

from __future__ import annotations

import json
from enum import Enum
from types import SimpleNamespace

from conformance.matrix.axes import coverage_required
from conformance.programs.coverage import Coverage, program_coverage, read_coverage, vacuous_pressure
from conformance.programs.evidence import RequestLog
from conformance.programs.explore import Exploration
from conformance.programs.runner import ProgramRun, RunStats
from conformance.sglang_contract.metric_names import KIT_TREE_AUDITS_TOTAL
from conformance.sglang_plugins import observe
from conformance.sglang_plugins.activation import REPORT_ENV
from conformance.sglang_plugins.token_digest import token_digest
from conformance.suites.programs.test_programs import programs_verdict


class AddReqResult(Enum):  # SGLang's admission results, by name
    CONTINUE = 1
    NO_TOKEN = 2
    OTHER = 3


def _req(rid: str, matched: int, tokens: list[int]) -> SimpleNamespace:
    """SGLang's Req as every release has it: a prompt and its decoded tokens (no ``fill_ids``,
    which only 0.5.12 had; reading it lost every refusal on 0.5.13-0.5.23)."""
    return SimpleNamespace(rid=rid, prefix_len=matched, origin_input_ids=tokens[:-2], output_ids=tokens[-2:])


def _log(tmp_path, monkeypatch) -> RequestLog:
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "cell.plugins.jsonl"))
    monkeypatch.setattr(observe, "_REFUSED", set())
    return RequestLog(tmp_path / "cell.requests.jsonl")


def test_the_pressure_hooks_record_refusals_after_a_match_retractions_and_splits(tmp_path, monkeypatch):
    log = _log(tmp_path, monkeypatch)
    tokens = list(range(40))
    observe.write_requests([{"ev": "start", "state_evictions": True, "pressure": ["refused", "retract", "split"]},
                            {"ev": "state_stored", "len": 32, "key": token_digest(tokens[:32])}])
    refuse = lambda adder, req, *a: AddReqResult.NO_TOKEN  # noqa: E731
    for _ in range(3):  # a waiting request is refused every round: recorded once
        assert observe.refused_observed(refuse, object(), _req("a", 32, tokens), False, None) is AddReqResult.NO_TOKEN
    observe.refused_observed(refuse, object(), _req("b", 0, tokens))  # no match: not a refusal after a match
    observe.refused_observed(lambda adder, req: AddReqResult.OTHER, object(), _req("c", 32, tokens))  # not for lack of room
    observe.write_requests([{"ev": "evict", "mamba_num_evicted": 1},
                            {"ev": "state_evicted", "len": 32, "key": token_digest(tokens[:32]), "by": "walk"},
                            {"ev": "prefill", "rid": "a", "prefix": 0, "extend": 40, "cut": False, "track": None}])
    retracted = ([SimpleNamespace(rid="d")], 0.5, [])
    assert observe.retract_observed(lambda batch: retracted, object()) is retracted
    observe.retract_observed(lambda batch: ([], 0.5, []), object())  # nothing retracted: no record
    observe.split_observed(lambda *a: "node", object(), object())
    log.refresh()
    assert read_coverage(log) == Coverage(refused_after_match=1, matched_then_evicted=1, retractions=1, eviction_walks=1,
                                          nodes_evicted=1, splits=1, tree_audits=None)


def test_a_refusal_is_recorded_on_releases_whose_match_is_a_tensor_of_indices(tmp_path, monkeypatch):
    """Up to 0.5.21 a Req has no ``prefix_len``: the match is ``prefix_indices``, a tensor whose
    truth value torch refuses when it is empty (that error lost every refusal on 0.5.21)."""
    import torch

    log = _log(tmp_path, monkeypatch)
    monkeypatch.setattr(observe, "_OBSERVER_FAILED", set())
    tokens = list(range(40))
    observe.write_requests([{"ev": "start", "state_evictions": True, "pressure": ["refused"]}])
    refuse = lambda adder, req, *a: AddReqResult.NO_TOKEN  # noqa: E731
    old = lambda rid, n: SimpleNamespace(rid=rid, prefix_indices=torch.arange(n), origin_input_ids=tokens, output_ids=[])  # noqa: E731
    observe.refused_observed(refuse, object(), old("cold", 0))  # an empty match: no refusal after a match
    observe.refused_observed(refuse, object(), old("warm", 32))
    log.refresh()
    assert not log.observer_errors and read_coverage(log).refused_after_match == 1


def test_the_pressure_hooks_never_break_the_server(tmp_path, monkeypatch):
    _log(tmp_path, monkeypatch)
    assert observe.refused_observed(lambda adder, req: AddReqResult.NO_TOKEN, object(), object()) is AddReqResult.NO_TOKEN
    assert observe.retract_observed(lambda batch: None, object()) is None


def test_a_hook_whose_observer_fails_reads_as_not_recorded_not_as_zero(tmp_path, monkeypatch):
    """An observer that cannot read SGLang's objects (a renamed field) leaves SGLang's result
    alone, says so once in the request log, and its counter is None (so a pressure cell is
    red as "not recorded"), never a 0 that reads as "SGLang never refused"."""
    log = _log(tmp_path, monkeypatch)
    monkeypatch.setattr(observe, "_OBSERVER_FAILED", set())
    observe.write_requests([{"ev": "start", "state_evictions": True, "pressure": ["refused", "retract"]}])
    renamed = SimpleNamespace(rid="a", prefix_len=32, fill_ids=list(range(40)))  # no origin_input_ids
    for _ in range(2):
        assert observe.refused_observed(lambda adder, req: AddReqResult.NO_TOKEN, object(), renamed) is AddReqResult.NO_TOKEN
    log.refresh()
    assert log.events.get("observer_error") == 1 and "AttributeError" in log.observer_errors["refused"]
    c = read_coverage(log)
    assert c.refused_after_match is None and c.matched_then_evicted is None and c.retractions == 0
    assert vacuous_pressure(c, ("refused_after_match",)) == ["refused_after_match not recorded"]


def test_a_refusal_whose_state_stayed_is_not_matched_then_evicted_and_unhooked_counters_are_none(tmp_path, monkeypatch):
    log = _log(tmp_path, monkeypatch)
    observe.write_requests([{"ev": "start", "state_evictions": True},  # a plugin without pressure hooks
                            {"ev": "refused", "rid": "a", "matched": 8, "key": "k"},
                            {"ev": "prefill", "rid": "a", "prefix": 8, "extend": 4, "cut": False, "track": None},
                            {"ev": "state_evicted", "len": 8, "key": "k", "by": "walk"},  # after its admission
                            {"ev": "tree_audit"}])  # not a source: tree audits are the audit's own counter
    log.refresh()
    c = read_coverage(log)
    assert c.refused_after_match is None and c.retractions is None and c.splits is None and c.matched_then_evicted is None
    assert c.eviction_walks == 0 and c.nodes_evicted == 1 and c.tree_audits is None
    log.pressure = ("refused",)
    assert read_coverage(log).matched_then_evicted == 0 and read_coverage(log).refused_after_match == 1
    assert read_coverage(None) == Coverage()


def test_a_programs_tree_audits_are_the_audits_own_counter_over_the_program():
    values = {KIT_TREE_AUDITS_TOTAL: 7.0}
    run = SimpleNamespace(stats=RunStats(), _audits0=None, _new_violations=list, t=SimpleNamespace(requests=None))
    ProgramRun._tree_audit(run, values)  # the first reading: the audits before the program ran
    ProgramRun._tree_audit(run, {KIT_TREE_AUDITS_TOTAL: 12.0})
    assert run.stats.tree_audits == 12
    before = Coverage(eviction_walks=1)
    c = program_coverage(Coverage(eviction_walks=4), before, run.stats.tree_audits)
    assert c.tree_audits == 12 and c.eviction_walks == 3
    quiet = SimpleNamespace(stats=RunStats(), _audits0=None, _new_violations=list, t=SimpleNamespace(requests=None))
    ProgramRun._tree_audit(quiet, {})  # a server that does not audit publishes no counter
    assert program_coverage(Coverage(), Coverage(), quiet.stats.tree_audits).tree_audits is None


def test_a_programs_coverage_is_what_grew_and_sums_over_programs():
    a = Coverage(refused_after_match=3, eviction_walks=5, nodes_evicted=2, retractions=0)
    b = Coverage(refused_after_match=1, eviction_walks=2, nodes_evicted=2, retractions=0)
    assert a.minus(b) == Coverage(refused_after_match=2, eviction_walks=3, nodes_evicted=0, retractions=0)
    assert Coverage.total([a, Coverage()]).to_json() == a.to_json()


def _cell(**options: str) -> SimpleNamespace:
    return SimpleNamespace(strategy=SimpleNamespace(overlap=True), options=tuple(options.items()))


def test_a_small_pool_requires_its_pressure_counters():
    assert coverage_required(_cell()) == ()
    assert coverage_required(_cell(mamba_pool="small")) == ("refused_after_match", "matched_then_evicted", "eviction_walks", "nodes_evicted")
    assert "retractions" in coverage_required(_cell(kv_pool="small"))


def test_a_nightly_pressure_cell_whose_counters_stayed_zero_is_red():
    required = coverage_required(_cell(kv_pool="small"))
    zero = Coverage(refused_after_match=0, matched_then_evicted=0, retractions=0, eviction_walks=4, nodes_evicted=0, splits=2)
    ex = Exploration(examples=5, seconds=1.0, stats=[RunStats(requests=9, compared_tokens=30, coverage=zero)])
    v = programs_verdict(ex, budget="nightly", seed=0, pressure=required)
    assert v.status == "fail" and v.details["findings"][0]["kind"] == "vacuous"
    assert "refused_after_match stayed 0" in v.reason and "retractions stayed 0" in v.reason and "eviction_walks" not in v.reason
    assert v.details["coverage"]["eviction_walks"] == 4
    json.dumps(v.to_json())
    assert vacuous_pressure(Coverage(), ("retractions",)) == ["retractions not recorded"]


def test_the_pressure_rule_is_not_vacuous_a_reached_pressure_cell_passes():
    moved = Coverage(refused_after_match=2, matched_then_evicted=1, retractions=3, eviction_walks=4, nodes_evicted=5, splits=1)
    ex = Exploration(examples=5, seconds=1.0, stats=[RunStats(requests=9, compared_tokens=30, coverage=moved)])
    assert programs_verdict(ex, budget="nightly", seed=0, pressure=coverage_required(_cell(kv_pool="small"))).status == "pass"
    idle = Exploration(examples=5, seconds=1.0, stats=[RunStats(requests=9, compared_tokens=30)])
    assert programs_verdict(idle, budget="premerge", seed=0).status == "pass"  # not a pressure run: counters reported only


def test_splits_on_a_rust_tree_core_are_not_recorded(tmp_path, monkeypatch):
    log = _log(tmp_path, monkeypatch)
    observe.write_requests([{"ev": "start", "state_evictions": True, "pressure": ["refused", "retract", "split", "tree_core"]}])
    observe.tree_core_observed(lambda name, params, comps: SimpleNamespace(), "python", None, {})
    log.refresh()
    assert log.tree_core == "types.SimpleNamespace" and read_coverage(log).splits == 0
    log.tree_core = "sglang.srt.mem_cache.rust_tree_core.mem_cache.RustTreeCore"
    assert read_coverage(log).splits is None


def test_splits_under_a_tree_core_its_observer_could_not_name_are_not_recorded(tmp_path, monkeypatch):
    """The core may be Rust, whose splits the split hook never sees: 0 would read as "no split"."""
    log = _log(tmp_path, monkeypatch)
    monkeypatch.setattr(observe, "_OBSERVER_FAILED", set())
    monkeypatch.setattr(observe, "write_requests", _failing_for("tree_core", observe.write_requests))
    observe.write_requests([{"ev": "start", "state_evictions": True, "pressure": ["refused", "retract", "split", "tree_core"]}])
    core = SimpleNamespace()
    assert observe.tree_core_observed(lambda name, params, comps: core, "python", None, {}) is core
    log.refresh()
    assert log.tree_core is None and "tree_core" in log.observer_errors and read_coverage(log).splits is None


def _failing_for(ev: str, write):
    """``write_requests`` that fails on records of ``ev`` (an observer that cannot write them)."""
    def wrapped(records):
        if any(r.get("ev") == ev for r in records):
            raise OSError("disk full")
        return write(records)
    return wrapped


def test_the_forced_retraction_cells_require_retractions():
    from conformance.matrix.cells import load_matrix

    cells = [c for c in load_matrix().cells if c.fault.name == "forced_retract"]
    assert cells and all(c.tier == "nightly" and "retractions" in coverage_required(c) for c in cells)
    assert dict(cells[0].fault.env) == {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "3"}


def test_a_death_after_the_audit_named_a_leak_is_the_audits_finding_first(tmp_path, monkeypatch):
    """SGLang died (its own assertion: the pool ran out of leaked slots) after the audit had named
    the leak: the program's failure is the audit's finding, the death its consequence."""
    log = _log(tmp_path, monkeypatch)
    observe.write_requests([{"ev": "start", "state_evictions": True},
                            {"ev": "tree_violation", "rule": "slot_owned", "path": "", "line": "mamba slot 17 is counted used ..."}])
    crash = "AssertionError: Not enough space for mamba ping pong idx\n  File \"/x/sglang/srt/mem_cache/memory_pool.py\", line 1761"
    run = SimpleNamespace(_violations0=0, t=SimpleNamespace(requests=log, log_text=lambda: crash))
    run._new_violations = lambda: ProgramRun._new_violations(run)
    kinds = [f.kind for f in ProgramRun._death(run, "exited with code -9")]
    assert kinds[0] == "tree_structure" and kinds[-1].startswith("server_died") and len(kinds) == 2
    assert [f.kind for f in ProgramRun._death(run, "exited")] == kinds[1:]  # a violation is judged once
