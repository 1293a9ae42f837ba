"""What a bug folder holds (``hybrid-conformance report-bug``): one :class:`Artefact` record
per file, each rendering its text from one :class:`BugCase`.

``BugCase`` is the known-bugs entry with everything resolved once: its program and cell,
the ``sglang-cpu`` LaunchSpec of that cell (the command and env the kit runs, rendered
as they are into ``server_command.sh``), the ``sglang`` target's arguments for the real
model (``test_regression.py``), and the plan the standalone player plays
(``conformance/commands/bug_plan.py``, ``conformance/commands/repro_player.py``).
"""

from __future__ import annotations

import ast
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from conformance.commands.bug_plan import tolerance
from conformance.matrix.cells import Cell
from conformance.programs.program import Program
from conformance.session.known_bugs import KnownBug, Measurement
from conformance.targets.base import LaunchSpec

#: The standalone player the scripts carry (read as text: the kit itself never imports ``requests``).
PLAYER = Path(__file__).with_name("repro_player.py")
#: The port the folder's commands default to (SGLang's own default).
PORT = 30000
#: Flags ``popen_launch_server`` passes itself (the model, where to listen).
LAUNCHER_FLAGS = ("--model-path", "--host", "--port")


@dataclass(frozen=True)
class BugCase:
    """One known-bugs entry, resolved for its folder."""

    bug: KnownBug
    program: Program
    cell: Cell
    release: str  # the SGLang release the command was generated against
    spec: LaunchSpec  # sglang-cpu, on PORT
    gpu_args: tuple[str, ...]  # the sglang target's server args for the real model
    gpu_env: dict[str, str]
    plan: dict[str, Any]  # exact mode (sglang-cpu, float32)

    @property
    def gpu_plan(self) -> dict[str, Any]:
        """The same plan judged as the kit judges a GPU server (greedy within a tie, no exact logprobs)."""
        return {**self.plan, "tolerance": tolerance(False)}

    @property
    def judged(self) -> str:
        """What the player judges, in one sentence."""
        hits = [s["rid"] for s in self.plan["steps"] if s.get("hit") is not None]
        parts = ["every answer against the cache-off answer of the same input + output (token, argmax, logprob)"]
        if hits:
            parts.append(f"cached_tokens of {', '.join(hits)} against the prefix oracle")
        parts.append("the pools at idle and that the server stays alive")
        return "; ".join(parts)


def _measured(m: Measurement) -> str:
    return f"- {m.release}: {'FAIL' if m.failed else 'PASS'}" + (f", {m.what}" if m.what else "")


def readme(case: BugCase) -> str:
    b = case.bug
    bad, good = b.first_bad or "not measured", b.first_good or "none measured (still present on every release measured)"
    links = [f"issue {b.issue}" if b.issue else "", f"PR {b.pr}" if b.pr else ""]
    lines = [
        f"# SGLang bug: {b.id}", "",
        b.summary, "",
        f"- **Releases:** `{b.releases}`; first bad **{bad}**, first good **{good}** (from the measured lines below)",
        f"- **Code path:** {b.code_path or 'not named'}",
        f"- **Upstream:** {', '.join(x for x in links if x) or 'no issue or PR named'}",
        f"- **Server:** `{case.cell.model.hf_path}` with `{shlex.join(case.gpu_args)}` (the kit's cell `{case.cell.id}`)",
    ]
    if b.variant_of:
        lines.append(f"- **Variant of:** `{b.variant_of}` (the same SGLang bug, seen by the {b.check} check)")
    lines += ["", "## What you see", "", f"`{b.seen_as or b.match}`", "", "Measured, per release:", "",
              *(_measured(m) for m in sorted(b.measured, key=lambda m: m.version)), ""]
    if b.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in b.notes), ""]
    lines += [
        "## Reproduce on CPU (no GPU)", "",
        f"1. `bash server_command.sh`: SGLang's own server on CPU serving the tiny twin of {case.cell.model.id}, "
        f"exactly as hybrid-conformance starts cell `{case.cell.id}` (generated against sglang {case.release}; "
        "`PYTHON=<venv>/bin/python` runs another release, `PORT=` another port).",
        f"2. `python3 repro.py --url http://127.0.0.1:{PORT}`: replays the request sequence and prints, per judged request, "
        "the expected and the observed numbers; exit 1 while the bug is present. It judges "
        f"{case.judged}. `--cold-url` takes the cache-off answers from a `--disable-radix-cache` server instead.",
        "",
        f"With the kit, one command: `hybrid-conformance replay {b.replay} --target sglang-cpu`.",
        "",
        "## Regression test (GPU, real model)", "",
        f"`test_regression.py` is a unittest in SGLang's test style (`popen_launch_server`, `CustomTestCase`): it launches "
        f"`{case.cell.model.hf_path}` with the same server arguments and asserts the same numbers. Drop it into `test/` and run "
        "`python3 -m pytest test_regression.py` on a GPU machine.", "",
    ]
    return "\n".join(lines)


def server_command(case: BugCase) -> str:
    argv = list(case.spec.argv)
    argv = ['"$PYTHON"', *(shlex.quote(a) for a in argv[1:])]
    port = argv.index("--port") + 1
    argv[port] = '"$PORT"'
    lines = [
        "#!/usr/bin/env bash",
        f"# {case.bug.id}: the sglang-cpu server of cell {case.cell.id}, exactly as hybrid-conformance launches it",
        f"# (conformance/targets/sglang_cpu.py, its LaunchSpec), generated against sglang {case.release}.",
        "# SGLang runs on CPU through the kit's plugins (SGLANG_PLUGINS / SGLANG_PLATFORM, importable from PYTHONPATH).",
        "# PYTHON: the interpreter of the SGLang release to run; PORT: where it listens.",
        "set -euo pipefail",
        f"PYTHON=\"${{PYTHON:-{case.spec.argv[0]}}}\"",
        f"PORT=\"${{PORT:-{case.spec.port}}}\"",
        *(f"export {k}={shlex.quote(v)}" for k, v in case.spec.env.items()),
        "exec " + " \\\n  ".join(_pairs(argv)),
    ]
    return "\n".join(lines) + "\n"


