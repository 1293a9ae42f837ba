"""``hybrid-conformance report-bug ID``: the folder's files, and the standalone player they carry.

* the folder: four files, one per ``Artefact`` record; ``server_command.sh`` runs exactly the
  LaunchSpec's argv and env (run with a fake interpreter that records them); ``repro.py``
  imports only the standard library and ``requests``; ``test_regression.py`` calls only
  ``sglang.test.test_utils`` names the installed SGLang has; an unknown id is one line, exit 2;
* the plan: every entry's program resolves, no placeholder reaches a payload, the prefix
  oracle's hit where it predicts one (the overlap bug's 256);
* the player (``conformance/commands/repro_player.py``) against a fake SGLang HTTP server:
  a healthy one gives only ``ok`` lines and exit 0 (numbers judged, not vacuous); seeded
  wrong answers -- a logprob after a hit, a lost hit, a leak at idle -- each give ``DIFFERS``
  and exit 1.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sglang.test as sglang_test

from conformance import cli
from conformance.commands import bug_artefacts, report_bug
from conformance.commands.bug_plan import PLACEHOLDER, plan_for
from conformance.commands.repro_player import Player, main as player_main
from conformance.programs.program import load_program
from conformance.programs.replay import find_cell
from conformance.session.known_bugs import load
from conformance.session.options import options_from_args
from conformance.report.html import render_html
from conformance.report.markdown import render_markdown
from conformance.report.schema import build_report
from conformance.targets.base import LaunchSpec

ROOT = Path(__file__).resolve().parents[1]
BUG = "overlap-first-decode-boundary-track-lost"


@pytest.fixture
def fake_spec(monkeypatch):
    """The sglang-cpu LaunchSpec, without a twin folder or a probe of SGLang."""
    def spec_for(cell, options, *, port):
        argv = ["/opt/py", "-m", "sglang.launch_server", "--model-path", "/twins/x", "--port", str(port),
                "--enable-streaming-session", "--device", "cpu", "--context-length", "4096"]
        return LaunchSpec(argv=argv, env={"SGLANG_PLUGINS": "a,b", "PYTHONPATH": "/kit/standin:/kit", "X_QUOTED": "a b"}, port=port)

    monkeypatch.setattr(report_bug, "spec_for", spec_for)
    return spec_for


def test_the_folder_holds_one_file_per_artefact_and_the_command_is_the_launch_spec(tmp_path, fake_spec, capsys):
    out = tmp_path / "bug"
    assert cli.main(["report-bug", BUG, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(a.name for a in bug_artefacts.ARTEFACTS)
    assert "first bad 0.5.13, first good 0.5.18" in capsys.readouterr().out
    # run the command with an interpreter that records what it was given
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv[1:], 'env': dict(os.environ)}}))\n")
    fake.chmod(0o755)
    ran = subprocess.run(["bash", str(out / "server_command.sh")], env={"PATH": os.environ["PATH"], "PYTHON": str(fake), "PORT": "31999"},
                         capture_output=True, text=True, check=True)
    seen = json.loads(ran.stdout)
    spec = fake_spec(None, None, port=31999)
    assert seen["argv"] == spec.argv[1:]
    assert {k: seen["env"][k] for k in spec.env} == spec.env
    readme = (out / "README.md").read_text()
    bug = next(b for b in load() if b.id == BUG)
    assert bug.code_path in readme and bug.releases in readme and "first bad **0.5.13**, first good **0.5.18**" in readme


def test_repro_is_standalone_and_the_regression_test_calls_sglang_helpers_it_has(tmp_path, fake_spec):
    out = tmp_path / "bug"
    cli.main(["report-bug", BUG, "--out", str(out)])
    for name in ("repro.py", "test_regression.py"):
        ast.parse((out / name).read_text())
    imported = {n.split(".")[0] for node in ast.walk(ast.parse((out / "repro.py").read_text()))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])}
    assert imported - set(sys.stdlib_module_names) == {"requests"}
    test = ast.parse((out / "test_regression.py").read_text())
    names = {a.name for node in ast.walk(test) if isinstance(node, ast.ImportFrom) and node.module == "sglang.test.test_utils" for a in node.names}
    assert {"popen_launch_server", "DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH", "CustomTestCase"} <= names
    source = ast.parse((Path(sglang_test.__file__).parent / "test_utils.py").read_text())
    defined = {getattr(n, "name", None) for n in source.body} | {t.id for n in source.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert names <= defined  # they exist in the installed release's source; none is copied
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "popen_launch_server" for n in test.body)
    cls = next(n for n in test.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test"))
    assert [b.id for b in cls.bases] == ["CustomTestCase"] and cls.name == "TestOverlapFirstDecodeBoundaryTrackLost"


def test_an_unknown_id_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "conformance.cli", "report-bug", "overlap-first-decode", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "did you mean overlap-first-decode-boundary-track-lost" in out.stderr
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ the run's reports

def _report_hitting(bug_id: str | None) -> dict:
    cells = [{"id": "c1", "checks": {"programs": {"status": "fail", "reason": "known"}}},
             {"id": "c2", "checks": {"kl": {"status": "fail", "reason": "known"}}}]
    report = build_report(target="sglang-cpu", launches=2, wall_s=1.0, cells=cells)
    bug = next((b for b in load() if b.id == bug_id), None)
    report["known_bugs"] = [{"cell": c, "check": k, **bug.to_json()} for c, k in (("c1", "programs"), ("c2", "kl"))] if bug else []
    return report


def test_a_run_that_hit_a_known_bug_names_it_with_its_bracket_and_folder_everywhere(tmp_path, fake_spec):
    report = _report_hitting(BUG)
    md, page = render_markdown(report), render_html(report, [], tmp_path)
    for text in (md, page):
        assert "Known SGLang bugs hit" in text and f"bugs/{BUG}/README.md" in text
        assert "first bad 0.5.13, first good 0.5.18" in text and f"hybrid-conformance report-bug {BUG}" in text
    assert md.count(f"`{BUG}`") == 1 and "`c1 programs`, `c2 kl`" in md  # one row per bug, every failure it explained
    lines = report_bug.write_bug_folders(report, tmp_path, options_from_args(cli.build_parser(only="report-bug").parse_args(["report-bug", BUG])))
    assert lines == [f"bug folder: {tmp_path / 'bugs' / BUG}"]
    assert sorted(p.name for p in (tmp_path / "bugs" / BUG).iterdir()) == sorted(a.name for a in bug_artefacts.ARTEFACTS)


def test_a_run_without_known_bugs_has_no_section_and_an_unknown_id_is_a_line(tmp_path):
    clean = _report_hitting(None)
    assert "Known SGLang bugs hit" not in render_markdown(clean) and "Known SGLang bugs hit" not in render_html(clean, [], tmp_path)
    stray = {**clean, "known_bugs": [{"cell": "c1", "check": "programs", "id": "no-such-bug"}]}
    options = options_from_args(cli.build_parser(only="report-bug").parse_args(["report-bug", BUG]))
    assert report_bug.write_bug_folders(stray, tmp_path, options) == ["bug folder for no-such-bug not written: KeyError: 'no-such-bug'"]


# ------------------------------------------------------------------ the plan

def _plan(bug_id: str) -> dict:
    bug = next(b for b in load() if b.id == bug_id)
    program = load_program(bug.replay_path())
    return plan_for(program, find_cell(program, None), [], exact=True, title=bug.id)


def _ints(value):
    if isinstance(value, dict):
        return [x for v in value.values() for x in _ints(v)]
    if isinstance(value, list):
        return [x for v in value for x in _ints(v)]
    return [value] if isinstance(value, int) else []


@pytest.mark.parametrize("bug_id", sorted({b.id for b in load()}))
def test_every_entry_resolves_to_a_plan_without_placeholders(bug_id):
    plan = _plan(bug_id)
    assert plan["steps"] and all(i < PLACEHOLDER for i in _ints(plan["steps"]))
    json.dumps(plan)


def test_the_overlap_bugs_follow_up_continues_r1s_output_and_the_oracle_expects_256():
    r1, r2 = _plan(BUG)["steps"]
    assert r1["hit"] == [0] and r2["needs"] == ["r1"] and r2["hit"] == [256]
    assert r2["input"][1] == {"output_of": "r1", "start": 0, "end": 1} and len(r2["input"][0]) == 255


# ------------------------------------------------------------------ the player against a fake server

def _next(ids):
    return (sum(ids) * 31 + len(ids)) % 500


def _lp(ids):
    return -((_next(ids) % 7) + 1) / 10


class FakeSGLang(BaseHTTPRequestHandler):
    """SGLang's HTTP API over a deterministic toy model: the cache is an exact-prefix store;
    ``bugs`` seeds wrong answers ("logprob_after_hit", "lost_hit", "leak")."""

    bugs: set = set()
    stored: list = []

    def log_message(self, *a):
        pass

    def _send(self, body, code=200):
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/metrics":
            used = 3 if "leak" in self.bugs else 0
            return self._send(f"sglang:mamba_used_tokens {used}\nsglang:mamba_available_tokens {48 - used}\nhybrid_conformance:mamba_total 48\n")
        self._send({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/flush_cache":
            self.stored.clear()
            return self._send("ok")
        if self.path != "/generate":
            return self._send({})
        ids, sp = list(body["input_ids"]), body["sampling_params"]
        if sp["max_new_tokens"] == 0:  # the cold computation
            start = body["logprob_start_len"]
            rows = [[None if p == 0 else _lp(ids[:p]), ids[p]] for p in range(start, len(ids))]
            tops = [[[_lp(ids[:p]), _next(ids[:p])]] if p else [] for p in range(start, len(ids))]
            return self._send({"output_ids": [], "meta_info": {"input_token_logprobs": rows, "input_top_logprobs": tops, "cached_tokens": 0}})
        hit = max((len(s) for s in self.stored if len(s) < len(ids) and ids[: len(s)] == s), default=0)
        seq, out, lps = list(ids), [], []
        for k in range(sp["max_new_tokens"]):
            out.append(_next(seq))
            lps.append([_lp(seq) + (0.3 if k == 0 and hit and "logprob_after_hit" in self.bugs else 0.0), out[-1]])
            seq.append(out[-1])
        self.stored.append(list(ids))
        if "lost_hit" in self.bugs:
            hit = 0
        self._send({"output_ids": out, "meta_info": {"cached_tokens": hit, "output_token_logprobs": lps, "finish_reason": {"type": "length"}}})


@pytest.fixture
def fake_server():
    FakeSGLang.bugs, FakeSGLang.stored = set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", FakeSGLang
    server.shutdown()


PROMPT = list(range(1, 41))
PLAN = {
    "title": "fake bug",
    "tolerance": {"tie_eps": 1e-4, "logprob_atol": 2e-4},
    "idle": {"deadline_s": 1.0, "pools": {"mamba": {"used": "sglang:mamba_used_tokens", "available": "sglang:mamba_available_tokens",
                                                     "evictable": "sglang:mamba_evictable_tokens", "protected": "x:protected",
                                                     "session_held": "x:held", "total": "hybrid_conformance:mamba_total"}}, "standins": {}},
    "steps": [
        {"op": "send", "rid": "r1", "at": 0, "input": [PROMPT], "payload": {"rid": "{tag}-r1", "sampling_params": {"max_new_tokens": 2}}, "hit": [0]},
        {"op": "send", "rid": "r2", "at": 1, "needs": ["r1"], "input": [PROMPT, {"output_of": "r1", "start": 0, "end": 2}, [7, 8]],
         "payload": {"rid": "{tag}-r2", "sampling_params": {"max_new_tokens": 3}}, "hit": [40]},
        {"op": "idle", "at": 2},
    ],
}


def test_a_healthy_server_gives_only_ok_numbers(fake_server, capsys):
    url, _ = fake_server
    findings = Player(url, PLAN, out=lambda line: None).run()
    assert findings and all(f.ok for f in findings), [f.line() for f in findings]
    assert {f.what.split(" ")[0] for f in findings} >= {"cached_tokens", "output", "mamba"}  # hits, answers and idle judged
    assert player_main(PLAN, ["--url", url]) == 0 and "the bug does not reproduce here" in capsys.readouterr().out


@pytest.mark.parametrize("bug,line", [
    ("logprob_after_hit", "DIFFERS  r2: output logprob 0 (position 44): expected -0.6 (cache-off), got -0.3"),
    ("lost_hit", "DIFFERS  r2: cached_tokens: expected 40, got 0"),
    ("leak", "DIFFERS  idle after step 2: mamba pool at idle (total 48, available 45): expected used 0 (what sessions hold), got used 3"),
])
def test_a_seeded_wrong_answer_is_printed_expected_against_observed_and_exits_1(fake_server, capsys, bug, line):
    url, fake = fake_server
    fake.bugs = {bug}
    assert player_main(PLAN, ["--url", url]) == 1
    out = capsys.readouterr().out
    assert line in out.splitlines() and "the bug reproduces" in out
