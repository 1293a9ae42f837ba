"""``history.html``: the release x check grid of ``hybrid-conformance history``, for a person.

One row per check, one column per release; a cell is pass / FAIL / n/a (folded over the
matrix cells by :func:`fold`, with how many cells each status had); every FAIL
and n/a is listed under the grid with its cell and reason, and a FAIL with a replay file
links to it (relative to the page, so the folder can be uploaded as it is).  The known
SGLang bugs the FAILs were matched to (the document's ``known_bugs``) are listed under the
grid with their bracket and rows, each linking its bug folder (``bugs/ID/README.md``), which
a FAIL's "known bug" link opens too.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from conformance.report.known_bugs import BugHit, history_hits

STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#eee}
.pass{background:#d4f7d4}.fail{background:#f7c6c6;font-weight:bold}.na{background:#eee;color:#666}
li{font-size:13px;margin:2px 0}"""
MARK = {"pass": "pass", "fail": "FAIL", "na": "n/a"}


def fold(rows: Sequence) -> dict[tuple[str, str], tuple[str, list]]:
    """(release, check) -> (status, its rows): a check of several cells is FAIL when any cell
    failed, pass when any passed and none failed, n/a only when every cell was n/a."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.release, r.check), []).append(r)
    out = {}
    for key, group in groups.items():
        statuses = {r.status for r in group}
        out[key] = ("fail" if "fail" in statuses else "pass" if "pass" in statuses else "na", group)
    return out


def _link(path: str, base: Path | None) -> str:
    target = os.path.relpath(path, base) if base is not None and os.path.isabs(path) else path
    return f'<a href="{html.escape(target)}">replay</a>'


def _bug(row, folders: Mapping[str, str]) -> str:
    """A FAIL's link to its known bug: the bug folder, else the entry in known-bugs.md."""
    bug = getattr(row, "known_bug", "")
    href = folders.get(bug) or f"known-bugs.md#{bug}"
    return f' <a href="{html.escape(href)}">known bug {html.escape(bug)}</a>' if bug else ""


def _bug_name(hit: BugHit) -> str:
    name = f"<code>{html.escape(hit.id)}</code>"
    return f'<a href="{html.escape(hit.folder)}">{name}</a>' if hit.written else f"{name} (bug folder not written)"


def _bugs_hit(hits: Sequence[BugHit]) -> str:
    """The known SGLang bugs the FAILs were matched to: bracket, rows, bug folder."""
    items = "".join(f"<li class='fail'>{_bug_name(h)}: {html.escape(h.summary)} ({html.escape(h.bracket)}); "
                    f"explained {len(h.where)} FAIL row(s): {html.escape(', '.join(h.where))}</li>" for h in hits)
    return f"<h2>known SGLang bugs hit</h2><ul>{items or '<li>none</li>'}</ul>"


def _cells_grid(rows: Sequence, releases: Sequence[str], base: Path | None, folders: Mapping[str, str]) -> str:
    """Release x check x cell: one row per (check, cell) of the server rows."""
    by = {(r.check, r.cell, r.release): r for r in rows if r.cell}
    keys = sorted({(c, cell) for c, cell, _ in by})
    body = []
    for check, cell in keys:
        tds = []
        for rel in releases:
            r = by.get((check, cell, rel))
            if r is None:
                tds.append("<td>-</td>")
                continue
            link = f" {_link(r.replay, base)}" if r.status == "fail" and r.replay else ""
            tds.append(f'<td class="{r.status}" title="{html.escape(r.reason[:500])}">{MARK[r.status]}{link}{_bug(r, folders) if r.status == "fail" else ""}</td>')
        body.append(f"<tr><th style='text-align:left'>{html.escape(check)}</th><td>{html.escape(cell)}</td>{''.join(tds)}</tr>")
    head = "".join(f"<th>{html.escape(r)}</th>" for r in releases)
    return f"<h2>releases x checks x cells</h2><table><tr><th>check</th><th>cell</th>{head}</tr>{''.join(body)}</table>" if body else ""


