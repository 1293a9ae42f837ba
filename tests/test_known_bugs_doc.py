"""docs/known-bugs.md is generated from fixtures/known_bugs.toml
(``conformance/session/known_bugs_doc.py``) and must stay in step with it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conformance.session.known_bugs import DEFAULT_FILE, load
from conformance.session.known_bugs_doc import HEADER, missing_facts, render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "known-bugs.md"
REGENERATE = "regenerate: python -m conformance.session.known_bugs_doc > docs/known-bugs.md"


def test_the_page_is_current() -> None:
    assert DOC.read_text() == render(), REGENERATE


def test_a_changed_file_leaves_the_page_stale(tmp_path: Path) -> None:
    """The check above fails when the TOML changes and the page is not regenerated."""
    changed = tmp_path / "known_bugs.toml"
    changed.write_text(DEFAULT_FILE.read_text().replace('"0.5.13: PASS",', '"0.5.13: PASS, seeded",', 1))
    page = render(changed)
    assert "- 0.5.13: PASS, seeded" in page and page != DOC.read_text()


def test_the_command_prints_the_page() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-m", "conformance.session.known_bugs_doc"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout == DOC.read_text(), out.stderr[-2000:]


def test_every_entry_states_its_facts_and_has_a_section() -> None:
    bugs = load(DEFAULT_FILE)
    assert missing_facts(bugs) == []
    text = DOC.read_text()
    for b in bugs:
        assert re.search(rf"^#{{3,4}} `{re.escape(b.id)}`$", text, re.MULTILINE), b.id
    # not vacuous: an entry without its facts is named
    bare = dataclasses.replace(bugs[0], seen_as="", measured=(), code_path="")
    assert missing_facts([bare]) == [f"{bare.id}: no seen_as", f"{bare.id}: no release measured FAIL", f"{bare.id}: no code_path"]
    assert missing_facts([dataclasses.replace(bare, variant_of=bugs[0].id)])[-1] != f"{bare.id}: no code_path"


def test_the_format_example_on_the_page_loads(tmp_path: Path) -> None:
    """The header's example entry obeys the rules it states."""
    example = HEADER.split("```toml\n")[1].split("```")[0]
    (tmp_path / "bug.json").write_text(json.dumps({"version": 1, "forest": [], "steps": [], "cell": {"id": "x"}}))
    path = tmp_path / "known_bugs.toml"
    path.write_text(re.sub(r'^replay = "[^"]*"', f'replay = "{tmp_path / "bug.json"}"', example, flags=re.MULTILINE))
    (bug,) = load(path)
    assert bug.matches(bug.seen_as) and (bug.first_bad, bug.first_good) == ("0.5.20", "0.5.24")
