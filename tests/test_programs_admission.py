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
from conformance.programs.evidence import Admission, RequestLog
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
    assert log.computed_by("x-t7", 140) == Admission(0, 139, 0)  # decoded after the first admission
    assert log.computed_by("x-t7", 152) == Admission(0, 152, 128)  # prefilled from 0 right after the refusal
    assert log.computed_by("x-t7", 153) == Admission(128, 153, 0)
    assert log.computed_by("x-t7", 100) is None  # before any prefill ended: nothing computed it
    assert log.computed_by("x-other", 152) is None


def test_chunks_of_one_admission_are_one_admission(tmp_path: Path) -> None:
    log = _log(tmp_path, [(0, 64), (64, 64), (128, 11)])  # chunks continue each other: one admission from 0
    assert log.computed_by("x-t7", 139) == Admission(0, 139, 0)


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
