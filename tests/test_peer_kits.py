"""``history --peer-kits``: SGLang's own kits against a server, and the verdict per bug.

- SGLang 0.5.23's prefix-cache branching kit, imported from the installed package and run by
  :func:`play_kits` against a small HTTP server: a server that owes and reports the branch
  hit passes; a seeded lost hit (``cached_tokens`` 0 where 256 is owed) is a ``fail`` with the
  kit's own assertion line.  A release without a kit or a test is ``n/a`` with the reason; a
  server that is gone makes every later kit ``n/a``, never a pass.
- The verdict of a kit test on a bug: caught only when it fails on the bad release *and*
  passes on the good one (a test failing on both is not a catch; a pass is a miss).
- The command over fake release runs: one row per bug (variants folded in), the JSON and the
  docs table, a variant's id refused with its bug's name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conformance.commands.bisect import Probe
from conformance.commands.peer_kits import PeerRow, ReleaseRun, alongside, bracket_releases, bug_groups, markdown, rows_from_json, run_peer_kits
from conformance.errors import KitError
from conformance.reference.twins import ensure_twin
from conformance.session.known_bugs import load
from conformance.sglang_api.peer_kits import PEER_KITS, KitOutcome, PeerKit, PeerServer, play_kits

ROOT = Path(__file__).resolve().parents[1]
#: The documented peer baseline (docs/report-bug.md), run as typed by the scheduled test below.
DOC_COMMAND = "hybrid-conformance history --peer-kits all --doc docs/peer-baseline.md"
PREFIX = next(k for k in PEER_KITS if k.name == "prefix_cache_branching")


class _Branching(BaseHTTPRequestHandler):
    """Answers the prefix-branching kit: the third request after a flush reports ``hit``."""

    hit = 256
    seen = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        cls = type(self)
        if self.path == "/flush_cache":
            cls.seen, body = 0, {}
        else:
            cls.seen += 1
            body = {"text": "x", "meta_info": {"cached_tokens": cls.hit if cls.seen == 3 else 0}}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def branching():
    def serve(hit: int):
        handler = type("Handler", (_Branching,), {"hit": hit, "seen": 0})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    servers: list = []
    yield serve
    for s in servers:
        s.shutdown()


def server(url: str, alive=lambda: None) -> PeerServer:
    return PeerServer(url, str(ensure_twin("tiny-qwen3-next")), "qwen3-next", 256, alive)


def test_sglang_prefix_kit_passes_a_server_that_reports_the_owed_hit(branching):
    assert play_kits(server(branching(256)), (PREFIX,)) == [KitOutcome("prefix_cache_branching", "test_prefix_cache_branching", "pass")]


def test_sglang_prefix_kit_names_a_seeded_lost_hit(branching):
    [out] = play_kits(server(branching(0)), (PREFIX,))
    assert out.status == "fail"
    assert "cached_tokens=0 is not equal to expected_cached_tokens=256" in out.line


def test_a_missing_kit_or_test_is_na_with_the_reason(branching):
    missing = PeerKit("nope", "sglang.test.kits.no_such_kit", "NoMixin", ("test_x",))
    no_test = PeerKit("prefix", PREFIX.module, PREFIX.mixin, ("test_not_in_this_release",))
    outs = play_kits(server(branching(256)), (missing, no_test))
    assert [o.status for o in outs] == ["n/a", "n/a"]
    assert "ships no sglang.test.kits.no_such_kit" in outs[0].line and "has no test_not_in_this_release" in outs[1].line


def test_a_gone_server_plays_nothing_and_passes_nothing(branching):
    outs = play_kits(server(branching(256), alive=lambda: "exit code -9"), PEER_KITS)
    assert outs and {o.status for o in outs} == {"n/a"}
    assert all("server is gone (exit code -9)" in o.line for o in outs)


def _run(release: str, statuses: dict[str, str], replay: str = "bad") -> ReleaseRun:
    kits = tuple(KitOutcome(name.split(".")[0], name.split(".")[1], s, "assert" if s == "fail" else "") for name, s in statuses.items())
    return ReleaseRun(release, kits, "serving after the kits", Probe(release, replay, "leak_mamba: 3 slots held at idle"))


def test_caught_only_when_failing_on_the_bad_release_and_passing_on_the_good():
    bug = next(b for b in load() if b.id == "session-first-turn-abort-leaks-mamba")
    bad = _run("0.5.12", {"a.caught": "fail", "b.both": "fail", "c.missed": "pass", "d.na": "n/a"})
    good = _run("0.5.13", {"a.caught": "pass", "b.both": "fail", "c.missed": "pass", "d.na": "pass"})
    row = PeerRow(bug, ("leaks",), bad, good)
    assert row.caught_by_kits() == ["a.caught"]
    assert [row.verdict(k) for k in bad.kits] == ["caught", "fails on both", "missed", "n/a"]
    assert PeerRow(bug, ("leaks",), bad, None).verdict(bad.kits[0]) == "fails (no fixed release to compare)"
    assert row.kit_catch().startswith("yes: leaks")
    assert PeerRow(bug, ("leaks",), _run("0.5.12", {}, replay="good"), good).kit_catch().startswith("no on 0.5.12")


def _args(tmp_path: Path, ids: str, doc: Path | None = None) -> argparse.Namespace:
    return argparse.Namespace(peer_kits=ids, venv_dir=str(tmp_path), out=str(tmp_path / "out"), doc=str(doc) if doc else None)


def test_the_command_writes_one_row_per_bug_with_its_variants(tmp_path, capsys):
    calls = []

    def probe(bug, release, replay):
        calls.append((bug.id, release, replay))
        return _run(release, {"prefix_cache_branching.test_prefix_cache_branching": "fail" if release == bug.first_bad else "pass"})

    doc = tmp_path / "peer.md"
    ids = "mamba2-short-extend-hit-drops-initial-state,logprob-ids-clip-last-vocab-id"
    assert run_peer_kits(_args(tmp_path, ids, doc), probe) == 0
    assert calls == [("mamba2-short-extend-hit-drops-initial-state", "0.5.14", True), ("mamba2-short-extend-hit-drops-initial-state", "0.5.15", False),
                     ("logprob-ids-clip-last-vocab-id", "0.5.11", True)]
    rows = json.loads((tmp_path / "out" / "peer-kits" / "peer-kits.json").read_text())
    assert rows[0]["checks"] == ["programs", "kl", "prefix_branching", "gsm8k", "agreement"]
    assert rows[0]["caught_by_sglang_kits"] == ["prefix_cache_branching.test_prefix_cache_branching"]
    assert rows[1]["good"] is None and rows[1]["caught_by_sglang_kits"] == []  # no fixed release: nothing to tell it from
    text = doc.read_text()
    assert "| `mamba2-short-extend-hit-drops-initial-state` | `>=0.5.14,<0.5.15` | 0.5.14 / 0.5.15 |" in text
    # the JSON reads back into the same table
    assert markdown(rows_from_json(rows, load()), f"hybrid-conformance history --peer-kits {ids}", datetime.date.today().isoformat()) == text
    assert "`prefix_cache_branching.test_prefix_cache_branching` (assert)" in text  # a catch shows its failure line
    assert "`streaming_session.nth_mid_abort_recovery` (asks for 100000 new tokens" in text  # what is not played, and why
    assert "0.5.11 / none fixed" in text and "with no fixed release to tell them from failures of every release" in text


def test_a_variant_id_is_refused_with_its_bug(tmp_path):
    with pytest.raises(KitError, match="is a variant; name its bug \\(mamba2-short-extend-hit-drops-initial-state\\)"):
        run_peer_kits(_args(tmp_path, "mamba2-short-extend-hit-drops-initial-state-kl"), lambda *a: None)


def test_every_bug_has_one_group_headed_by_its_entry():
    groups = bug_groups(load())
    assert all(g[0].id == head and not g[0].variant_of for head, g in groups.items())
    assert sum(len(g) for g in groups.values()) == len(load())


def test_the_releases_played_prefer_ready_venvs_inside_the_measured_bracket():
    by_id = {b.id: b for b in load()}
    clip = by_id["logprob-ids-clip-last-vocab-id"]  # measured FAIL on 0.5.11, 0.5.22, 0.5.23; no fixed release
    assert bracket_releases(clip, {"0.5.12", "0.5.22", "0.5.23"}) == ("0.5.22", None)
    assert bracket_releases(clip, set()) == ("0.5.11", None)
    short = by_id["mamba2-short-extend-hit-drops-initial-state"]  # FAIL 0.5.14, PASS 0.5.13 and 0.5.15
    assert bracket_releases(short, {"0.5.13", "0.5.15"}) == ("0.5.14", "0.5.15")
    lazy = by_id["lazy-session-counts-unused-pingpong"]
    assert bracket_releases(lazy, {"0.5.13", "0.5.22"}) == ("0.5.13", "0.5.22")


@pytest.mark.release_range
@pytest.mark.timeout(8 * 3600)
def test_the_documented_peer_baseline_runs_and_every_bug_is_caught_by_the_kit():
    assert DOC_COMMAND in (ROOT / "docs" / "report-bug.md").read_text()
    assert shutil.which("hybrid-conformance"), "the hybrid-conformance console script is not installed"
    out = subprocess.run(["bash", "-c", DOC_COMMAND], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    rows = [ln for ln in (ROOT / "docs" / "peer-baseline.md").read_text().splitlines() if ln.startswith("| `")]
    assert len(rows) == len(bug_groups(load()))
    assert all("| yes: " in r for r in rows), "\n".join(r for r in rows if "| yes: " not in r)


def test_another_bug_on_the_same_cell_fixed_by_the_same_release_is_named():
    groups = bug_groups(load())
    by_id = {b.id: b for b in load()}
    # 0.5.18 -> 0.5.22 on the lazy alloc-fail cell also fixes the lazy session ping-pong leak
    cell = "qwen3-next-80b-extra_buffer_lazy-p1-t256-lazy_alloc_fail"
    assert alongside(by_id["lazy-alloc-fail-in-place-track-keeps-old-seqlen"], cell, "0.5.18", "0.5.22", groups) == ("lazy-session-counts-unused-pingpong",)
    assert alongside(by_id["session-first-turn-abort-leaks-mamba"], "qwen3-next-80b-extra_buffer-p1-t256", "0.5.12", "0.5.13", groups) == ()


def test_kits_sglangs_ci_plays_on_extra_buffer_only_are_na_on_no_buffer(branching):
    no_buffer = PeerServer(branching(256), str(ensure_twin("tiny-qwen3-next")), "qwen3-next", 256, lambda: None, 8192, "no_buffer")
    [out] = play_kits(no_buffer, (PREFIX,))
    assert out.status == "n/a" and "extra_buffer/extra_buffer_lazy servers only; this one runs no_buffer" in out.line
    lazy = PeerServer(no_buffer.base_url, no_buffer.model_path, "qwen3-next", 256, lambda: None, 8192, "extra_buffer_lazy")
    assert PREFIX.refusal(lazy) is None


def test_the_kits_are_scaled_to_the_server_as_sglangs_fixtures_would_set_them():
    session = next(k for k in PEER_KITS if k.name == "streaming_session")
    abort_all = next(k for k in PEER_KITS if k.name == "abort_all")
    base = dict(base_url="u", model_path="m", family="qwen3-next", track_interval=256, alive=lambda: None, pool_tokens=8192)
    assert session.settings(PeerServer(**base, overlap=False)) == {"kv_inherit_offset": -1}
    assert session.settings(PeerServer(**base, overlap=True)) == {}
    assert abort_all.settings(PeerServer(**base)) == {"abort_all_num_requests": 8, "abort_all_max_new_tokens": 512}
    assert set(session.not_played) >= {"test_nth_mid_abort_recovery", "test_first_mid_abort_recovery"}
