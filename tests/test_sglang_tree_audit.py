"""The tree audit on real SGLang (``conformance/sglang_plugins/tree_audit.py``, run by the
observe plugin before every batch and at idle publishes): on a clean ``sglang-cpu`` server
whose 48-slot mamba pool overflows (branching prompts, evictions, a flush), every audit
passes and audits ran (the non-vacuous side); with the seeded tree-structure fault the audit
names the broken rule and the node's path.  One server each (marker ``fault_probe``:
deselected by default, ``-m fault_probe`` runs it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sglang_cpu_probes import aborted_decode_then_idle, cell_for, fresh_idle_metrics, probe_server, prompts, tail

from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.programs.evidence import RequestLog
from conformance.session.known_bugs import installed_release, load
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


#: A real SGLang bug the audit's insert-time rule ``state_position`` names (fixtures/known_bugs.toml).
PAGE_FLOOR_BUG = "unaligned-prefix-track-state-keyed-at-page-floor"
ROOT = Path(__file__).resolve().parents[1]


def _replay(program: Path, log_dir: Path) -> tuple[str, RequestLog]:
    """``hybrid-conformance replay PROGRAM --target sglang-cpu`` as typed; its output and the
    served cell's per-request log."""
    proc = subprocess.run(["hybrid-conformance", "replay", str(program), "--target", "sglang-cpu", "--log-dir", str(log_dir)],
                          capture_output=True, text=True, timeout=840, cwd=ROOT)
    cell = json.loads(program.read_text())["cell"]["id"]
    log = RequestLog(log_dir / f"{cell}.requests.jsonl")
    log.refresh()
    return proc.stdout + proc.stderr, log


@pytest.mark.fault_probe_fast  # CI keeps the insert-time rule's catch of SGLang's own bug (one replay, ~90 s)
def test_the_audit_names_a_state_keyed_at_the_page_floor_of_where_it_was_tracked(tmp_path) -> None:
    """Not a seeded fault but SGLang's own bug (known bug ``unaligned-prefix-track-state-keyed-at-page-floor``):
    a streaming turn starting at 71 tokens tracks its state at 199, and on page 64 the tree keys
    it at 192; the replay's first finding is rule ``state_position`` at node 192 with the page
    floor named. The non-vacuous side (a clean run passes with the rule judged) is the seeded
    test's clean replay below; the same program on the page-1 cell is the scheduled one after it."""
    (bug,) = [b for b in load(ROOT / "fixtures" / "known_bugs.toml") if b.id == PAGE_FLOOR_BUG]
    release = installed_release()
    if not bug.in_range(release):
        pytest.skip(f"the installed sglang {release} is outside {PAGE_FLOOR_BUG}'s releases {bug.releases}")
    out, log = _replay(bug.replay_path(), tmp_path / "paged")
    assert "FAIL at step 3: tree audit: rule state_position broken at node 192" in out and "page floor of 199" in out, out[-2000:]
    assert [v["path"] for v in log.tree_violations if v["rule"] == "state_position"] == ["192"], log.tree_violations


def test_the_page_floor_program_on_page_1_keys_each_state_where_it_was_tracked(tmp_path) -> None:
    """The page-floor bug's program on the page-1 cell passes with rule ``state_position``
    judged there: without a page floor the key is where the state was tracked."""
    (bug,) = [b for b in load(ROOT / "fixtures" / "known_bugs.toml") if b.id == PAGE_FLOOR_BUG]
    program = json.loads(bug.replay_path().read_text())
    program["cell"].update(id=program["cell"]["id"].replace("-p64-", "-p1-"), page_size=1)
    page1 = tmp_path / "page1.json"
    page1.write_text(json.dumps(program))
    out, log = _replay(page1, tmp_path / "page1")
    assert "run 1: PASS" in out and "0/1 runs failed" in out, out[-2000:]
    assert log.tree_violations == [] and any("state_position" in rules for rules in log.tree_rules.values()), log.tree_rules


@pytest.mark.fault_probe_fast  # the rule's catch of a seeded fault on the installed release (two replays, ~2 min)
def test_the_audit_names_a_seeded_state_donated_under_a_shorter_key(tmp_path) -> None:
    """The seeded fault ``strip_thinking_state_past_key`` drops 0.5.22's guard: r1 (249 prompt
    tokens) reasons past the 256 track boundary, and its finish donates the state tracked at
    256 under the 249-token prompt key. Rule ``state_position`` names it (no page floor: page 1);
    the same program clean passes with the rule judged. The program is the replay of the known
    bug this fault puts back, so it runs where that bug is fixed."""
    (bug,) = [b for b in load(ROOT / "fixtures" / "known_bugs.toml") if b.id == "strip-thinking-finish-donates-state-past-prompt-key"]
    release = installed_release()
    if bug.in_range(release):
        pytest.skip(f"the installed sglang {release} has {bug.id} itself: the clean run would fail too")
    program = json.loads(bug.replay_path().read_text())
    clean, faulted = tmp_path / "clean.json", tmp_path / "faulted.json"
    clean.write_text(json.dumps({**program, "env": {}}))
    faulted.write_text(json.dumps({**program, "env": {SGLANG_FAULT_ENV: "strip_thinking_state_past_key"}}))
    out, log = _replay(faulted, tmp_path / "faulted")
    assert "rule state_position broken at node 249" in out and "tracked its state at 256 tokens: the node" in out, out[-2000:]
    assert "page floor" not in out
    out, log = _replay(clean, tmp_path / "clean")
    assert "run 1: PASS" in out, out[-2000:]
    assert log.tree_violations == [] and any("state_position" in rules for rules in log.tree_rules.values()), log.tree_rules
