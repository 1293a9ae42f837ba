"""Render docs/known-bugs.md from ``fixtures/known_bugs.toml``: a short hand-written header
(what an entry is, its format, what a run does with it) and one section per SGLang bug,
with its variants (the same bug seen by another check or program) beneath it.

``python -m conformance.session.known_bugs_doc > docs/known-bugs.md``; a test keeps the
page in step with the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conformance.session.known_bugs import DEFAULT_FILE, KnownBug, load

HEADER = '''# Known SGLang bugs as expectations

Generated from `fixtures/known_bugs.toml` by `python -m conformance.session.known_bugs_doc`
(edit the file, then regenerate this page).

SGLang can be wrong. When a clean run on real SGLang fails, first decide whether SGLang is
wrong: an answer that differs from the cache-off answer, or a stored prefix not reused when
nothing evicted it, is an SGLang bug unless SGLang's code says it is intended. Such a
finding becomes an entry of `fixtures/known_bugs.toml` -- an **expectation**, never a
relaxed check or an allowed behaviour of the oracle.

```toml
[[bug]]
id = "prefill-cut-drops-checkpoint"      # required: unique slug (a-z, 0-9, '-')
summary = "one line: what SGLang does wrong"
releases = ">=0.5.20,<0.5.24"            # required: PEP 440 range over the installed sglang
check = "programs"                       # required: the check as report.json names it ("leaks" also judges a cell's teardown)
kind = "hit_below_held"                  # required: the finding's kind (conformance/checks/findings.py)
where = { cached_tokens = "<256" }       # optional: constraints on the finding's facts
match = "SGLang held a state of 256"     # optional: a regex that narrows (searched in the finding's line)
replay = "fixtures/known_bugs/prefill-cut-drops-checkpoint.json"  # required: a program file
issue = "https://github.com/sgl-project/sglang/issues/NNNNN"      # optional: the SGLang issue
pr = ""                                  # optional: the fix
cells = ["qwen3-next-80b-extra_buffer-p1-t256"]                   # optional: default every cell
targets = ["sglang-cpu"]                 # optional: default ["sglang-cpu"]; never "reference"
code_path = "python/sglang/srt/mem_cache/unified_radix_cache.py: UnifiedRadixCache.cache_unfinished_req"
seen_as = "request r2: cached_tokens 0: SGLang held a state of 256 tokens for this prompt and reused 0; ..."
measured = ["0.5.20: FAIL, cached_tokens 0", "0.5.24: PASS, 2 hits"]  # "<release>: FAIL|PASS[, what]"
notes = ["facts that place the bug: controls, what the fixing release changes"]
# variant_of = "another-slug"            # optional: the same SGLang bug, seen by another check
# attempts = 6                           # optional: plays of a timing-dependent replay (default 1)
```

Every failing verdict carries its findings (`details.findings` in report.json), one per
failing request, kl sequence, pool or death, each with a **kind** (`conformance/checks/findings.py`:
`answer_differs_on_hit`, `hit_below_held`, `state_not_stored`, `leak_mamba`, `leak_kv`,
`server_died:exception`, ...) and its facts (`cached_tokens`, `scenario`, `pool`,
`exception`, ...). An entry excuses a finding of its `kind` whose facts meet every `where`
constraint (a value, a list of values, or a comparison on a number such as `">0"`; a fact
the finding lacks meets none) and whose line `match`, if given, matches; each finding is
judged on its own, so one excused finding never carries another.

`replay` is a program file `hybrid-conformance replay FILE --target sglang-cpu` plays (the
programs suite writes one for every finding); its `env` holds no seeded fault, and it must
fail with a finding the entry excuses on every release `releases` names (for an entry of
another check, whose replay is a program of the same mechanism: a finding of its kind whose
line `match` matches). The last five fields are the
facts this page shows, all optional: `code_path` (the SGLang file and function that hold
the bug), `seen_as` (the failure line; `match` must match it), `measured` (what each
release showed: a release measured failing lies inside `releases`, one measured passing
outside it), `notes`, and `variant_of` (another entry of the file, not itself a variant).
The first release measured failing and the first measured passing after it are read from
`measured`. A finding that shows only through a PD unit gets an entry when a program on
one server reproduces the same mechanism (`replay` plays a program on one server and its
cache-off twin, not through a prefill server, a decode server and the router); otherwise
it stays out of this file and its cells stay red on the releases it holds for
(`docs/history.md`, "What older releases show").

In a run, a failing verdict whose every finding an entry in range excuses (check, target,
cell, release, kind, `where`, `match`) keeps its status `fail` and its numbers, gains
`details.known_bug` and a reason starting "known SGLang bug, still present"; its test
xfails, so the run stays green on it and red on anything else (a verdict with one finding
no entry excuses stays red, the excused ones listed in `details.known_findings`);
report.json lists it under `known_bugs` (with the entry's first bad / first good release), and
report.md, report.html and the terminal summary list each bug hit once: its bracket, every
failure it explained, its replay, and its bug folder `bugs/ID/` beside the report (written by
`hybrid-conformance run`, as `hybrid-conformance report-bug ID` writes it, `docs/report-bug.md`). A finding is filed under the first entry that
excuses it, in the file's order. In the programs suite a failure every finding of which an
entry excuses does not end the cell's exploration: it is kept, and the cell goes on looking
for anything else within the same budget. Strictness: this command
replays every entry in range and exits 1 when one no longer reproduces (then remove or
narrow the entry):

```bash
hybrid-conformance known-bugs --target sglang-cpu
```

Each entry's program is played on its cell. An entry of a scripted suite's check (kl, leaks,
prefix_branching, gsm8k, agreement, disagg) also has that suite run on its cell with no known
bug excused (`run --cells CELL --suite CHECK`, its report under `--log-dir`): the suite must
fail with the very finding the entry excuses (kind, `where` facts, `match`), or the line
says "no longer reproduces" or "a different finding" and the command is red. `--only ID,...`
replays some entries; `--programs-only` skips the suite runs.

The nightly workflow runs it (job `known-bugs`, `ci/workflows/nightly.yml`) on the SGLang
it checks out; the README's test command replays nothing, it only checks that each entry in
range of the installed release has a replay file that loads and names a cell of the matrix
(`tests/test_known_bugs.py`).

A malformed file is one line naming the entry and the field (`conformance/session/known_bugs.py`).
'''


def missing_facts(bugs: list[KnownBug]) -> list[str]:
    """What the page cannot say about an entry of the repository file: every entry names its
    failure line and at least one release measured failing; a bug (not a variant) names the
    SGLang code that holds it."""
    out = []
    for b in bugs:
        out += [f"{b.id}: {what}" for what, missing in (
            ("no seen_as", not b.seen_as), ("no release measured FAIL", b.first_bad is None),
            ("no code_path", not b.code_path and not b.variant_of)) if missing]
    return out


def _releases(bug: KnownBug) -> str:
    measured = [f"first measured failing: {bug.first_bad}"] if bug.first_bad else []
    if bug.first_good:
        measured.append(f"first measured passing after it: {bug.first_good}")
    elif bug.first_bad and not bug.variant_of:
        measured.append("no release measured passing after it")
    return f"`{bug.releases}`" + (f" ({'; '.join(measured)})" if measured else "")


def section(bug: KnownBug, level: str = "###") -> list[str]:
    """One entry: what SGLang does wrong, where, how it shows, what each release measured."""
    out = [f"{level} `{bug.id}`", "", bug.summary.strip(), ""]
    out += [f"*Releases:* {_releases(bug)}", ""]
    where = ", ".join(f"`{k} {c if isinstance(c, str) and c[:1] in '<>!' else '= ' + repr(c)}`" for k, c in bug.where)
    out += [f"*Check:* `{bug.check}`; *kind:* `{bug.kind}`" + (f" where {where}" if where else "")
            + (f"; *matching:* `{bug.match}`" if bug.match else "") + (f"; *seen as:* `{bug.seen_as}`" if bug.seen_as else ""), ""]
    if bug.code_path:
        out += [f"*SGLang code:* {bug.code_path}", ""]
    for label, link in (("Issue", bug.issue), ("Fix", bug.pr)):
        if link:
            out += [f"*{label}:* {link}", ""]
    if bug.suite_only:
        out += [f"*Replay:* the {bug.check} suite on the entry's cell (it compares SGLang with the kit's reference engine, which no "
                f"program does); `{bug.replay}` carries the cell and its env", ""]
    else:
        out += [f"*Replay:* `{bug.replay}`" + (f" (timing-dependent: played up to {bug.attempts} times on one server; reproduced when one play fails)"
                                              if bug.attempts > 1 else ""), ""]
    if bug.cells:
        out += ["*Cells:* " + ", ".join(f"`{c}`" for c in bug.cells), ""]
    if bug.targets != ("sglang-cpu",):
        out += ["*Targets:* " + ", ".join(f"`{t}`" for t in bug.targets), ""]
    for label, items in (("Measured", [m.line() for m in bug.measured]), ("Notes", list(bug.notes))):
        if items:
            out += [f"*{label}:*", "", *(f"- {x}" for x in items), ""]
    return out


def render(path: str | Path = DEFAULT_FILE) -> str:
    """The page for the known-bugs file at ``path`` (default: the repository's)."""
    bugs = load(path)
    bases = [b for b in bugs if not b.variant_of]
    count = f"{len(bugs)} entries on {len(bases)} SGLang bugs"
    out = [HEADER.rstrip("\n"), "", "## The entries", "",
           f"{count}; the variants of a bug (the same bug seen by another check or program) follow it.", ""]
    for base in bases:
        out += section(base)
        for variant in (b for b in bugs if b.variant_of == base.id):
            out += section(variant, "####")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render())
