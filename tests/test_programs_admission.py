"""Which admission computed a request's first differing output, from SGLang's own records
(the observe plugin's ``prefill``, ``retract`` and ``refused`` lines): a retracted request is
prefilled again from some prefix, and a refusal after a match may leave state behind; the
finding carries ``admission_prefix`` and ``refused_match`` so a known bug's ``where`` can ask
for that evidence, not for a permission.  The record shapes are those of a 0.5.11 forced-
retraction run (t7: five admissions from 0, a refusal that had matched 128, two from 128).  No server."""

from __future__ import annotations

import json
from pathlib import Path

from conformance.checks.differential import Difference
from conformance.programs.evidence import RecordedAdmission, RequestLog
from conformance.programs.oracle import Served
from conformance.programs.runner import difference_finding

T7 = [(0, 139), (0, 143), (0, 147), (0, 151), "refused", (0, 152), (128, 25), (128, 26)]


def _log(tmp_path: Path, shape=T7) -> RequestLog:
    lines = [{"ev": "start"}]
    for step in shape:
        if step == "refused":
            lines.append({"ev": "refused", "rid": "x-t7", "matched": 128, "key": "k"})
            continue
        lines += [{"ev": "prefill", "rid": "x-t7", "prefix": step[0], "extend": step[1], "cut": False, "track": 128},
                  {"ev": "retract", "rids": ["x-t7"]}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    log = RequestLog(path)
    log.refresh()
    return log


def test_the_admission_that_computed_a_position_is_the_last_whose_prefill_ended_at_or_before_it(tmp_path: Path) -> None:
    log = _log(tmp_path)
    assert log.computed_by("x-t7", 140) == RecordedAdmission(0, 139, 0)  # decoded after the first admission
    assert log.computed_by("x-t7", 152) == RecordedAdmission(0, 152, 128)  # prefilled from 0 right after the refusal
    assert log.computed_by("x-t7", 153) == RecordedAdmission(128, 153, 0)
    assert log.computed_by("x-t7", 100) is None  # before any prefill ended: nothing computed it
    assert log.computed_by("x-other", 152) is None


def test_chunks_of_one_admission_are_one_admission(tmp_path: Path) -> None:
    log = _log(tmp_path, [(0, 64), (64, 64), (128, 11)])  # chunks continue each other: one admission from 0
    assert log.computed_by("x-t7", 139) == RecordedAdmission(0, 139, 0)


def test_the_finding_names_the_admission_and_its_refusal_as_facts(tmp_path: Path) -> None:
    prompt = tuple(range(139))
    s = Served("t7", 0, prompt, 16, {}, 0, 1, response={"output_ids": list(range(16)), "meta_info": {"cached_tokens": 0}})
    diff = Difference("output", "output logprob 13 (position 152): served -0.249371, cold -0.293064", (("position", 152),))
    f = difference_finding(s, [diff], retracted=6, admission=_log(tmp_path).computed_by("x-t7", 152))
    assert f.kind == "answer_differs_on_miss"
    assert f.facts["admission_prefix"] == 0 and f.facts["refused_match"] == 128 and f.facts["retracted"] == 6
    assert "computed by its admission with prefix 0 after a refusal that had matched 128" in f.line
    plain = difference_finding(s, [diff])
    assert "admission_prefix" not in plain.facts and "computed by" not in plain.line


LEAK_REPORT = ("ValueError: pool memory leak detected! [full] total=4096, available=3328, evictable=784, protected=0, "
               "session_held=0, uncached=0\n")


def _failed_run(log: str, exited: str | None = None):
    from types import SimpleNamespace

    from conformance.programs.runner import ProgramRun

    run = SimpleNamespace(_log_start=5, _exited=lambda: exited, t=SimpleNamespace(log_text=lambda: "x" * 5 + log))
    return lambda failure: ProgramRun._late_death(run, failure)


def test_sglangs_idle_check_after_a_programs_failure_joins_its_findings(monkeypatch):
    """A program that failed (a tree rule) leaves the server idle once its requests are
    aborted; SGLang's idle check then reports a broken pool and the process dies seconds
    later: that report is a finding of the failure too (its pool's kind, SGLang's check)."""
    from conformance.checks.findings import Finding
    from conformance.programs import runner

    monkeypatch.setattr(runner, "LATE_DEATH_S", 0.0)
    failure = runner.program_failure(3, [Finding("tree_structure", "state keyed at its page floor")], [])
    later = _failed_run(LEAK_REPORT)(failure)
    assert later and later[0].kind.startswith(("leak_", "server_died")) and later[0].facts.get("by") == "sglang_idle_check"
    assert "SGLang stopped: its idle check fired" in later[0].line


def test_a_quiet_log_or_a_failure_that_is_already_a_death_adds_nothing(monkeypatch):
    from conformance.checks.findings import Finding
    from conformance.programs import runner

    monkeypatch.setattr(runner, "LATE_DEATH_S", 0.0)
    failure = runner.program_failure(3, [Finding("answer_differs_on_hit", "r5 differs")], [])
    assert _failed_run("INFO prefill batch\n")(failure) == []
    crash = 'Traceback (most recent call last):\n  File "/v/sglang/srt/managers/scheduler.py", line 9, in f\n    x\nRuntimeError: boom\n'
    assert _failed_run(crash)(failure) == []  # a traceback while the process lives is not a death
    assert _failed_run(crash, exited="exited with code -9")(failure)[0].kind == "server_died:exception"
    death = runner.program_failure(3, [Finding("server_died:assertion", "died")], [])
    assert _failed_run(LEAK_REPORT)(death) == []


def test_a_turn_names_how_often_its_sessions_earlier_turns_were_retracted(tmp_path: Path) -> None:
    """A session's turn resumes from the state its earlier turns left in the session's slot:
    the finding carries how often SGLang retracted those turns (``session_retracted``), and
    says it when any was; zero is a fact too, and a request outside a session has none."""
    from types import SimpleNamespace

    from conformance.programs.runner import ProgramRun

    served = {rid: Served(rid, 0, (1, 2), 1, {}, seq, kind="turn", session=sid)
              for rid, seq, sid in (("t1", 1, "s1"), ("t2", 2, "s1"), ("t3", 3, "s2"), ("t4", 4, "s1"))}
    retractions = {"t1": 0, "t2": 3, "t3": 5, "t4": 1}
    run = SimpleNamespace(served=served, t=SimpleNamespace(requests=object()), _retractions=lambda rid: retractions[rid])
    assert ProgramRun._session_retractions(run, served["t4"]) == 3  # t1 and t2, not t3 (another session) nor t4 itself
    assert ProgramRun._session_retractions(run, served["t1"]) == 0
    assert ProgramRun._session_retractions(run, Served("r9", 0, (1,), 1, {}, 9)) is None
    diff = Difference("output", "output logprob 0 (position 348): served -0.29653, cold -0.301253", (("position", 348),))
    t4 = Served("t4", 0, tuple(range(348)), 16, {}, 4, 5, kind="turn", session="s1",
                response={"output_ids": [1], "meta_info": {"cached_tokens": 271}})
    f = difference_finding(t4, [diff], retracted=0, session_retracted=3)
    assert f.kind == "answer_differs_on_hit" and f.facts["session_retracted"] == 3 and f.facts["retracted"] == 0
    assert "its session's earlier turns retracted 3x" in f.line
    assert "session_retracted" not in difference_finding(t4, [diff], retracted=0).facts
