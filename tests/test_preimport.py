"""The pre-imported launcher (``conformance.targets.preimport`` + ``zygote``) with real
processes and a stand-in server module: each server gets its exact argv and environment,
cells that differ only in run-time switches share one zygote, anything else gets its
own, and every way it cannot serve falls back to a plain launch with one line saying why.
(Real SGLang from a zygote, with a fault firing: tests/test_sglang_fault_probes.py;
zero orphans after kill -9: tests/test_process_hygiene.py.)"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.errors import KitError, ServerStartError
from conformance.matrix.faults import SGLANG_FAULT_ENV
from conformance.targets import preimport
from conformance.targets.launcher import ServerProcess, free_port

ENVDUMP = textwrap.dedent(
    """
    # Stand-in server: writes its argv and environment to --dump, then answers /health.
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer


    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.end_headers()


    def main():
        args = sys.argv[1:]
        port, dump = int(args[args.index("--port") + 1]), args[args.index("--dump") + 1]
        if "--exit" in args:
            print("fatal: the stand-in refuses to start", flush=True)
            sys.exit(3)
        with open(dump, "w") as f:
            json.dump({"argv": sys.argv, "env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(), "name": __name__}, f)
        HTTPServer(("127.0.0.1", port), H).serve_forever()


    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture(autouse=True)
def fresh_zygotes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(preimport.LAUNCH_ENV, raising=False)
    preimport.stop_all()
    preimport._SAID.clear()
    yield
    preimport.stop_all()


@pytest.fixture
def modules(tmp_path: Path) -> Path:
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "envdump.py").write_text(ENVDUMP)
    (folder / "broken.py").write_text("raise ImportError('the stand-in stack cannot import here')\n")
    return folder


def server(tmp_path: Path, modules: Path, name: str, *, extra_env: dict | None = None, fixed: dict | None = None,
           argv_tail: tuple[str, ...] = (), preload: tuple[str, ...] = ("envdump",), module: str = "envdump") -> tuple[ServerProcess, Path]:
    port, dump = free_port(), tmp_path / f"{name}.json"
    spec_env = {"PYTHONPATH": str(modules), "STANDIN_FIXED": "a", **(fixed or {})}
    env = {**spec_env, **(extra_env or {})}
    argv = [sys.executable, "-m", module, "--port", str(port), "--dump", str(dump), *argv_tail]
    sp = ServerProcess(name=name, argv=argv, env=env, health_url=f"http://127.0.0.1:{port}/", log_path=tmp_path / f"{name}.log",
                       start_timeout_s=60, stop_timeout_s=2.0, preimport_env=spec_env, preload=preload)
    return sp, dump


def test_forked_server_gets_its_exact_argv_and_env_and_late_switches_share_a_zygote(tmp_path: Path, modules: Path) -> None:
    a, dump_a = server(tmp_path, modules, "a", extra_env={SGLANG_FAULT_ENV: "cow_skipped"})
    b, dump_b = server(tmp_path, modules, "b", extra_env={SGLANG_FAULT_ENV: "double_free"})
    c, dump_c = server(tmp_path, modules, "c", fixed={"STANDIN_FIXED": "b"})
    with a, b, c:
        got = {k: json.loads(p.read_text()) for k, p in (("a", dump_a), ("b", dump_b), ("c", dump_c))}
        assert {a.launch, b.launch, c.launch} == {"pre-imported"}
    assert got["a"]["env"][SGLANG_FAULT_ENV] == "cow_skipped" and got["b"]["env"][SGLANG_FAULT_ENV] == "double_free"
    assert SGLANG_FAULT_ENV not in got["c"]["env"] and got["c"]["env"]["STANDIN_FIXED"] == "b"
    assert got["a"]["argv"][1:] == a.argv[3:] and got["a"]["name"] == "__main__"
    # a and b differ only in a run-time switch: one zygote; c's import environment differs: its own
    assert got["a"]["ppid"] == got["b"]["ppid"] != got["c"]["ppid"]
    assert len(preimport._ZYGOTES) == 2


def test_idle_zygotes_beyond_the_kept_count_are_stopped_and_a_busy_one_never_is(tmp_path: Path, modules: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each import environment has its own zygote (~0.7 GB with SGLang's stack): when a new
    one is needed, those with no live server are stopped except the most recently used."""
    monkeypatch.setenv(preimport.IDLE_KEEP_ENV, "1")
    busy, _ = server(tmp_path, modules, "busy", fixed={"STANDIN_FIXED": "busy"})
    with busy:
        for name in ("x", "y", "z"):  # one after the other: each leaves its zygote idle
            sp, _ = server(tmp_path, modules, name, fixed={"STANDIN_FIXED": name})
            with sp:
                assert sp.launch == "pre-imported"
        kept = {dict(k[2])["STANDIN_FIXED"] for k in preimport._ZYGOTES}
        # busy still serves; z's start stopped x (y, the newest idle one then, was kept)
        assert kept == {"busy", "y", "z"}, kept
        again, _ = server(tmp_path, modules, "x-again", fixed={"STANDIN_FIXED": "x"})
        with again:
            assert again.launch == "pre-imported"
        assert {dict(k[2])["STANDIN_FIXED"] for k in preimport._ZYGOTES} == {"busy", "z", "x"}
    monkeypatch.setenv(preimport.IDLE_KEEP_ENV, "some")
    bad, _ = server(tmp_path, modules, "bad", fixed={"STANDIN_FIXED": "bad"})
    with pytest.raises(KitError, match="HYBRID_CONFORMANCE_ZYGOTES_IDLE='some': not a count"):
        bad.start()


def test_start_failure_from_a_zygote_names_the_exit_code(tmp_path: Path, modules: Path) -> None:
    sp, _ = server(tmp_path, modules, "dies", argv_tail=("--exit",))
    with pytest.raises(ServerStartError, match=r"exited during start-up with code 3: .*refuses to start|exited during start-up with code 3"):
        sp.start()
    assert sp.launch == "pre-imported"


def test_a_zygote_that_cannot_import_falls_back_to_plain_with_one_line(tmp_path: Path, modules: Path, capsys: pytest.CaptureFixture) -> None:
    sp, dump = server(tmp_path, modules, "fallback", preload=("broken",))
    with sp:
        assert sp.launch == "plain" and json.loads(dump.read_text())["ppid"] != 0
    sp2, _ = server(tmp_path, modules, "fallback2", preload=("broken",))
    with sp2:
        assert sp2.launch == "plain"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "pre-imported launch unavailable" in ln]
    assert len(lines) == 1 and "the stand-in stack cannot import here" in lines[0], lines
    assert "plain launch: " in sp.log_text()


def test_a_command_that_is_not_python_dash_m_is_launched_plainly(tmp_path: Path, modules: Path) -> None:
    port, dump = free_port(), tmp_path / "script.json"
    argv = [sys.executable, str(modules / "envdump.py"), "--port", str(port), "--dump", str(dump)]
    sp = ServerProcess(name="script", argv=argv, env={}, health_url=f"http://127.0.0.1:{port}/", log_path=tmp_path / "script.log",
                       start_timeout_s=60, stop_timeout_s=2.0, preimport_env={})
    with sp:
        assert sp.launch == "plain"
    assert "not a 'python -m <module>' command" in sp.log_text()


def test_the_plain_switch_launches_plainly_without_a_zygote(tmp_path: Path, modules: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(preimport.LAUNCH_ENV, "plain")
    sp, _ = server(tmp_path, modules, "plain")
    with sp:
        assert sp.launch == "plain"
    assert preimport._ZYGOTES == {}


def test_the_zygote_refuses_an_unknown_module_in_one_line(tmp_path: Path, modules: Path) -> None:
    sp, _ = server(tmp_path, modules, "nomod", module="no_such_server_module")
    with pytest.raises(ServerStartError, match="No module named no_such_server_module"):
        sp.start()
    assert sp.launch == "plain" and "no module named 'no_such_server_module'" in sp.log_text(), sp.log_text()


def test_an_unknown_launch_mode_is_one_line_before_anything_starts(tmp_path: Path, modules: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conformance.errors import KitError

    monkeypatch.setenv(preimport.LAUNCH_ENV, "fast")
    sp, dump = server(tmp_path, modules, "badmode")
    with pytest.raises(KitError, match=r"HYBRID_CONFORMANCE_LAUNCH='fast': not one of preimported, preimported-fork, plain"):
        sp.start()
    assert not dump.exists() and preimport._ZYGOTES == {}