def _pairs(argv: list[str]) -> list[str]:
    """The command's words, a flag and its value on one line (the interpreter with its ``-m``)."""
    out: list[str] = []
    for a in argv:
        if out and (out[-1].startswith("-") and " " not in out[-1] or len(out) == 1) and not a.startswith("--"):
            out[-1] += " " + a
        else:
            out.append(a)
    return out


def player_code() -> str:
    """The player module's code without its docstring (the generated file has its own)."""
    text = PLAYER.read_text()
    body = ast.parse(text).body[0]
    return "\n".join(text.splitlines()[body.end_lineno :]).lstrip("\n")


def plan_text(plan: dict[str, Any]) -> str:
    """The plan as a raw JSON literal, one step a line."""
    items = []
    for key, value in plan.items():
        if key == "steps":
            items.append(' "steps": [\n' + ",\n".join("  " + json.dumps(s) for s in value) + "\n ]")
        else:
            items.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return 'json.loads(r"""{\n' + ",\n".join(items) + '\n}""")'


def repro(case: BugCase) -> str:
    b = case.bug
    doc = [
        '#!/usr/bin/env python3',
        f'"""{b.id}: replay its request sequence against a running SGLang server.',
        "",
        f"Generated by `hybrid-conformance report-bug {b.id}` from {b.replay} (cell {case.cell.id}).",
        f"Start the server (`bash server_command.sh`), then `python3 repro.py --url http://127.0.0.1:{PORT}`: for each",
        "judged request it prints the expected and the observed numbers; exit 1 when they differ.",
        "Needs only `requests`.",
        '"""',
    ]
    return "\n".join(doc) + "\n\n" + player_code() + f"\n\nPLAN = {plan_text(case.plan)}\n\n\nif __name__ == \"__main__\":\n    raise SystemExit(main(PLAN))\n"


def _class_name(bug_id: str) -> str:
    return "Test" + "".join(w.capitalize() for w in bug_id.split("-"))


def regression_test(case: BugCase) -> str:
    b, m = case.bug, case.cell.model
    doc = [
        f'"""Regression test for an SGLang bug found by hybrid-conformance: {b.id}.',
        "",
        *_wrap(b.summary),
        "",
        *_wrap(f"Launches {m.hf_path} (tp {m.tp_size}) with the server arguments of the kit's cell {case.cell.id} and plays "
               f"the request sequence of {b.replay}; fails while the bug is present. Judged: {case.judged}."),
        "",
        "    python3 -m pytest test_regression.py",
        '"""',
        "",
        "import unittest",
        "",
        "from sglang.srt.utils import kill_process_tree",
        "from sglang.test.test_utils import (",
        "    DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,",
        "    DEFAULT_URL_FOR_TEST,",
        "    CustomTestCase,",
        "    popen_launch_server,",
        ")",
    ]
    test = [
        f"MODEL = {json.dumps(m.hf_path)}",
        f"OTHER_ARGS = {json.dumps(list(case.gpu_args))}",
        f"ENV = {json.dumps(case.gpu_env)}",
        f"PLAN = {plan_text(case.gpu_plan)}",
        "",
        "",
        f"class {_class_name(b.id)}(CustomTestCase):",
        "    @classmethod",
        "    def setUpClass(cls):",
        "        cls.base_url = DEFAULT_URL_FOR_TEST",
        "        cls.process = popen_launch_server(",
        "            MODEL, cls.base_url, timeout=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH, other_args=OTHER_ARGS, env=ENV",
        "        )",
        "",
        "    @classmethod",
        "    def tearDownClass(cls):",
        "        kill_process_tree(cls.process.pid)",
        "",
        f"    def test_{b.check}_same_as_without_cache(self):",
        "        findings = Player(self.base_url, PLAN).run()",
        "        wrong = [f.line() for f in findings if not f.ok]",
        '        self.assertEqual(wrong, [], "\\n".join(wrong))',
        "",
        "",
        'if __name__ == "__main__":',
        "    unittest.main()",
    ]
    return "\n".join(doc) + "\n" + player_code() + "\n\n" + "\n".join(test) + "\n"


def _wrap(text: str, width: int = 92) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


@dataclass(frozen=True)
class Artefact:
    """One file of a bug folder: its name, what it is for, how its text is made."""

    name: str
    what: str
    render: Callable[[BugCase], str]
    executable: bool = False

    def write(self, case: BugCase, folder: Path) -> Path:
        path = folder / self.name
        path.write_text(self.render(case))
        if self.executable:
            path.chmod(0o755)
        return path


ARTEFACTS = (
    Artefact("README.md", "one page in SGLang's terms: what goes wrong, the code path, the releases, how to reproduce", readme),
    Artefact("server_command.sh", "the exact sglang-cpu launch command and env of the entry's cell (its LaunchSpec)", server_command, True),
    Artefact("repro.py", "the request sequence, standalone (requests only): expected vs observed numbers, exit 1 when they differ", repro, True),
    Artefact("test_regression.py", "a unittest in SGLang's test style that launches the real model with the same server args", regression_test),
)
