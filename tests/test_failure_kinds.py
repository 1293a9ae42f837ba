"""Issue 43, pieces 1 and 4: every failure has a kind and its facts, each failing thing is
judged on its own, shrinking keeps the kind, and a known SGLang bug neither ends a cell's
exploration nor carries a new finding beside it (``conformance/checks/findings.py``,
``conformance/session/known_bugs.py``, ``conformance/programs/explore.py``).  No server."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.checks.kl import kl_verdict
from conformance.checks.leaks import death_findings, leak_verdict
from conformance.errors import KitError
from conformance.checks.findings import KINDS, Finding, failing, findings_of
from conformance.programs.explore import Budget, Exploration, Found, explore
from conformance.programs.program import Burst, Program, Send
from conformance.programs.runner import ProgramFailure, RunStats, failure_type, program_failure
from conformance.programs.strategies import GenSpec
from conformance.recordings import IdleProbe, KLRecording, KLSequence, TokenLogprobs
from conformance.session.known_bugs import expect, load
from conformance.suites.programs.test_programs import programs_verdict

SPEC = GenSpec(vocab_size=500, chunk=64, checkpoint_grid=64, track_grid=256, page_size=1, context_len=4096)
CELL = "qwen3-next-80b-extra_buffer-p1-t256"
NEW = "hit_below_held"  # a new cached_tokens bug
KNOWN = "cold_misaligned"  # what logprob-ids-clip excuses


def _bugs(tmp_path: Path, kind: str = KNOWN, where: str = "", check: str = "programs") -> list:
    (tmp_path / "bug.json").write_text('{"version": 1, "forest": [], "steps": [], "cell": {"id": "x"}}')
    path = tmp_path / "known_bugs.toml"
    path.write_text(f'''[[bug]]
id = "known"
summary = "a known SGLang bug"
releases = ">=0.5.11,<0.5.24"
check = "{check}"
kind = "{kind}"
{where}
replay = "{tmp_path / 'bug.json'}"
''')
    return load(path)


# ------------------------------------------------------------------ kinds and shrinking
def test_each_kind_raises_its_own_exception_type() -> None:
    """Hypothesis tells failures apart by type and raising line; every finding is raised
    from one line, so only the type can keep a shrink from turning one kind into another."""
    a, b = failure_type(NEW), failure_type(KNOWN)
    assert a is not b and issubclass(a, ProgramFailure) and a is failure_type(NEW)
    f = program_failure(3, [Finding(NEW, "request r2: cached_tokens 0: SGLang held a state of 256 tokens")], [])
    assert type(f) is a and f.kind == NEW and str(f).startswith("step 3: request r2")
    with pytest.raises(KitError, match="unknown finding kind 'lost'"):
        Finding("lost", "x")
    assert {"answer_differs_on_hit", "hit_below_held", "hit_above_stored", "leak_mamba", "leak_kv", "server_died:exception"} <= set(KINDS)


def _two_kinds(p: Program) -> RunStats:
    """A new kind on a program with a burst and a send; the known kind on a burst alone:
    deleting the send shrinks the new failure into the known one."""
    bursts, sends = any(isinstance(s, Burst) for s in p.steps), any(isinstance(s, Send) for s in p.steps)
    if bursts and sends:
        raise program_failure(len(p.steps), [Finding(NEW, "request r9: cached_tokens 0: SGLang held a state of 256 tokens")], [])
    if bursts:
        raise program_failure(len(p.steps), [Finding(KNOWN, "request r1 differs from the cold computation: cold side misaligned",
                                                     {"cold_token": 0, "token": 31999})], [])
    return RunStats(requests=1, compared_tokens=1)


def test_a_new_kind_is_not_shrunk_into_a_known_one() -> None:
    """The demo of the issue: a new cached_tokens bug was shrunk into a smaller program that
    failed as the logprob-ids-clip entry, and xfailed.  Now the known failure counts as a
    passing candidate, the new kind is shrunk on its own, and its first sighting is kept."""
    ex = explore(_two_kinds, SPEC, Budget("t", examples=300, shrink_s=60), seed=3, known=lambda f: f.kind == KNOWN)
    assert ex.finding is not None and ex.finding.failure.kind == NEW and ex.finding.first.kind == NEW
    assert any(isinstance(s, Send) for s in ex.finding.program.steps)
    assert ex.finding.first_program is not None and len(ex.finding.program.steps) <= len(ex.finding.first_program.steps)
    # without the known predicate the kinds still stay apart: the finding is of the first kind seen
    plain = explore(_two_kinds, SPEC, Budget("t", examples=300, shrink_s=60), seed=3)
    assert plain.finding is not None and plain.finding.failure.kind == plain.finding.first.kind


def test_each_other_kind_met_while_shrinking_keeps_a_program_that_fails_as_it() -> None:
    """A kind met only while shrinking another (the 0.5.16 Granite page-64 state_not_stored
    was ``also_seen`` with no program) keeps its smallest program: played again, it fails
    with that kind, and the verdict names the replay of each kind."""
    first: list[str] = []

    def two_kinds(p: Program) -> RunStats:
        """NEW on the first program with a burst; KNOWN on every other program tried after it
        (each shrink candidate): whatever path the shrinker takes, it meets the second kind."""
        if first and p.dumps() != first[0]:
            raise program_failure(len(p.steps), [Finding(KNOWN, "request r1: cold side misaligned", {"cold_token": 0})], [])
        if any(isinstance(s, Burst) for s in p.steps):
            first.append(p.dumps())
            raise program_failure(len(p.steps), [Finding(NEW, "request r1: cached_tokens 0: SGLang held a state of 256 tokens")], [])
        return RunStats(requests=1, compared_tokens=1)

    ex = explore(two_kinds, SPEC, Budget("t", examples=300, shrink_s=60), seed=3)
    assert ex.finding is not None and ex.finding.failure.kind == NEW
    assert [o.failure.kind for o in ex.finding.others] == [KNOWN]
    for other in ex.finding.others:
        with pytest.raises(ProgramFailure) as raised:
            two_kinds(other.program)
        assert raised.value.kind == other.failure.kind
    v = programs_verdict(ex, budget="premerge", seed=3, failure=ex.finding.failure.what, replay="r-new", file="f",
                         also={KNOWN: {"failure_file": "f-known", "replay": "r-known"}})
    assert v.details["also_seen"] == [{"kind": KNOWN, "what": ex.finding.others[0].failure.what, "failure_file": "f-known", "replay": "r-known"}]
    assert [f.kind for f in findings_of(v)] == [NEW, KNOWN]


def test_a_known_bug_does_not_end_the_exploration() -> None:
    runs: list[Program] = []

    def known_on_bursts(p: Program) -> RunStats:
        runs.append(p)
        if any(isinstance(s, Burst) for s in p.steps):
            raise program_failure(len(p.steps), [Finding(KNOWN, "cold side misaligned", {"cold_token": 0})], [])
        return RunStats(requests=1, compared_tokens=1)

    ex = explore(known_on_bursts, SPEC, Budget("t", examples=30), seed=0, known=lambda f: f.kind == KNOWN)
    assert ex.finding is None and ex.examples == 30 and len(runs) == 30  # the whole budget, not the first finding
    assert ex.known and all(k.failure.kind == KNOWN for k in ex.known) and ex.total.requests == 30 - len(ex.known)


# ------------------------------------------------------------------ the verdict judges each finding
def test_a_new_kind_beside_a_known_bug_is_reported_as_new(tmp_path: Path) -> None:
    bugs = _bugs(tmp_path, where="where = { cold_token = 0 }")
    known = Found(program_failure(2, [Finding(KNOWN, "cold side misaligned", {"cold_token": 0})], []), Program((), ()), 1, 1.0)
    new = Found(program_failure(4, [Finding(NEW, "request r2: cached_tokens 0: SGLang held a state of 256 tokens")], []), Program((), ()), 5, 3.0)
    both = programs_verdict(Exploration(examples=7, finding=new, known=[known]), budget="premerge", seed=0, failure=new.failure.what,
                            replay="r", file="f")
    assert [f.kind for f in findings_of(both)] == [NEW, KNOWN]
    filed = expect(both, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs)
    assert "known_bug" not in filed.details and filed.details["known_findings"][0]["known_bug"] == "known"  # red: the new one
    only_known = programs_verdict(Exploration(examples=7, known=[known], stats=[RunStats(requests=3, compared_tokens=3)]),
                                  budget="premerge", seed=0)
    assert only_known.status == "fail" and only_known.metrics["known_failures"] == 1
    assert "known_bug" in expect(only_known, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details  # xfails
    # not vacuous: the same known finding with facts outside the entry's where stays red
    other = programs_verdict(Exploration(examples=2, known=[Found(program_failure(2, [Finding(KNOWN, "x", {"cold_token": 7})], []),
                                                                  Program((), ()), 1, 1.0)]), budget="premerge", seed=0)
    assert "known_bug" not in expect(other, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details


def _kl_seq(scenario: str, served: float) -> KLSequence:
    def tl(lp: float) -> TokenLogprobs:
        return TokenLogprobs((7,), (lp,), (((7, lp), (8, -3.0)),))
    return KLSequence(scenario=scenario, start=100, cached_tokens=96, served=tl(served), reference=tl(-0.1), floor=tl(-0.1), floor_prefill=tl(-0.1))


def test_each_kl_sequence_is_judged_on_its_own(tmp_path: Path) -> None:
    """Before: the kl reason joined the worst sequence and the k3 mean with "; ", so an entry
    matching one line excused the others.  Now each failing sequence is a finding with its
    scenario, and an entry for decode_hit leaves a prefill_hit sequence red."""
    rec = KLRecording(sequences=(_kl_seq("decode_hit", -2.0), _kl_seq("prefill_hit", -1.5), _kl_seq("prefill_hit", -0.1)), cache_enabled=True)
    v = kl_verdict(rec, chunk=64, track_interval=256, exact=True)
    found = findings_of(v)
    assert v.status == "fail" and {f.facts.get("scenario") for f in found} == {"decode_hit", "prefill_hit"}
    assert all(f.kind == "answer_differs_on_hit" for f in found)
    bugs = _bugs(tmp_path, kind="answer_differs_on_hit", where='where = { scenario = "decode_hit" }', check="kl")
    assert "known_bug" not in expect(v, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details
    only_decode = kl_verdict(KLRecording(sequences=(_kl_seq("decode_hit", -2.0), _kl_seq("prefill_hit", -0.1)), cache_enabled=True),
                             chunk=64, track_interval=256, exact=True)
    assert "known_bug" in expect(only_decode, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details


# ------------------------------------------------------------------ deaths and pools
MAMBA_REPORT = ("ValueError: pool memory leak detected! [full] total=8192, available=8192, evictable=0, protected=0, session_held=0, uncached=0\n"
                "[mamba] total=48, available=45, evictable=0, protected=0, session_held=0, uncached=0")
KV_REPORT = ("ValueError: pool memory leak detected! [full] total=8192, available=8000, evictable=0, protected=0, session_held=0, uncached=0\n"
             "[mamba] total=48, available=48, evictable=0, protected=0, session_held=0, uncached=0")
TYPE_ERROR = ('Scheduler hit an exception: Traceback (most recent call last):\n'
              '  File "/x/site-packages/sglang/srt/managers/tokenizer_manager.py", line 2836, in convert_logprob_style\n'
              "    if len(recv_obj.input_top_logprobs_val) > 0:\n"
              "TypeError: object of type 'NoneType' has no len()\n")


def test_a_death_is_named_by_what_killed_it() -> None:
    assert [(f.kind, f.facts["pool"]) for f in death_findings("server died", MAMBA_REPORT)] == [("leak_mamba", "mamba")]
    assert [(f.kind, f.facts["pool"]) for f in death_findings("server died", KV_REPORT)] == [("leak_kv", "full")]
    (mamba,) = death_findings("server died: ValueError: pool memory leak detected! [full] total=8192, available=8192", MAMBA_REPORT)
    assert mamba.line.endswith("; the broken pool: [mamba] total=48, available=45, evictable=0, protected=0, session_held=0, uncached=0")
    (full,) = death_findings("server died: " + KV_REPORT.splitlines()[0], KV_REPORT)  # the line already names it
    assert "the broken pool" not in full.line
    (f,) = death_findings("server died", TYPE_ERROR)
    assert f.kind == "server_died:exception" and f.facts == {"at": "tokenizer_manager.py:2836", "exception": "TypeError"} and not f.catch
    assert death_findings("server died", "")[0].kind == "server_died:unexplained"


def test_the_leak_entries_excuse_only_their_pool(tmp_path: Path) -> None:
    """The "pool memory leak detected" regex matched a KV leak as well as a Mamba one."""
    bugs = _bugs(tmp_path, kind="leak_mamba", check="leaks")
    probes = [IdleProbe("s", reached=True, values={}, waited_s=0.0, requests=1)]

    def died(log: str):
        return leak_verdict(probes, log_text=log, alive=False, exit_code=1, require_load_evidence=False, gauges=(),
                            scenario_errors=["ServerDiedError: server died"])

    mamba, kv = died(MAMBA_REPORT), died(KV_REPORT)
    assert {f.kind for f in findings_of(mamba)} == {"leak_mamba"}  # the scenario error is the death's consequence
    assert "known_bug" in expect(mamba, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details
    assert "leak_kv" in {f.kind for f in findings_of(kv)}
    assert "known_bug" not in expect(kv, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs).details


def test_a_merged_verdict_keeps_each_parts_findings() -> None:
    from conformance.records import Verdict, merge

    a = failing("leaks", [Finding("leak_mamba", "a: mamba leaked", {"pool": "mamba"})])
    b = failing("leaks", [Finding("leak_kv", "b: kv leaked", {"pool": "kv"})])
    assert [f.kind for f in findings_of(merge("leaks", [a, b]))] == ["leak_mamba", "leak_kv"]
    legacy = Verdict("leaks", "fail", {}, "a part without kinds")  # then the merged verdict is judged by its reason alone
    assert [f.kind for f in findings_of(merge("leaks", [a, legacy]))] == ["unclassified"]


def test_a_history_row_links_the_program_of_the_kind_no_known_bug_explains(tmp_path: Path) -> None:
    """The 0.5.16 Granite page-64 row: its shrunk program's kind was a known bug, the kind met
    while shrinking was not, and the row linked the known one's program.  Now the row links
    the program a judge has to play; with no known finding, or the main kind open, the shrunk one."""
    from conformance.commands.history import report_rows

    bugs = _bugs(tmp_path, where="where = { cold_token = 0 }")
    main = Found(program_failure(2, [Finding(KNOWN, "cold side misaligned", {"cold_token": 0})], []), Program((), ()), 1, 1.0)
    main.others = [Found(program_failure(3, [Finding(NEW, "request r3: cached_tokens 0: SGLang held a state of 256 tokens")], []),
                         Program((), ()), 1, 1.0)]
    also = {NEW: {"failure_file": "new.json", "replay": "replay new.json"}}

    def row_replay(found: Found, bugs: list) -> str:
        v = programs_verdict(Exploration(examples=3, finding=found), budget="premerge", seed=0, failure=found.failure.what,
                             replay="replay main.json", file="main.json", also=also)
        filed = expect(v, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs)
        (row,) = report_rows("0.5.23", {"cells": [{"id": CELL, "checks": {"programs": filed.to_json()}}]})
        assert row.status == "fail"
        return row.replay

    assert row_replay(main, bugs) == "new.json"
    assert row_replay(main, []) == "main.json"  # nothing known: the shrunk program
    flipped = Found(main.others[0].failure, Program((), ()), 1, 1.0, others=[Found(main.failure, Program((), ()), 1, 1.0)])
    assert row_replay(flipped, bugs) == "main.json"  # the shrunk program's own kind is open
