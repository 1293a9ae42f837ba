"""``replay --repeat N`` (``conformance/programs/replay.py``): a play that leaves the server
dead gets the next play fresh servers, so a death is one failed play, not every play after it
(before, plays 2..N failed with "server not serving before the program started")."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

from conformance.checks.findings import Finding
from conformance.programs import replay
from conformance.programs.runner import ProgramFailure


class FakeProcess:
    def __init__(self) -> None:
        self.reason: str | None = None

    def exit_reason(self) -> str | None:
        return self.reason


def test_a_play_that_kills_the_server_gets_the_next_play_a_fresh_one(monkeypatch, tmp_path):
    launches: list[Path] = []
    served: list[SimpleNamespace] = []

    @contextlib.contextmanager
    def serve_cell(cell, options, *, log_dir):
        launches.append(log_dir)
        ep = SimpleNamespace(process=FakeProcess(), n=len(launches))
        served.append(ep)
        yield ep

    @contextlib.contextmanager
    def serve_cold(cell, options, log_dir):
        yield SimpleNamespace(process=FakeProcess())

    def run_program(program, target):
        ep = target
        if ep.n == 1 and not getattr(ep, "played", False):  # the first play on the first server kills it
            ep.played = True
            ep.process.reason = "exited with code -9"
            raise ProgramFailure(3, [Finding("server_died:exception", "server died: exited with code -9")], [])
        return f"pass on server {ep.n}"

    monkeypatch.setattr(replay, "serve_cell", serve_cell)
    monkeypatch.setattr(replay, "serve_cold", serve_cold)
    monkeypatch.setattr(replay, "target_for", lambda ep, cold: ep)
    monkeypatch.setattr(replay, "run_program", run_program)
    outcomes = list(replay.play(None, None, None, tmp_path, repeat=3))
    assert isinstance(outcomes[0], ProgramFailure) and outcomes[1:] == ["pass on server 2", "pass on server 2"]
    assert launches == [tmp_path, tmp_path / "launch-2"]


def test_a_failure_that_leaves_the_server_alive_keeps_it_for_the_next_play(monkeypatch, tmp_path):
    launches = []

    @contextlib.contextmanager
    def serve(cell, options, log_dir=None, **kw):
        launches.append(log_dir)
        yield SimpleNamespace(process=FakeProcess())

    def run_program(program, target):
        raise ProgramFailure(1, [Finding("answer_differs_on_hit", "request t3 differs")], [])

    monkeypatch.setattr(replay, "serve_cell", lambda cell, options, *, log_dir: serve(cell, options, log_dir))
    monkeypatch.setattr(replay, "serve_cold", serve)
    monkeypatch.setattr(replay, "target_for", lambda ep, cold: ep)
    monkeypatch.setattr(replay, "run_program", run_program)
    outcomes = list(replay.play(None, None, None, tmp_path, repeat=3))
    assert len(outcomes) == 3 and all(isinstance(o, ProgramFailure) for o in outcomes)
    assert launches == [tmp_path, tmp_path]  # one cell server and one cold twin, kept for all three plays