def _night(extra: Mapping, base: Path | None) -> str:
    """A merged night's sections: its shards, what is new since the last night, the leads,
    where shards disagreed."""
    out = []
    if "shards" in extra:
        items = "".join(f"<li>shard {html.escape(str(s.get('index', '?')))}/{html.escape(str(s.get('of', '?')))}: planned "
                        f"{s.get('planned_minutes', '?')} min, ran {s.get('wall_minutes', '?')} min ({html.escape(s.get('folder', ''))})</li>"
                        for s in extra["shards"])
        out.append(f"<h2>shards</h2><ul>{items or '<li>none</li>'}</ul>")
    if extra.get("left_out"):
        items = "".join(f"<li>{html.escape(x['cell'])}: {html.escape(x['why'])}</li>" for x in extra["left_out"])
        out.append(f"<h2>cells the night left out</h2><ul>{items}</ul>")
    if "new_since_last_night" in extra:
        new = extra["new_since_last_night"]
        items = "none" if new == [] else "no previous night" if new is None else "".join(
            f"<li class='fail'>{html.escape(n['release'])} {html.escape(n['check'])} [{html.escape(n['cell'])}]: {html.escape(n['reason'])}</li>" for n in new)
        out.append(f"<h2>new since the last night</h2><ul>{items}</ul>")
    if "leads" in extra:
        items = "".join(f"<li>{html.escape(x['release'])} [{html.escape(x['cell'])}]: {html.escape(x['reason'][:300])} {_link(x['replay'], base) if x['replay'] else ''}</li>"
                        for x in extra["leads"]) + "".join(f"<li>open in fixtures/leads: {html.escape(n)}</li>" for n in extra.get("open_leads", []))
        out.append(f"<h2>leads (programs' FAILs not yet judged)</h2><ul>{items or '<li>none</li>'}</ul>")
    if extra.get("disagreements"):
        items = "".join(f"<li>{html.escape(d['release'])} {html.escape(d['check'])} [{html.escape(d['cell'])}]: {html.escape(json.dumps(d['statuses']))}</li>"
                        for d in extra["disagreements"])
        out.append(f"<h2>shards that disagree (the FAIL is kept)</h2><ul>{items}</ul>")
    if extra.get("superseded"):
        items = "".join(f"<li>{html.escape(d['release'])} {html.escape(d['check'])} [{html.escape(d['cell'])}]: {html.escape(d['status'])} "
                        f"with kit {html.escape(d['kit'] or 'unrecorded')} ({html.escape(d['folder'])}), run again by kit {html.escape(d['by'])}</li>"
                        for d in extra["superseded"])
        out.append(f"<h2>rows a newer kit ran again (its row is kept)</h2><ul>{items}</ul>")
    return "".join(out)


def render_html(rows: Sequence, releases: Sequence[str], probes: Mapping[str, str], *, base: Path | None = None, extra: Mapping | None = None) -> str:
    folded = fold(rows)
    hits = history_hits(extra or {})
    folders = {h.id: h.folder for h in hits if h.written}
    checks = list(dict.fromkeys(r.check for r in rows))
    head = "".join(f"<th>{html.escape(r)}</th>" for r in releases)
    body = []
    for check in checks:
        tds = []
        for rel in releases:
            got = folded.get((rel, check))
            if got is None:
                tds.append("<td>-</td>")
                continue
            status, group = got
            cells = [r for r in group if r.cell]
            count = f" ({sum(1 for r in cells if r.status == status)}/{len(cells)})" if cells else ""
            first = next((r for r in group if r.status == "fail" and r.replay), None)
            link = f" {_link(first.replay, base)}" if first else ""
            title = html.escape("; ".join(f"{r.cell or r.check}: {r.status} {r.reason}" for r in group)[:1500])
            tds.append(f'<td class="{status}" title="{title}">{MARK[status]}{count}{link}</td>')
        body.append(f"<tr><th style='text-align:left'>{html.escape(check)}</th>{''.join(tds)}</tr>")
    notes = []
    for r in rows:
        if r.status == "pass":
            continue
        where = f" [{html.escape(r.cell)}]" if r.cell else ""
        link = f" {_link(r.replay, base)}" if r.replay else ""
        bug = _bug(r, folders) if r.status == "fail" else ""
        notes.append(f"<li class='{r.status}'>{html.escape(r.release)} {html.escape(r.check)}{where}: {MARK[r.status]}: {html.escape(r.reason)}{link}{bug}</li>")
    probe_lines = "".join(f"<li>{html.escape(line)}</li>" for line in probes.values())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>hybrid-conformance history</title><style>{STYLE}</style></head><body>"
            f"<h1>SGLang releases x checks</h1><table><tr><th>check</th>{head}</tr>{''.join(body)}</table>"
            f"{_bugs_hit(hits) if 'known_bugs' in (extra or {}) else ''}{_night(extra or {}, base)}{_cells_grid(rows, releases, base, folders)}<h2>FAIL and n/a</h2><ul>{''.join(notes) or '<li>none</li>'}</ul><h2>feature probes</h2><ul>{probe_lines}</ul></body></html>")
