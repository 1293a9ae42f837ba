"""The reuse-efficiency table of report.md and report.html: per cell and check whose verdict
carries ``details.reuse`` (``conformance.checks.reuse``), the KV tokens SGLang's tree held for
the prompts, the hits its storage rule allowed and the hits it returned.  Reported, never
judged: no status comes from it."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from conformance.checks.reuse import ReuseTally

#: What the section says above its table.
NOTE = ("Reported, not judged: per cell, the KV tokens SGLang's tree held for the prompts, the hits its storage rule "
        "allows (its mamba states held at each admission) and the cached_tokens it returned, over the requests whose "
        "owed hit its per-node records gave exactly.")
HEAD = ["cell", "check", "requests", "KV held", "rule allows", "returned", "KV beyond the rule (none allowed)",
        "returned below the rule", "KV at most", "left out"]


def reuse_rows(cells: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Table rows, the head first; empty when no verdict carries ``details.reuse``."""
    rows = [HEAD]
    for cell in cells:
        for name, verdict in (cell.get("checks") or {}).items():
            raw = (verdict.get("details") or {}).get("reuse")
            if not isinstance(raw, Mapping):
                continue
            t = ReuseTally.from_json(raw)
            rows.append([str(cell["id"]), name, str(t.requests), str(t.kv_held), str(t.rule_allows), str(t.returned),
                         f"{t.kv_beyond_rule} ({t.kv_held_none_allowed})", str(t.returned_below_rule), str(t.kv_at_most), str(t.left_out)])
    return rows if len(rows) > 1 else []
