"""The tree audit's violations as findings (kind ``tree_structure``), and the refusal of a
run in which no audit ran.  The audit itself runs inside real SGLang
(``conformance/sglang_plugins/tree_audit.py``); its ``tree_violation`` records reach here
through the per-request log (``conformance/programs/evidence.py``).  Pure."""

from __future__ import annotations

from typing import Iterable, Mapping

from conformance.checks.findings import VACUOUS, Finding


def tree_findings(violations: Iterable[Mapping[str, str]]) -> list[Finding]:
    """One ``tree_structure`` finding per violation, naming the rule and the node's path."""
    return [Finding("tree_structure", f"tree audit: rule {v.get('rule')} broken at node {v.get('path') or 'tree'}: {v.get('line')}",
                    {"rule": str(v.get("rule")), "path": str(v.get("path") or "")}) for v in violations]


def audits_vacuous(audits: float | None) -> list[Finding]:
    """A run on a server that audits its tree (``audits`` not None) in which no audit ran
    proves nothing about the tree: a ``vacuous`` finding."""
    if audits is None or audits > 0:
        return []
    return [Finding(VACUOUS, "the tree audit never ran (tree_audits 0): a clean tree would be vacuous")]
