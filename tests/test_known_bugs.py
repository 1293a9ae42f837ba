"""Known SGLang bugs as expectations (``conformance/session/known_bugs.py``, ``fixtures/known_bugs.toml``):
a matching failure is reported "known SGLang bug, still present" and xfails; an entry
whose replay stops reproducing is red (both directions); a bad file is one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from conformance.errors import KitError
from conformance.checks.findings import Finding, failing
from conformance.commands.known_bugs import replay_cell, suite_cell, suite_findings
from conformance.session.known_bugs import STILL_PRESENT, KnownBug, check_entries, expect, installed_release, load
from conformance.records import Verdict
from conformance.report.run_report import known_bugs_seen
from conformance.session.suite_support import settle

ROOT = Path(__file__).resolve().parents[1]
CELL = "qwen3-next-80b-extra_buffer-p1-t256"
FAILURE = "step 4: request r2: cached_tokens 0, the prefix oracle allows [320] (input 325 tokens; the pools never had to evict)"
LOST = Finding("hit_below_certain", FAILURE, {"cached_tokens": 0, "input": 325})


def _file(tmp_path: Path, body: str) -> Path:
    (tmp_path / "bug.json").write_text(json.dumps({"version": 1, "forest": [], "steps": [], "cell": {"id": CELL}}))
    path = tmp_path / "known_bugs.toml"
    path.write_text(body.replace("REPLAY", str(tmp_path / "bug.json")))
    return path


ENTRY = '''
[[bug]]
id = "lost-prefix"
summary = "a stored prefix is not reused although nothing evicted it"
releases = ">=0.5.20,<0.5.24"
check = "programs"
kind = "hit_below_certain"
where = { cached_tokens = "<320" }
match = "cached_tokens \\\\d+, the prefix oracle allows"
replay = "REPLAY"
issue = "https://github.com/sgl-project/sglang/issues/1"
'''


def test_the_repository_file_loads_and_every_entry_has_its_replay() -> None:
    for bug in load(ROOT / "fixtures" / "known_bugs.toml"):
        assert bug.replay_path().is_file() and bug.targets and "reference" not in bug.targets


def test_every_entry_in_range_of_the_installed_release_has_a_replay_naming_a_cell() -> None:
    """The README's test command replays no known bug (the nightly's ``known-bugs`` job does,
    ci/workflows/nightly.yml); it checks, without a server, that each entry in range of the
    installed release (on any target) has a replay file that loads and names a cell of the
    matrix, so the nightly replay can run it."""
    release = installed_release()
    in_range = [b for b in load(ROOT / "fixtures" / "known_bugs.toml") if b.in_range(release)]
    for bug in in_range:
        program, cell = replay_cell(bug)
        assert cell.id == program.cell["id"]
    if not in_range:
        pytest.skip(f"no known-bug entry is in range of the installed sglang {release}")


@pytest.mark.parametrize("replay,why", [
    ({"version": 1, "forest": [], "steps": [], "cell": {"id": "no-such-cell"}}, "cell 'no-such-cell' is not in the matrix"),
    ({"version": 1, "forest": [], "steps": [], "cell": {}}, "names no cell"),
    ("{not json", "not JSON"),
])
def test_a_replay_that_does_not_load_or_names_no_cell_is_one_line(tmp_path: Path, replay: object, why: str) -> None:
    """The rule above is not vacuous: a seeded entry whose replay names a cell the matrix lacks,
    names none, or is not JSON is refused in one line naming the entry."""
    (bug,) = load(_file(tmp_path, ENTRY))
    bug.replay_path().write_text(replay if isinstance(replay, str) else json.dumps(replay))
    with pytest.raises(KitError, match=why) as e:
        replay_cell(bug)
    assert str(e.value).startswith("bug 'lost-prefix': replay ") and "\n" not in str(e.value)
    (tmp_path / "good").mkdir()
    (good,) = load(_file(tmp_path / "good", ENTRY))
    assert replay_cell(good)[1].id == CELL


def test_a_matching_failure_is_a_known_bug_still_present_and_xfails(tmp_path: Path) -> None:
    bugs = load(_file(tmp_path, ENTRY))
    failed = failing("programs", [LOST], {"examples": 3})
    v = expect(failed, cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs)
    assert v.status == "fail" and v.metrics == {"examples": 3}
    assert v.reason.startswith(f"{STILL_PRESENT} (lost-prefix, https://github.com/sgl-project/sglang/issues/1)")
    assert v.details["known_bug"]["id"] == "lost-prefix"
    with pytest.raises(pytest.xfail.Exception, match=STILL_PRESENT):
        settle(v)
    rows = known_bugs_seen([{"id": CELL, "checks": {"programs": v.to_json()}}])
    assert rows == [{"cell": CELL, "check": "programs", **v.details["known_bug"]}]
    # anything else stays a plain, red failure
    for other in (
        expect(failed, cell=CELL, target="sglang-cpu", release="0.5.24", bugs=bugs),  # out of range
        expect(failed, cell=CELL, target="reference", release="0.5.23", bugs=bugs),  # the reference engine: a kit bug
        expect(failing("kl", [LOST]), cell=CELL, target="sglang-cpu", release="0.5.23", bugs=bugs),  # another check
        expect(failing("programs", [Finding("answer_differs_on_hit", "request r1 differs from the cold computation")]), cell=CELL,
               target="sglang-cpu", release="0.5.23", bugs=bugs),  # another kind
        expect(failing("programs", [Finding("hit_below_certain", FAILURE, {"cached_tokens": 320})]), cell=CELL,
               target="sglang-cpu", release="0.5.23", bugs=bugs),  # facts outside the entry's where
        expect(Verdict("programs", "fail", {}, FAILURE), cell=CELL, target="sglang-cpu",
               release="0.5.23", bugs=bugs),  # a failure without kinds: never excused by a line alone
    ):
        assert "known_bug" not in other.details
        with pytest.raises(pytest.fail.Exception):
            settle(other)


def test_an_entry_that_stops_reproducing_is_red(tmp_path: Path) -> None:
    bugs = load(_file(tmp_path, ENTRY))
    still = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [LOST])
    assert [r.ok for r in still] == [True] and STILL_PRESENT in still[0].line
    fixed = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: None)
    assert [r.ok for r in fixed] == [False] and "no longer reproduces: remove or narrow the entry" in fixed[0].line
    other = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [Finding("leak_mamba", "step 1: idle invariant: mamba leaked")])
    assert [r.ok for r in other] == [False] and "a different finding" in other[0].line
    assert check_entries(bugs, target="sglang-cpu", release="0.6.0", replay=lambda b: pytest.fail("played out of range")) == []


KL_ENTRY = ENTRY.replace('check = "programs"', 'check = "kl"').replace('kind = "hit_below_certain"', 'kind = "answer_differs_on_hit"') \
    .replace('where = { cached_tokens = "<320" }', 'where = { scenario = "decode_hit" }').replace('match = "cached_tokens \\\\d+, the prefix oracle allows"\n', "")
DECODE_HIT = Finding("answer_differs_on_hit", "sequence 1 (decode_hit, start 527, cached 448): top-k KL 0.0102", {"scenario": "decode_hit"})


def test_an_entry_of_a_scripted_suite_is_replayed_by_that_suite_too_and_strictly(tmp_path: Path) -> None:
    """A kl entry's program reproduces its mechanism (kind only); the kl suite's own run must
    fail with the finding the entry excuses, facts included, or the entry is red."""
    bugs = load(_file(tmp_path, KL_ENTRY))
    program_finding = Finding("answer_differs_on_hit", "request a2 differs from the cold computation")
    both = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [program_finding], suite_replay=lambda b: [DECODE_HIT])
    assert [r.ok for r in both] == [True, True] and "(the kl suite)" in both[1].line
    fixed = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [program_finding], suite_replay=lambda b: None)
    assert [r.ok for r in fixed] == [True, False] and "the kl suite passed" in fixed[1].line
    elsewhere = Finding("answer_differs_on_hit", "sequence 0 (prefill_hit): top-k KL 0.2", {"scenario": "prefill_hit"})
    other = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [program_finding], suite_replay=lambda b: [elsewhere])
    assert [r.ok for r in other] == [True, False] and "a different finding" in other[1].line
    # a programs entry has no suite to replay
    assert len(check_entries(load(_file(tmp_path, ENTRY)), target="sglang-cpu", release="0.5.23", replay=lambda b: [LOST],
                             suite_replay=lambda b: pytest.fail("a programs entry has no suite"))) == 1


AGREEMENT_ENTRY = ENTRY.replace('check = "programs"', 'check = "agreement"').replace('kind = "hit_below_certain"', 'kind = "answer_differs_on_miss"') \
    .replace('where = { cached_tokens = "<320" }\n', "").replace('match = "cached_tokens \\\\d+, the prefix oracle allows"\n', "")
COLD_DIFFERS = Finding("answer_differs_on_miss", "cold: greedy tokens differ from position 0 (sglang (1, 2, 3) vs reference (4, 5, 6))")


def test_an_entry_judged_against_the_reference_engine_is_reproduced_by_its_suite_alone(tmp_path: Path) -> None:
    """A program compares SGLang with its own cache-off run, so it cannot show a disagreement
    with the reference engine: an agreement entry's program is never played, its suite decides
    (strictly), and a programs-only replay says it cannot reproduce it."""
    (bug,) = load(_file(tmp_path, AGREEMENT_ENTRY))
    assert bug.suite_only and not load(_file(tmp_path, ENTRY))[0].suite_only
    no_program = dict(replay=lambda b: pytest.fail("a program cannot show a disagreement with the reference engine"))
    still = check_entries([bug], target="sglang-cpu", release="0.5.23", suite_replay=lambda b: [COLD_DIFFERS], **no_program)
    assert [r.ok for r in still] == [True] and "(the agreement suite)" in still[0].line
    fixed = check_entries([bug], target="sglang-cpu", release="0.5.23", suite_replay=lambda b: None, **no_program)
    assert [r.ok for r in fixed] == [False] and "the agreement suite passed" in fixed[0].line
    hit = Finding("answer_differs_on_hit", "repeat: greedy tokens differ from position 0")
    other = check_entries([bug], target="sglang-cpu", release="0.5.23", suite_replay=lambda b: [hit], **no_program)
    assert [r.ok for r in other] == [False] and "a different finding" in other[0].line
    programs_only = check_entries([bug], target="sglang-cpu", release="0.5.23", **no_program)
    assert [r.ok for r in programs_only] == [False] and "--programs-only plays no suite" in programs_only[0].line
    with pytest.raises(KitError, match="judged against the reference engine .* --suite agreement"):
        bug.refuse_program_replay("report-bug")


def test_report_bug_and_bisect_refuse_an_entry_no_program_shows(tmp_path: Path) -> None:
    """``report-bug`` and ``history --bisect`` replay the entry's program: for an agreement
    entry that would pass whatever SGLang does, so each says so in one line and stops."""
    from conformance.commands.bisect import run_bisect
    from conformance.commands.report_bug import case_for

    (bug,) = [b for b in load(ROOT / "fixtures" / "known_bugs.toml") if b.id == "granite-final-norm-adds-residual-twice"]
    with pytest.raises(KitError, match="^report-bug: bug 'granite-final-norm-adds-residual-twice' is judged against the reference engine"):
        case_for(bug, SimpleNamespace())
    args = SimpleNamespace(bisect=bug.id, venv_dir=str(tmp_path), sglang_source=None, releases="0.5.21", out=str(tmp_path))
    with pytest.raises(KitError, match="^history --bisect: bug 'granite-final-norm-adds-residual-twice' is judged against the reference engine"):
        run_bisect(args, probe=lambda b, r: pytest.fail("replayed a program that cannot show it"))


def test_a_variant_replaying_its_programs_base_reproduces_on_the_bases_finding(tmp_path: Path) -> None:
    """A kl variant whose replay is its programs base's own file: the program stops at the
    cause (the base's finding, e.g. a tree rule), which reproduces the variant too; a finding
    neither excuses still does not."""
    variant = KL_ENTRY.replace('id = "lost-prefix"', 'id = "lost-prefix-kl"') + 'variant_of = "lost-prefix"\n'
    bugs = load(_file(tmp_path, ENTRY + variant))
    both = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [LOST])
    assert [r.ok for r in both] == [True, True]
    other = check_entries(bugs, target="sglang-cpu", release="0.5.23", replay=lambda b: [Finding("leak_mamba", "mamba leaked")])
    assert [r.ok for r in other] == [False, False]
    alone = check_entries(load(_file(tmp_path, KL_ENTRY)), target="sglang-cpu", release="0.5.23", replay=lambda b: [LOST])
    assert [r.ok for r in alone] == [False]  # no base: the kl entry's own kind only


def test_a_suite_replay_reads_its_check_on_its_cell_from_the_run_report() -> None:
    fail = failing("kl", [DECODE_HIT]).to_json()
    report = {"cells": [{"id": CELL, "checks": {"kl": fail, "leaks": {"status": "pass"}}}]}
    assert [f.facts.get("scenario") for f in suite_findings(report, CELL, "kl")] == ["decode_hit"]
    assert suite_findings(report, CELL, "leaks") is None
    (missing,) = suite_findings(report, CELL, "gsm8k")
    assert "the gsm8k suite gave no verdict on" in missing.line and "kl fail" in missing.line
    (errored,) = suite_findings({"cells": [{"id": CELL, "checks": {"kl": {"status": "error", "reason": "server died"}}}]}, CELL, "kl")
    assert errored.kind == "unclassified" and "server died" in errored.line
    assert "no verdict" in suite_findings({"cells": []}, CELL, "kl")[0].line


def test_a_suite_replays_on_the_programs_cell_when_the_entry_lists_it_else_on_its_first_cell() -> None:
    cell = SimpleNamespace(id=CELL)
    assert suite_cell(SimpleNamespace(cells=()), cell) == CELL
    assert suite_cell(SimpleNamespace(cells=("other", CELL)), cell) == CELL
    assert suite_cell(SimpleNamespace(cells=("other",)), cell) == "other"


@pytest.mark.parametrize("body,why", [
    (ENTRY.replace('check = "programs"\n', ""), "needs check"),
    (ENTRY.replace('kind = "hit_below_certain"\n', ""), "needs kind"),
    (ENTRY.replace('kind = "hit_below_certain"', 'kind = "lost"'), "unknown finding kind 'lost'"),
    (ENTRY.replace('where = { cached_tokens = "<320" }', 'where = { cached_tokens = "<" }'), "where.cached_tokens"),
    (ENTRY.replace('where = { cached_tokens = "<320" }', 'where = "cached"'), "where must be a table"),
    (ENTRY.replace('releases = ">=0.5.20,<0.5.24"', 'releases = "0.5.x"'), "is not a version range"),
    (ENTRY.replace('id = "lost-prefix"', 'id = "Lost Prefix"'), "must be a slug"),
    (ENTRY + 'targets = ["reference"]\n', "a kit bug"),
    (ENTRY + 'colour = "red"\n', "unknown field 'colour'"),
    (ENTRY.replace("REPLAY", "/nonexistent/bug.json"), "does not exist"),
    (ENTRY + ENTRY, "appears twice"),
    ("[[bug]\n", "not valid TOML"),
    # the facts that place an entry (docs/known-bugs.md is generated from them)
    (ENTRY + 'measured = "0.5.21: FAIL"\n', "measured must be a list of strings"),
    (ENTRY + 'measured = ["0.5.21 failed"]\n', "measured line '0.5.21 failed' must read"),
    (ENTRY + 'measured = ["0.5.24: FAIL, cached_tokens 0"]\n', r"measured 0.5.24 FAIL lies outside releases .* \(widen the range\)"),
    (ENTRY + 'measured = ["0.5.21: PASS"]\n', r"measured 0.5.21 PASS lies inside releases .* \(narrow the range\)"),
    (ENTRY + 'seen_as = "request r1 differs from the cold computation"\n', "its match does not match its seen_as"),
    (ENTRY + 'code_path = " "\n', "code_path must be a non-empty string"),
    (ENTRY + 'attempts = 0\n', "attempts must be a whole number from 1 to 10"),
    (ENTRY + 'attempts = "3"\n', "attempts must be a whole number from 1 to 10"),
    (ENTRY + 'variant_of = "nope"\n', "variant_of 'nope' must name another entry"),
    (ENTRY + 'variant_of = "lost-prefix"\n', "variant_of 'lost-prefix' must name another entry"),
    (ENTRY + ENTRY.replace("lost-prefix", "second") + 'variant_of = "lost-prefix"\n'
     + ENTRY.replace("lost-prefix", "third") + 'variant_of = "second"\n', "bug 'third': variant_of 'second' must name"),
])
def test_a_bad_known_bugs_file_is_one_line(tmp_path: Path, body: str, why: str) -> None:
    with pytest.raises(KitError, match=why) as e:
        load(_file(tmp_path, body))
    assert "\n" not in str(e.value)


FACTS = f'''code_path = "python/sglang/srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.match_prefix"
seen_as = "{FAILURE}"
measured = ["0.5.19: PASS", "0.5.22: FAIL, cached_tokens 0", "0.5.20: FAIL, cached_tokens 0", "0.5.24: PASS, 2 hits"]
notes = ["a fact"]
'''


def test_the_facts_load_and_bracket_the_range(tmp_path: Path) -> None:
    """The rules above are not vacuous: an entry whose facts agree with its range loads,
    a variant of it too; first bad and first good come from what was measured."""
    variant = ENTRY.replace("lost-prefix", "lost-prefix-kl") + 'variant_of = "lost-prefix"\n'
    base, other = load(_file(tmp_path, ENTRY + FACTS + variant))
    assert (base.first_bad, base.first_good) == ("0.5.20", "0.5.24")
    assert [m.line() for m in base.measured][1] == "0.5.22: FAIL, cached_tokens 0" and base.notes == ("a fact",)
    assert base.seen_as == FAILURE and base.matches(base.seen_as) and not base.variant_of
    assert other.variant_of == "lost-prefix" and other.first_bad is None and other.first_good is None


def test_the_command_plays_nothing_out_of_range_and_refuses_a_missing_file(tmp_path: Path) -> None:
    path = _file(tmp_path, ENTRY.replace(">=0.5.20,<0.5.24", "<0.1"))
    out = subprocess.run(["hybrid-conformance", "known-bugs", "--target", "sglang-cpu", "--file", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "lost-prefix: not played" in out.stdout and "none in range" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(["hybrid-conformance", "known-bugs", "--file", str(tmp_path / "nope.toml")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "does not exist" in out.stderr


def test_a_timing_dependent_replay_is_played_until_one_play_fails(tmp_path: Path, monkeypatch) -> None:
    """``attempts``: the plays share one server; the first failing play answers, and a replay
    whose every play passed has stopped reproducing."""
    import conformance.commands.known_bugs as command
    from conformance.programs.runner import ProgramFailure

    (bug,) = load(_file(tmp_path, ENTRY + "attempts = 3\n"))
    assert bug.attempts == 3 and load(_file(tmp_path, ENTRY))[0].attempts == 1
    plays: list[int] = []

    def play(program, cell, options, log_dir, repeat=1):
        assert repeat == 3
        for i in range(repeat):
            plays.append(i)
            yield ProgramFailure(2, [LOST], []) if i == 1 else object()

    monkeypatch.setattr(command, "play", play)
    monkeypatch.setattr(command, "replay_cell", lambda bug, matrix=None: (SimpleNamespace(env={}), None))  # a program recording no env
    replay = command.replayer(type("O", (), {"matrix_path": None})(), tmp_path)
    assert replay(bug) == [LOST] and plays == [0, 1]  # stopped at the failing play
    monkeypatch.setattr(command, "play", lambda *a, **k: iter([object()] * 3))
    assert replay(bug) is None


def test_a_suite_replay_runs_the_check_on_the_cell_excusing_no_known_bug(tmp_path: Path, monkeypatch) -> None:
    """The suite run is ``hybrid-conformance run --cells CELL --suite CHECK`` under a known-bugs
    file that excuses nothing, and its report decides."""
    import conformance.commands.known_bugs as kb

    bugs = load(_file(tmp_path, KL_ENTRY))
    seen = {}

    def fake_run(argv, env, stdout, stderr, timeout, check):
        seen.update(argv=argv, bugs_file=Path(env["HYBRID_CONFORMANCE_KNOWN_BUGS"]).read_text(), timeout=timeout)
        out = Path(argv[argv.index("--report-dir") + 1])
        (out / "report.json").write_text(json.dumps({"cells": [{"id": CELL, "checks": {"kl": failing("kl", [DECODE_HIT]).to_json()}}]}))

    monkeypatch.setattr(kb.subprocess, "run", fake_run)
    monkeypatch.setattr(kb, "find_cell", lambda program, matrix: SimpleNamespace(id=CELL))
    args = SimpleNamespace(target="sglang-cpu", matrix=None, dtype=None, suite_timeout=77)
    (found,) = kb.suite_replayer(args, tmp_path / "logs")(bugs[0])
    assert found.facts["scenario"] == "decode_hit" and bugs[0].excuses(found)
    argv = seen["argv"]
    assert argv[3:9] == ["run", "--target", "sglang-cpu", "--cells", CELL, "--suite"] and argv[9] == "kl"
    assert argv[10:12] == ["--tier", "nightly"]  # the entry's cell may be an option cell only the nightly tier holds
    assert "[[bug]]" not in seen["bugs_file"] and seen["timeout"] == 77


def test_a_cells_teardown_is_judged_by_the_leaks_entries_of_its_kind(tmp_path: Path) -> None:
    """The teardown re-reads the leaks suite's idle probes: its findings carry their kinds
    (a Mamba count broken: leak_mamba) and a leaks entry of that kind, cell and release
    excuses them; an entry of another kind, or of the kl suite, does not."""
    from conformance.checks.leaks import teardown_verdict
    from conformance.recordings import IdleProbe

    bad = [IdleProbe("after aborting streaming-s0 turn 1", False, {}, 0.1, problems=("mamba: used -1 < session-held 0 + protected 0: counted twice",))]
    verdict = teardown_verdict(CELL, bad)
    assert verdict.check == "teardown" and verdict.status == "fail" and "pools not idle" in verdict.reason
    assert [f["kind"] for f in verdict.details["findings"]] == ["leak_mamba"]
    entry = ENTRY.replace('check = "programs"', 'check = "CHECK"').replace('kind = "hit_below_certain"', 'kind = "KIND"') \
        .replace('where = { cached_tokens = "<320" }\n', "").replace('match = "cached_tokens \\\\d+, the prefix oracle allows"\n', "")
    for check, kind, judged in (("leaks", "leak_mamba", True), ("leaks", "leak_kv", False), ("kl", "leak_mamba", False)):
        bugs = load(_file(tmp_path, entry.replace("CHECK", check).replace("KIND", kind)))
        out = expect(verdict, cell=CELL, target="sglang-cpu", release="0.5.21", bugs=bugs)
        assert (out.details.get("known_bug", {}).get("id") == "lost-prefix") is judged, (check, kind)
        assert out.reason.startswith(STILL_PRESENT) is judged
