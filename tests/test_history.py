"""``hybrid-conformance history``: argument errors in one line, the release x check table and
JSON rows, how pool-tier outcomes fold into a check (a failure is never hidden by a pass
or an n/a; n/a is never a pass), and the exit code.  The end-to-end run over real releases
is in ``tests/test_release_range.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

import pytest

from conformance.commands import history
from conformance.errors import KitError
from conformance.commands.history import Row

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (("history", "--releases", "0.5.x"), "'0.5.x' is not a release number"),
        (("history", "--releases", "0.5.3"), "older than the oldest supported release 0.5.11"),
        (("history", "--releases", ","), "no release given"),
        (("history", "--releases", "0.5.13", "--checks", "pool,speed"), "--checks: unknown value speed"),
        (("history", "--releases", "0.5.13", "--with-sglang-cpu", "--models", "qwen3-nxt"), "--models: unknown value 'qwen3-nxt'"),
        (("history", "--releases", "0.5.13", "--budget", "lots"), "--budget: expected"),
    ],
)
def test_bad_arguments_are_one_line(args, needle):
    out = cli(*args)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert not out.stdout


def _case(name: str, child: str | None = None, message: str = "") -> ET.Element:
    case = ET.Element("testcase", name=name)
    if child:
        ET.SubElement(case, child, message=message)
    return case


def test_pool_cases_fold_into_one_check_per_scenario():
    scen = ["session_reuse", "session_abort", "refused_after_match"]
    assert history._case_check(_case("test_pool_scenario[qwen3-next-80b-extra_buffer-p1-t256-session_reuse]"), scen) == "pool:session_reuse"
    assert history._case_check(_case("test_pool_scenario[session_abort-qwen3-next-80b-extra_buffer-p1-t256]"), scen) == "pool:session_abort"
    assert history._case_check(_case("test_pool_machine_coverage[x]"), scen) == "pool:machine"
    assert history._case_outcome(_case("t", "failure", "[slot_partition] by several")) == ("fail", "[slot_partition] by several")
    assert history._case_outcome(_case("t", "error", "teardown blew up"))[0] == "fail"
    assert history._case_outcome(_case("t", "skipped", "n/a: sglang 0.5.12: no lazy")) == ("skip", "n/a: sglang 0.5.12: no lazy")
    assert history._case_outcome(_case("t")) == ("pass", "")


def test_aggregate_fail_beats_pass_and_na_is_not_a_pass():
    fail = history._aggregate("0.5.12", "pool:session_reuse", [("pass", "", "a"), ("fail", "[slot_partition] x", "b"), ("skip", "n/a: y", "c")])
    assert fail.status == "fail" and "1 of 3 failed; b: [slot_partition] x" in fail.reason
    ok = history._aggregate("0.5.13", "pool:x", [("pass", "", "a"), ("skip", "n/a: lazy absent", "b")])
    assert ok.status == "pass" and ok.reason == "1 passed, 1 n/a"
    na = history._aggregate("0.5.12", "pool:lazy", [("skip", "n/a: sglang 0.5.12: no lazy", "a"), ("skip", "scenario applies to lazy only", "b")])
    assert na == Row("0.5.12", "pool:lazy", "na", "sglang 0.5.12: no lazy")
    nothing = history._aggregate("0.5.12", "pool:y", [])
    assert nothing.status == "na" and nothing.reason == "not collected"


def test_table_shows_every_release_and_why_each_non_pass():
    rows = [
        Row("0.5.12", "install", "pass", "/v/sglang-0.5.12"), Row("0.5.13", "install", "pass", "/v/sglang-0.5.13"),
        Row("0.5.12", "pool:session_reuse", "fail", "[slot_partition] by several"), Row("0.5.13", "pool:session_reuse", "pass", "1 passed"),
        Row("0.5.12", "pool:lazy_alloc_fail_effects", "na", "no lazy"),
    ]
    text = history.render_table(rows, ["0.5.12", "0.5.13"])
    lines = text.splitlines()
    assert lines[0].split() == ["check", "0.5.12", "0.5.13"]
    assert next(ln for ln in lines if ln.startswith("pool:session_reuse")).split()[1:] == ["FAIL", "pass"]
    assert next(ln for ln in lines if ln.startswith("pool:lazy_alloc_fail_effects")).split()[1:] == ["n/a", "-"]
    assert "0.5.12 pool:session_reuse: FAIL: [slot_partition] by several" in text
    assert "0.5.12 pool:lazy_alloc_fail_effects: n/a: no lazy" in text
    assert history.failed_releases(rows) == ["0.5.12"]
    assert history.failed_releases(rows[1:2] + rows[3:]) == []


def test_run_history_exit_code_and_json_rows(monkeypatch, capsys, tmp_path):
    rows = [Row("0.5.12", "pool:session_reuse", "fail", "leak"), Row("0.5.13", "pool:session_reuse", "pass", "ok")]
    monkeypatch.setattr(history, "history", lambda *a, **k: (rows, {"0.5.12": "sglang 0.5.12: ...", "0.5.13": "sglang 0.5.13: ..."}))
    monkeypatch.chdir(tmp_path)
    args = history_args("--releases", "0.5.12,0.5.13", "--format", "json")
    assert history.run_history(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"] == [{"release": "0.5.12", "check": "pool:session_reuse", "status": "fail", "reason": "leak", "cell": "", "replay": "", "known_bug": ""},
                           {"release": "0.5.13", "check": "pool:session_reuse", "status": "pass", "reason": "ok", "cell": "", "replay": "", "known_bug": ""}]
    assert all(r["status"] in history.STATUSES for r in doc["rows"])
    monkeypatch.setattr(history, "history", lambda *a, **k: (rows[1:], {}))
    assert history.run_history(history_args("--releases", "0.5.13")) == 0
    assert "all 1 releases passed" in capsys.readouterr().out


def history_args(*argv: str):
    from conformance.cli import build_parser

    return build_parser().parse_args(["history", *argv])


def test_parse_checks():
    assert history.parse_checks(None) == history.CHECKS
    assert history.parse_checks("pool,validate") == ("pool", "validate")
    with pytest.raises(KitError, match="unknown value nope"):
        history.parse_checks("nope")


def test_sglang_cpu_hook_is_an_explicit_na_row(tmp_path):
    gap = "sglang 0.5.11 has no general plugins (sglang.srt.plugins.load_plugins)"
    [row] = history.sglang_cpu_rows("0.5.11", tmp_path, {"sglang_cpu_gap": gap}, requested=True, tier="premerge")
    assert row.status == "na" and row.reason == gap and "lacks an extension point" not in row.reason
    [row] = history.sglang_cpu_rows("0.5.23", tmp_path, {"sglang_cpu_gap": None}, requested=False, tier="premerge")
    assert row.status == "na" and "not requested" in row.reason


def test_sglang_cpu_rows_of_some_models_run_only_their_cells(monkeypatch, tmp_path):
    """--models: the run is asked for those models only, and the n/a rows of refused
    strategies name only their cells; the report's rows come through as they are; with an
    --out folder the run's report folder is kept there."""
    seen = []

    def fake_run(argv, *, timeout, env=None, cwd=None):
        seen.append(list(argv))
        report_dir = Path(argv[argv.index("--report-dir") + 1])
        (report_dir / "report.json").write_text(json.dumps({"cells": [{"id": "qwen3-next-80b-extra_buffer-p1-t256", "checks": {"kl": {"status": "pass"}}}]}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    features = {"version": "0.5.12", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",), out_dir=tmp_path / "out")
    [argv] = seen
    assert argv[argv.index("--models") + 1] == "qwen3-next"
    kept = tmp_path / "out" / "runs" / "0.5.12-qwen3-next"
    assert argv[argv.index("--report-dir") + 1] == str(kept) and (kept / "report.json").is_file()  # the evidence stays
    assert argv[argv.index("--strategies") + 1] == "no_buffer,extra_buffer"
    na = [r for r in rows if r.status == "na"]
    assert na and all(r.cell.startswith("qwen3-next-80b-extra_buffer_lazy") for r in na), na
    assert Row("0.5.12", "sglang-cpu:kl", "pass", "", cell="qwen3-next-80b-extra_buffer-p1-t256") in rows
    seen.clear()
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="premerge")
    assert "--models" not in seen[0] and any(r.cell.startswith("nemotron") for r in rows if r.status == "na")


def test_a_relative_out_folder_is_the_callers_not_the_inner_runs(monkeypatch, tmp_path):
    """The inner run starts in the kit's root; the default ``--out reports/history`` is
    relative to the caller's folder, so the report folder it is given must be absolute (else
    the run writes under the kit's root and the row reads "no report.json")."""

    kit_root = tmp_path / "kit-root"  # where the inner run starts (history's ROOT; kept in tmp_path so a failure writes nothing into the kit)

    def fake_run(argv, *, timeout, env=None, cwd=kit_root):
        report_dir = Path(cwd) / argv[argv.index("--report-dir") + 1]  # a relative path resolves in the run's cwd
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "report.json").write_text(json.dumps({"cells": [{"id": "qwen3-next-80b-extra_buffer-p1-t256", "checks": {"kl": {"status": "pass"}}}]}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    features = {"version": "0.5.12", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",), out_dir=Path("out"))
    assert Row("0.5.12", "sglang-cpu:kl", "pass", "", cell="qwen3-next-80b-extra_buffer-p1-t256") in rows, rows
    assert (caller / "out" / "runs" / "0.5.12-qwen3-next" / "report.json").is_file() and not (kit_root / "out").exists()


def test_a_release_part_whose_every_cell_is_na_has_na_rows_and_no_run_failure(monkeypatch, tmp_path):
    """The inner run of a part whose every cell SGLang cannot serve is red ("nothing was
    judged"), but history's rows already say n/a per cell with SGLang's line: no FAIL row for
    the run; any other incompleteness is still one."""
    reasons = [["nothing was judged: every selected cell is not applicable"]]

    def fake_run(argv, *, timeout, env=None, cwd=None):
        report_dir = Path(argv[argv.index("--report-dir") + 1])
        cells = [{"id": "qwen3-next-80b-extra_buffer-p1-t256", "not_applicable": "sglang 0.5.12: no", "checks": {}}]
        (report_dir / "report.json").write_text(json.dumps({"cells": cells, "complete": False, "incomplete_reasons": reasons[0]}))
        return subprocess.CompletedProcess(argv, 1, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    features = {"version": "0.5.12", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",))
    assert rows and all(r.status == "na" for r in rows), rows
    reasons[0] = ["nothing was judged: every selected cell is not applicable", "interrupted"]
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",))
    assert [r.check for r in rows if r.status == "fail"] == ["sglang-cpu run"]


def test_rows_of_suites_that_found_the_server_killed_by_a_known_bug_name_it():
    """A known SGLang bug that kills the scheduler (leaks) leaves the cell's later suites
    facing a dead server: their rows stay fail and say which known bug killed it; a dead
    server with no known bug in the cell is reported as it is."""
    dead = "setup test_programs: cell c: server is not serving: server process exited with code -9"
    cell = {"id": "c", "checks": {
        "leaks": {"status": "fail", "reason": "known SGLang bug, still present (lazy-session-counts-unused-pingpong): ...",
                  "details": {"known_bug": {"id": "lazy-session-counts-unused-pingpong"}}},
        "test": {"status": "error", "reason": dead},
        "kl": {"status": "fail", "reason": "top-k KL 0.344 > limit"}}}
    got = {r.check: r for r in history.report_rows("0.5.20", {"cells": [cell]})}
    assert got["sglang-cpu:test"].status == "fail"
    assert got["sglang-cpu:test"].reason == f"after known SGLang bug lazy-session-counts-unused-pingpong killed the cell's server: {dead}"
    assert got["sglang-cpu:kl"].reason == "top-k KL 0.344 > limit"  # not a dead-server line: untouched
    cell["checks"]["leaks"] = {"status": "fail", "reason": "leak", "details": {}}
    assert {r.check: r for r in history.report_rows("0.5.20", {"cells": [cell]})}["sglang-cpu:test"].reason == dead


def record_empty_runs(monkeypatch) -> list[list[str]]:
    """Make history's server runs answer an empty report; the argv of each run, in order."""
    seen: list[list[str]] = []

    def fake_run(argv, *, timeout, env=None, cwd=None):
        seen.append(list(argv))
        (Path(argv[argv.index("--report-dir") + 1]) / "report.json").write_text(json.dumps({"cells": []}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    return seen


def test_sglang_cpu_rows_mark_extra_buffer_cells_na_when_no_device_gate_is_answerable(monkeypatch, tmp_path):
    """A release that gates extra_buffer on the device with nothing the CPU plugin answers:
    its buffered cells are na rows naming the missing capability and the run is asked for
    no_buffer only (no server starts to die on SGLang's assert); a found gate changes nothing."""
    seen = record_empty_runs(monkeypatch)
    features = {"version": "0.5.99", "strategies": ["no_buffer", "extra_buffer", "extra_buffer_lazy"], "sglang_cpu_gap": None,
                "extra_buffer_gate": None}
    rows = history.sglang_cpu_rows("0.5.99", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",))
    assert seen[-1][seen[-1].index("--strategies") + 1] == "no_buffer"
    na = [r for r in rows if r.status == "na"]
    assert na and {r.cell.split("-")[3] for r in na} == {"extra_buffer", "extra_buffer_lazy"}, na
    assert all("extra_buffer is gated on the device" in r.reason and "support_mamba_cache_extra_buffer" in r.reason for r in na)
    rows = history.sglang_cpu_rows("0.5.99", tmp_path, features | {"extra_buffer_gate": "server_args"}, requested=True,
                                   tier="premerge", models=("qwen3-next",))
    assert seen[-1][seen[-1].index("--strategies") + 1] == "no_buffer,extra_buffer,extra_buffer_lazy" and not rows


REPORT = {
    "cells": [
        {"id": "qwen3-next-80b-extra_buffer-p1-t256", "checks": {
            "kl": {"status": "pass", "metrics": {}},
            "programs": {"status": "fail", "reason": "answer differs from the cold twin", "details": {"failure_file": "REPLAY"}},
            "gsm8k": {"status": "skip", "reason": "n/a: no baseline"},
            "leaks": {"status": "error", "reason": "server died"}}},
        {"id": "qwen3-next-80b-extra_buffer_lazy-p1-t256", "not_applicable": "no lazy", "checks": {}},
    ],
    "cells_not_run": ["nemotron-nano-9b-v2-extra_buffer-p1-t256"],
}


def test_report_rows_one_per_cell_and_check_error_is_fail_skip_is_na(tmp_path):
    replay = tmp_path / "finding.json"
    replay.write_text("{}")
    report = json.loads(json.dumps(REPORT).replace("REPLAY", str(replay)))
    rows = history.report_rows("0.5.13", report, replay_dir=tmp_path / "out" / "replays" / "0.5.13")
    got = {(r.cell, r.check): r for r in rows}
    cell = "qwen3-next-80b-extra_buffer-p1-t256"
    assert got[(cell, "sglang-cpu:kl")].status == "pass"
    assert got[(cell, "sglang-cpu:gsm8k")].status == "na" and got[(cell, "sglang-cpu:gsm8k")].reason == "n/a: no baseline"
    assert got[(cell, "sglang-cpu:leaks")].status == "fail" and got[(cell, "sglang-cpu:leaks")].reason == "server died"
    fail = got[(cell, "sglang-cpu:programs")]
    assert fail.status == "fail" and fail.replay == str(tmp_path / "out" / "replays" / "0.5.13" / "finding.json")
    assert Path(fail.replay).read_text() == "{}"
    assert got[("qwen3-next-80b-extra_buffer_lazy-p1-t256", "sglang-cpu")] == Row(
        "0.5.13", "sglang-cpu", "na", "no lazy", cell="qwen3-next-80b-extra_buffer_lazy-p1-t256")
    assert got[("nemotron-nano-9b-v2-extra_buffer-p1-t256", "sglang-cpu")].status == "fail"


def test_table_and_html_fold_cells_fail_first_and_link_the_replay(tmp_path):
    from conformance.report.history_html import render_html

    rows = [Row("0.5.12", "sglang-cpu:programs", "pass", "", cell="a"),
            Row("0.5.12", "sglang-cpu:programs", "fail", "leak", cell="b", replay=str(tmp_path / "replays" / "0.5.12" / "f.json")),
            Row("0.5.13", "sglang-cpu:programs", "pass", "", cell="a"), Row("0.5.13", "sglang-cpu:programs", "na", "no lazy", cell="c")]
    table = history.render_table(rows, ["0.5.12", "0.5.13"])
    assert next(ln for ln in table.splitlines() if ln.startswith("sglang-cpu:programs")).split()[1:] == ["FAIL", "pass"]
    assert "0.5.12 sglang-cpu:programs [b]: FAIL: leak (replay: " in table
    page = render_html(rows, ["0.5.12", "0.5.13"], {"0.5.12": "sglang 0.5.12: probes"}, base=tmp_path)
    assert '<td class="fail"' in page and 'href="replays/0.5.12/f.json"' in page
    assert ">FAIL (1/2)" in page and ">pass (1/2)" in page and "sglang 0.5.12: probes" in page
    assert history.fold([Row("x", "c", "na", "n", cell="a")])[("x", "c")][0] == "na"


def test_history_writes_json_and_html_through_the_console_script(tmp_path):
    """--out through the installed console script: a release older than the range stops at
    argument parsing (exit 2), so the files come from a run that needs no venv: none here."""
    out = subprocess.run(["hybrid-conformance", "history", "--releases", "0.5.3", "--out", str(tmp_path / "h")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "older than the oldest supported release" in out.stderr
    history.write_outputs(tmp_path / "h", {"rows": [{"release": "0.5.13", "check": "sglang-cpu:kl", "status": "fail", "reason": "x",
                                                      "cell": "c", "replay": ""}], "probes": {}}, ["0.5.13"])
    assert json.loads((tmp_path / "h" / "history.json").read_text())["rows"][0]["cell"] == "c"
    assert "<table>" in (tmp_path / "h" / "history.html").read_text()


OVERLAP = "overlap-first-decode-boundary-track-lost"


def test_a_fail_matched_to_a_known_bug_lists_it_with_its_bracket_and_a_written_bug_folder(tmp_path):
    """history.json's ``known_bugs`` and history.html's section: one record per bug with its
    bracket and the rows it explained; its link (and the FAIL cell's) opens the folder
    ``report-bug`` writes, beside the page; an id no entry has keeps its row, no folder."""
    rows = [Row("0.5.13", "sglang-cpu:programs", "fail", "known SGLang bug, still present", cell="a", known_bug=OVERLAP),
            Row("0.5.14", "sglang-cpu:programs", "fail", "known SGLang bug, still present", cell="a", known_bug=OVERLAP),
            Row("0.5.14", "sglang-cpu:kl", "fail", "x", cell="b", known_bug="no-such-bug"),
            Row("0.5.14", "sglang-cpu:leaks", "fail", "a leak no entry explains", cell="a")]
    out = tmp_path / "h"
    doc = {"rows": [asdict(r) for r in rows], "probes": {}}
    lines = history.write_outputs(out, doc, ["0.5.13", "0.5.14"])
    assert lines[0] == f"bug folder: {out / 'bugs' / OVERLAP}" and lines[1].startswith("bug folder for no-such-bug not written: KeyError")
    bug, stray = json.loads((out / "history.json").read_text())["known_bugs"]
    assert (bug["id"], bug["first_bad"], bug["first_good"], bug["folder"]) == (OVERLAP, "0.5.13", "0.5.18", f"bugs/{OVERLAP}/README.md")
    assert bug["where"] == [{"release": "0.5.13", "check": "sglang-cpu:programs", "cell": "a"},
                            {"release": "0.5.14", "check": "sglang-cpu:programs", "cell": "a"}]
    assert (out / bug["folder"]).is_file() and stray["folder"] == "" and stray["where"] == [{"release": "0.5.14", "check": "sglang-cpu:kl", "cell": "b"}]
    page = (out / "history.html").read_text()
    assert "<h2>known SGLang bugs hit</h2>" in page and "first bad 0.5.13, first good 0.5.18" in page
    assert f'<a href="bugs/{OVERLAP}/README.md"><code>{OVERLAP}</code></a>' in page
    assert "explained 2 FAIL row(s): 0.5.13 sglang-cpu:programs [a], 0.5.14 sglang-cpu:programs [a]" in page
    assert page.count(f'href="bugs/{OVERLAP}/README.md">known bug {OVERLAP}</a>') == 4  # the cells grid and the FAIL list, both rows
    assert "<code>no-such-bug</code> (bug folder not written)" in page and 'href="known-bugs.md#no-such-bug"' in page
    assert "known-bugs.md#" + OVERLAP not in page


def test_a_history_without_a_known_bug_fail_says_none_and_writes_no_folder(tmp_path):
    rows = [Row("0.5.13", "sglang-cpu:leaks", "fail", "a leak no entry explains", cell="a"),
            Row("0.5.13", "sglang-cpu:kl", "pass", "", cell="a", known_bug=OVERLAP)]  # a pass is no hit
    out = tmp_path / "h"
    assert history.write_outputs(out, {"rows": [asdict(r) for r in rows], "probes": {}}, ["0.5.13"]) == []
    assert json.loads((out / "history.json").read_text())["known_bugs"] == [] and not (out / "bugs").exists()
    assert "<h2>known SGLang bugs hit</h2><ul><li>none</li></ul>" in (out / "history.html").read_text()


def _fake_venv(tmp_path, name: str, origins) -> Path:
    """A venv whose python prints ``origins`` for the engine libraries' probe."""
    venv = tmp_path / name
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\necho '{json.dumps(origins)}'\n")
    py.chmod(0o755)
    return venv


def test_a_venv_on_the_kits_own_torch_and_transformers_runs_the_reference_engine_in_place(monkeypatch, tmp_path):
    """A release whose pins left the kit's torch and transformers imports them from the same
    files: the reference engine needs no interpreter of its own there (it starts from the
    run's forkserver); another transformers, or a probe that fails, keeps the kit's."""
    import importlib.util

    from conformance.targets import reference

    monkeypatch.delenv(reference.PYTHON_ENV, raising=False)
    mine = [importlib.util.find_spec(m).origin for m in history.ENGINE_LIBRARIES]
    same = _fake_venv(tmp_path, "sglang-0.5.22", mine)
    other = _fake_venv(tmp_path, "sglang-0.5.21", [mine[0], "/venv/site-packages/transformers/__init__.py"])
    broken = _fake_venv(tmp_path, "sglang-0.5.20", "not json")
    assert reference.PYTHON_ENV not in history.venv_env(same)
    assert history.venv_env(other)[reference.PYTHON_ENV] == sys.executable
    assert history.venv_env(broken)[reference.PYTHON_ENV] == sys.executable


def test_release_venv_keeps_the_kits_python_for_the_reference_engine(monkeypatch, tmp_path):
    """Inside a release's venv the reference server (agreement's other side) runs with the kit's
    interpreter, started fresh (the forkserver would fork the venv's python); outside, as before."""
    from conformance.matrix.cells import load_matrix
    from conformance.targets import reference

    monkeypatch.delenv(reference.PYTHON_ENV, raising=False)
    monkeypatch.delenv(reference.NO_FORKSERVER_ENV, raising=False)
    env = history.venv_env(tmp_path / "sglang-0.5.12")
    assert env[reference.PYTHON_ENV] == sys.executable
    assert env["VIRTUAL_ENV"] == str(tmp_path / "sglang-0.5.12")
    cell = load_matrix().cells[0]
    plain = reference.ReferenceTarget()
    assert plain.forkserver and plain.launch_spec(cell, port=1).entry
    monkeypatch.setenv(reference.PYTHON_ENV, "/opt/kit/bin/python")
    kept = reference.ReferenceTarget()
    spec = kept.launch_spec(cell, port=1)
    assert spec.argv[0] == "/opt/kit/bin/python"
    assert not kept.forkserver and spec.entry is None


def test_history_workers_reach_the_server_run(monkeypatch, tmp_path):
    """``history -n``: each release's server run gets that many pytest-xdist workers (default
    min(2, cores), so a 2-core machine runs two cells at once), read as ``run`` reads its ``-n``;
    a bad count is one line before anything starts."""
    seen = record_empty_runs(monkeypatch)
    features = {"version": "0.5.23", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    history.sglang_cpu_rows("0.5.23", tmp_path, features, requested=True, tier="premerge", models=("qwen3-next",), workers=2)
    assert seen[-1][seen[-1].index("-n") + 1] == "2"
    monkeypatch.setattr(history.os, "cpu_count", lambda: 8)
    assert history.parse_workers(history_args("--releases", "0.5.23").workers) == 2
    monkeypatch.setattr(history.os, "cpu_count", lambda: 1)
    assert history.parse_workers(None) == 1
    assert history.parse_workers(history_args("--releases", "0.5.23", "-n", "3").workers) == 3
    for bad in ("two", "-1"):
        with pytest.raises(KitError, match="-n: expected a number of workers"):
            history.parse_workers(bad)


def test_history_over_the_nightly_tier_runs_a_shards_cells_by_id_at_the_given_budget(monkeypatch, tmp_path):
    """``--tier nightly``: the server run gets that tier, a shard's cells by id (``--cells``; a
    refused strategy's cell is an n/a row, never sent to the run) and the programs' budget in
    the run's environment; without cells or budget the run is asked as before."""
    seen, envs = [], []

    def fake_run(argv, *, timeout, env=None, cwd=None):
        seen.append(list(argv))
        envs.append(env or {})
        ran = argv[argv.index("--cells") + 1].split(",") if "--cells" in argv else []
        (Path(argv[argv.index("--report-dir") + 1]) / "report.json").write_text(json.dumps({"cells": [{"id": c, "checks": {"kl": {"status": "pass"}}} for c in ran]}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    features = {"version": "0.5.12", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    cells = ("falcon-h1-0.5b-extra_buffer-p256-t256-eviction-tlru", "qwen3-next-80b-extra_buffer_lazy-p64-t256")
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="nightly", cells=cells, budget="nightly",
                                   out_dir=tmp_path / "out", part="shard-1")
    argv = seen[-1]
    assert argv[argv.index("--tier") + 1] == "nightly"
    assert argv[argv.index("--cells") + 1] == cells[0]
    assert envs[-1][history.BUDGET_ENV] == "nightly"
    assert (tmp_path / "out" / "runs" / "0.5.12-shard-1" / "report.json").is_file()
    assert [(r.cell, r.status) for r in rows] == [(cells[1], "na"), (cells[0], "pass")]
    history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="nightly", models=("falcon-h1",))
    assert "--cells" not in seen[-1] and history.BUDGET_ENV not in envs[-1]


def test_cells_option_selects_cells_by_id_and_names_an_unknown_one():
    from conformance.matrix.cells import load_matrix

    m = load_matrix()
    ids = ["qwen3-next-80b-extra_buffer-p64-t256", "qwen3-next-80b-no_buffer-p1-t256"]
    assert [c.id for c in m.select(tier="nightly", cells=ids)] == ids[::-1]  # file order
    assert m.select(tier="premerge", cells=ids) == [c for c in m.select(tier="premerge") if c.id == ids[1]]
    with pytest.raises(KitError, match="--cells: unknown cell 'nope'"):
        m.select(cells=["nope"])


def test_a_cell_asked_for_that_the_run_does_not_report_is_a_fail_row(monkeypatch, tmp_path):
    """A shard's cell the inner run leaves out of its report (its suites bind none of the
    run's) is a FAIL row naming it, never a silent gap; a reported cell gets only its own rows."""
    asked = ["qwen3-next-80b-extra_buffer-p1-t256", "qwen3-next-80b-no_buffer-p1-t256"]

    def fake_run(argv, *, timeout, env=None, cwd=None):
        report_dir = Path(argv[argv.index("--report-dir") + 1])
        (report_dir / "report.json").write_text(json.dumps({"cells": [{"id": asked[0], "checks": {"kl": {"status": "pass"}}}], "complete": True}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(history, "_run", fake_run)
    features = {"version": "0.5.12", "strategies": ["no_buffer", "extra_buffer"], "sglang_cpu_gap": None}
    rows = history.sglang_cpu_rows("0.5.12", tmp_path, features, requested=True, tier="nightly", cells=asked)
    assert [r for r in rows if r.cell == asked[0]] == [Row("0.5.12", "sglang-cpu:kl", "pass", "", cell=asked[0])]
    [gap] = [r for r in rows if r.cell == asked[1]]
    assert gap.status == "fail" and "reported no test of it" in gap.reason
