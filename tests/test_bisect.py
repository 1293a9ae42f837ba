"""``hybrid-conformance history --bisect ID``: the search, its check against the entry, ``--write``.

Unit tests with a fake replay per release (``run_bisect``'s ``probe``): the recorded bracket
is found with few replays (not vacuous: both ends named); a seeded wrong answer (a release
that passes inside the bug's range) makes the bisect name another bracket and the check
against the entry fail (exit 1); an n/a release leaves the search; nothing reproducing is a
disagreement.  ``--write`` changes only the entry's ``measured`` array, keeps the file
loadable, and refuses a clash.  The documented command runs as typed in the scheduled job.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conformance.checks.findings import Finding
from packaging.version import Version

from conformance import cli
from conformance.commands.bisect import Bracket, Probe, run_bisect, search, write_measured
from conformance.errors import KitError
from conformance.session.known_bugs import DEFAULT_FILE, Measurement, load

ROOT = Path(__file__).resolve().parents[1]
VENV_RELEASES = ["0.5.12", "0.5.13", "0.5.15", "0.5.16", "0.5.18", "0.5.22", "0.5.23"]
#: The documented bisect (docs/report-bug.md), run as typed by the scheduled test below.
DOC_COMMAND = "hybrid-conformance history --bisect overlap-first-decode-boundary-track-lost --releases 0.5.12,0.5.13,0.5.15,0.5.16,0.5.18,0.5.22"


def bug(bug_id: str = "overlap-first-decode-boundary-track-lost"):
    return next(b for b in load() if b.id == bug_id)


def truth(bad: tuple[str, str], na: tuple[str, ...] = (), wrong: tuple[str, ...] = ()):
    """A fake replay: bad in [bad[0], bad[1]), n/a where asked, the opposite answer in ``wrong``."""
    calls: list[str] = []

    def probe(b, release: str) -> Probe:
        calls.append(release)
        if release in na:
            return Probe(release, "na", "SGLang refuses the cell")
        is_bad = Version(bad[0]) <= Version(release) < Version(bad[1])
        return Probe(release, "bad" if is_bad != (release in wrong) else "good", "seen")

    probe.calls = calls
    return probe


def args(bug_id: str, **kw) -> argparse.Namespace:
    base = dict(bisect=bug_id, venv_dir=None, sglang_source=None, releases=",".join(VENV_RELEASES), out="/tmp/unused", format="table", write=False)
    return argparse.Namespace(**{**base, **kw})


def test_the_recorded_bracket_is_found_and_agrees(capsys):
    probe = truth(("0.5.13", "0.5.18"))
    assert run_bisect(args(bug().id), probe=probe) == 0
    out = capsys.readouterr().out
    assert "first bad 0.5.13 (last good 0.5.12); first good 0.5.18 (last bad 0.5.16)" in out and "the bisect agrees" in out
    assert len(probe.calls) == len(set(probe.calls)) < len(VENV_RELEASES)  # each release replayed once, not every release


def test_a_seeded_wrong_answer_names_another_bracket_and_fails(capsys):
    probe = truth(("0.5.13", "0.5.18"), wrong=("0.5.16",))  # 0.5.16 wrongly passes: the fix looks earlier
    assert run_bisect(args(bug().id), probe=probe) == 1
    out = capsys.readouterr().out
    assert "first good 0.5.16 (last bad 0.5.15)" in out and "the bisect disagrees" in out
    assert "0.5.16 measured FAIL, the bisect's replay passed" in out and "recorded first good 0.5.18" in out


def test_na_releases_leave_the_search_and_a_bracket_past_the_oldest_release_agrees():
    b = bug("session-first-turn-abort-leaks-mamba")  # measured from 0.5.11, which has no venv
    found = search(b, VENV_RELEASES, lambda r: truth(("0.5.11", "0.5.13"), na=("0.5.15",))(b, r))
    assert (found.first_bad, found.last_good, found.first_good, found.last_bad) == ("0.5.12", None, "0.5.13", "0.5.12")
    assert found.disagreements(b) == []
    assert search(b, ["0.5.13", "0.5.15"], lambda r: Probe(r, "na", "refused")).first_bad is None


def test_nothing_reproducing_and_an_unknown_id_are_red(capsys):
    assert run_bisect(args(bug().id), probe=truth(("0.5.30", "0.5.31"))) == 1
    assert "reproduced overlap-first-decode-boundary-track-lost on none of the 7 releases probed" in capsys.readouterr().out
    assert Bracket({}).disagreements(bug()) and Bracket({}).lines() == ["no release reproduces the entry"]
    assert cli.main(["history", "--bisect", "no-such-bug"]) == 2
    assert "unknown bug id 'no-such-bug'" in capsys.readouterr().err
    assert cli.main(["history", "--releases", "0.5.13", "--write"]) == 2


def test_a_failure_the_entry_does_not_explain_is_na():
    b = bug()
    line = "request r2: cached_tokens 192, the prefix oracle allows [256] (input 261 tokens; the pools never had to evict)"
    assert Probe.classify(b, "0.5.13", [Finding(b.kind, line)]).status == "bad"
    assert Probe.classify(b, "0.5.13", [Finding("server_died:exception", "server died: something else")]).status == "na"
    assert Probe.classify(b, "0.5.13", [Finding("leak_kv", line)]).status == "na"  # the entry's line under another kind
    assert Probe.classify(b, "0.5.18", None).status == "good"


def test_sglang_source_is_a_clear_not_applicable_line(capsys):
    run_bisect(args(bug().id, sglang_source="/src/sglang"), probe=truth(("0.5.13", "0.5.18")))
    assert "--sglang-source: n/a for --bisect" in capsys.readouterr().out


# ------------------------------------------------------------------ --write

@pytest.fixture
def known_bugs_copy(tmp_path, monkeypatch):
    path = tmp_path / "known_bugs.toml"
    shutil.copy(DEFAULT_FILE, path)
    monkeypatch.setenv("HYBRID_CONFORMANCE_KNOWN_BUGS", str(path))
    return path


def test_write_changes_only_the_entrys_measured_lines(known_bugs_copy, capsys):
    b = bug("gdn-page-above-chunk-track-state-misindexed")  # measured 0.5.19 PASS; the venvs' first good is 0.5.22
    before = known_bugs_copy.read_text()
    assert run_bisect(args(b.id, write=True), probe=truth(("0.5.13", "0.5.19"))) == 0
    assert "--write: 1 measured line(s)" in capsys.readouterr().out
    after = known_bugs_copy.read_text()
    diff = [ln for ln in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert diff == ['+    "0.5.22: PASS, the replay (history --bisect)",']
    again = next(x for x in load(known_bugs_copy) if x.id == b.id)
    assert "0.5.22" in [m.release for m in again.measured] and [m.release for m in again.measured] == sorted((m.release for m in again.measured), key=Version)
    assert write_measured(known_bugs_copy, again, [Measurement("0.5.22", False, "x")]) == []  # already measured: unchanged


def test_write_refuses_a_clash_and_a_line_outside_the_range(known_bugs_copy):
    b = bug()
    with pytest.raises(KitError, match="0.5.18 is measured PASS already"):
        write_measured(known_bugs_copy, b, [Measurement("0.5.18", True, "x")])
    before = known_bugs_copy.read_text()
    unmeasured = dataclasses.replace(b, measured=tuple(m for m in b.measured if m.release != "0.5.22"))  # 0.5.22 as if never replayed
    with pytest.raises(KitError, match="widen the range"):
        write_measured(known_bugs_copy, unmeasured, [Measurement("0.5.22", True, "x")])
    assert known_bugs_copy.read_text() == before


def test_write_is_refused_when_the_bisect_disagrees(known_bugs_copy, capsys):
    before = known_bugs_copy.read_text()
    assert run_bisect(args(bug().id, write=True), probe=truth(("0.5.13", "0.5.18"), wrong=("0.5.16",))) == 1
    assert "nothing written" in capsys.readouterr().out and known_bugs_copy.read_text() == before


@pytest.mark.release_range
@pytest.mark.timeout(6 * 3600)
def test_the_documented_bisect_reproduces_the_recorded_bracket():
    assert DOC_COMMAND in (ROOT / "docs" / "report-bug.md").read_text()
    exe = shutil.which("hybrid-conformance")
    assert exe, "the hybrid-conformance console script is not installed"
    out = subprocess.run(["bash", "-c", DOC_COMMAND], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "first bad 0.5.13 (last good 0.5.12); first good 0.5.18" in out.stdout and "the bisect agrees" in out.stdout
