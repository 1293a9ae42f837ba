"""Issue 43: reuse efficiency, reported and not judged (``conformance/checks/reuse.py``).

Per request whose owed hit SGLang's per-node records give exactly: the KV tokens the tree
held for its prompt, the hit SGLang's storage rule allows, the hit it returned; per cell
their sums and counts in the programs verdict's ``details.reuse`` and in report.md/html.
The numbers below are worked out by hand from the recorded responses and per-node records,
not by the kit's functions.  No server."""

from __future__ import annotations

from pathlib import Path

from conformance.checks.reuse import Reuse, ReuseTally
from conformance.programs.explore import Exploration
from conformance.programs.runner import RunStats
from conformance.report.html import render_html
from conformance.report.markdown import render_markdown
from conformance.report.schema import build_report
from conformance.suites.programs.test_programs import programs_verdict

from test_oracle_held import T, _book, _judge, _prefill, _served, stored

CELL = "qwen3-next-80b-extra_buffer-p1-t256"
P = T[:300]  # r0's prompt
OTHER = tuple(range(3000, 3040))  # a prompt sharing nothing with P, shorter than the chunk: no checkpoint


def recorded(tmp_path: Path) -> list:
    """Six requests answered one at a time (chunk 64, page 1, track 256, extra_buffer):

    * r0: P (300 tokens), output (1, 2); SGLang's tree took a state of 256 tokens.
    * a: P again, returned 256.  KV held: all 300 of P (r0's P + 1 is in the tree); the
      rule allows 256 (the state held; the match leaves one token to compute: 299).
    * b: P[:280] + 20 others, returned 0.  KV held 280, the rule allows 256 (a
      ``hit_below_held`` finding besides, which the report does not count).
    * c: OTHER (40 tokens, below the 64 chunk: no checkpoint), returned 0: nothing shared,
      nothing allowed.
    * e: OTHER again, returned 0; no state was taken for it (none is owed): KV held 40, the
      rule allows 0 (the "0 hit on an identical prompt" case).
    * d: r0's P + (1, 2) + (5, 5, 5) (305 tokens), returned 256.  KV held 301 (r0's P + its
      output but the last token, which has no KV), the rule allows 256.
    """
    a, b = _served("a", P, (1, 2), 256, 3, 4), _served("b", P[:280] + (9,) * 20, (1, 2), 0, 5, 6)
    c, e = _served("c", OTHER, (1, 2), 0, 7, 8), _served("e", OTHER, (1, 2), 0, 9, 10)
    d = _served("d", P + (1, 2, 5, 5, 5), (1, 2), 256, 11, 12)
    r0 = _served("r0", P, (1, 2), 0, 1, 2)
    records = [_prefill("r0", 300, 256), stored(P[:256]), _prefill("a", 44, 256, prefix=256), _prefill("b", 300, 256),
               _prefill("c", 40, None), _prefill("e", 40, None), _prefill("d", 49, 256, prefix=256)]
    served = [r0, a, b, c, e, d]
    problems = _judge(_book(tmp_path, records), *served)
    assert [p.kind if p else None for p in problems] == [None, None, "hit_below_held", None, None, None]  # b's finding, as before
    return served


#: The sums and counts, by hand from the docstring above.
EXPECTED = {"requests": 6, "kv_held": 0 + 300 + 280 + 0 + 40 + 301, "rule_allows": 0 + 256 + 256 + 0 + 0 + 256,
            "returned": 0 + 256 + 0 + 0 + 0 + 256, "kv_beyond_rule": 4,  # a, b, e, d
            "kv_held_none_allowed": 1,  # e
            "returned_below_rule": 1,  # b
            "kv_at_most": 0, "left_out": 0}


def test_each_request_reports_what_the_tree_held_what_the_rule_allows_and_what_it_returned(tmp_path: Path) -> None:
    served = recorded(tmp_path)
    assert [(s.rid, s.reuse.kv_held, s.reuse.rule_allows, s.reuse.returned) for s in served] == [
        ("r0", 0, 0, 0), ("a", 300, 256, 256), ("b", 280, 256, 0), ("c", 0, 0, 0), ("e", 40, 0, 0), ("d", 301, 256, 256)]
    stats = RunStats()
    for s in served:
        stats.note_hit(s)
    assert stats.reuse.to_json() == EXPECTED


def test_the_verdict_and_the_report_carry_it_and_judge_nothing_by_it(tmp_path: Path) -> None:
    """In ``details.reuse`` of the programs verdict (the cell's existing details: extended,
    nothing renamed) and in report.md/html; the verdict passes with the rule allowing less
    than the tree held (the rule's cost is no finding)."""
    stats = RunStats(requests=6, compared_tokens=12)
    for s in recorded(tmp_path):
        s.judged = True
        stats.note_hit(s)
    v = programs_verdict(Exploration(examples=1, stats=[stats]), budget="premerge", seed=0)
    assert v.status == "pass" and v.details["reuse"] == EXPECTED
    assert {"budget", "expected_hit"} <= set(v.details)
    report = build_report("sglang-cpu", 1, 1.0, [{"id": CELL, "checks": {"programs": v}}])
    md = render_markdown(report)
    assert "## Reuse efficiency" in md
    assert f"| `{CELL}` | programs | 6 | 921 | 768 | 512 | 4 (1) | 1 | 0 | 0 |".replace("`", "") in md.replace("`", "")
    html = render_html(report, [], tmp_path)
    assert "<h2>Reuse efficiency</h2>" in html and "<td>921</td><td>768</td><td>512</td>" in html


def test_bounded_requests_are_left_out_and_a_report_without_it_has_no_section(tmp_path: Path) -> None:
    """A request whose owed hit was only bounded (no per-node records: the reference engine)
    is counted as left out, never summed; reports of other checks show no section."""
    tally = ReuseTally()
    tally.note(None)
    assert tally.to_json() == {**{k: 0 for k in EXPECTED}, "left_out": 1}
    assert ReuseTally.from_json(tally.to_json()) == tally
    assert ReuseTally.total([tally, tally]).left_out == 2
    report = build_report("reference", 1, 1.0, [{"id": CELL, "checks": {"programs": programs_verdict(
        Exploration(examples=1, stats=[RunStats(requests=1, compared_tokens=1)]), budget="ci", seed=0)}}])
    assert "## Reuse efficiency" in render_markdown(report)  # the cell's tally: nothing exact, 0 counted
    bare = build_report("reference", 1, 1.0, [{"id": CELL, "checks": {}}])
    assert "Reuse efficiency" not in render_markdown(bare) and "Reuse efficiency" not in render_html(bare, [], tmp_path)


def test_a_kv_figure_after_an_eviction_walk_is_an_upper_bound(tmp_path: Path) -> None:
    """SGLang's eviction walk ran between r0's prefill and a's admission: the KV r0 left may
    be gone, so a's 300 is "at most" (its state of 256 was not freed: the rule still allows it)."""
    r0, a = _served("r0", P, (1, 2), 0, 1, 2), _served("a", P, (1, 2), 256, 3, 4)
    records = [_prefill("r0", 300, 256), stored(P[:256]), {"ev": "evict", "num_tokens_evicted": 64}, _prefill("a", 44, 256, prefix=256)]
    assert _judge(_book(tmp_path, records), r0, a) == [None, None]
    assert a.reuse == Reuse(300, 256, 256, kv_at_most=True) and not r0.reuse.kv_at_most
