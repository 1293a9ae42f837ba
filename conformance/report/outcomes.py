"""Every outcome of a run as the report sees it, gathered from pytest's test reports.

The controller (also under xdist) feeds each ``TestReport`` to :meth:`Outcomes.add`:

* test counts the way pytest's terminal and junit.xml count them (a passed call is
  ``passed``; a failed call ``failed``; a failed setup or teardown an ``error``; a skip
  in setup or call ``skipped``), so every report format can print the same numbers;
* the verdicts a test filed (``record_verdict``), the launches, the server facts;
* a verdict for every test that filed none: a test that raised or failed in setup is
  an ``error`` (with its one-line cause), a skip a ``skip`` with pytest's reason, a plain
  pass of a cell-bound test (the pool tier) a ``pass``;
* a failed teardown of a cell (pools not idle, a dead server) as its ``teardown`` check;
* which collected tests never reported (an interrupt, ``-x``): their cells did not run.

Tests bound to no cell that fail are kept as ``unbound`` rows. Pure bookkeeping: no I/O.
The ``note_*`` helpers are how fixtures file report facts (launches, the ``server`` block)
as ``user_properties``, which also travel from xdist workers.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from conformance.matrix.cells import CHECKS, Cell
from conformance.targets.registry import target_for

TEST_COUNTS = ("passed", "failed", "skipped", "errors")
#: Teardown failures that are findings about the server, not errors of the kit.
TEARDOWN_FINDINGS = ("pools not idle", "server is not serving", "not serving at teardown")


#: ``/server_info`` keys copied into a cell's ``server`` block.
SERVER_INFO_KEYS = ("version", "engine", "model_path", "served_model_name", "mamba_radix_cache_strategy", "page_size", "mamba_track_interval")
#: Properties for the report of the test whose teardown is running: a session fixture's
#: request points at the test that first asked for it, not the one tearing it down.
TEARDOWN_PROPS: list[tuple[str, str]] = []


def cell_json(cell: Cell, options: Any) -> dict[str, Any]:
    """A cell as report.json shows it: ``Cell.describe()`` plus the model actually served
    (the tiny twin on CPU targets and with ``--twins``)."""
    out = cell.describe()
    served = target_for(options).served_model(cell, options.twins)
    if served is not None:
        out["served_model"] = served
    return out


def cell_of_item(item: Any) -> Cell | None:
    """The matrix cell a collected test is parametrized with (None: none, or no item)."""
    value = getattr(getattr(item, "callspec", None), "params", {}).get("cell")
    return value if isinstance(value, Cell) else None


def item_of(request: Any) -> Any:
    """The test item a (possibly session-scoped) fixture request is being set up for."""
    node = request.node
    return node if hasattr(node, "user_properties") else request._pyfuncitem  # no public accessor


def note_launch(request: Any, cell: Cell, *, kind: str) -> None:
    """Count one server launch for ``cell`` (``kind``: server, pd) in the report."""
    payload = {"uid": uuid.uuid4().hex, "cell": cell.id, "kind": kind}
    item_of(request).user_properties.append(("hc_launch", json.dumps(payload)))


def note_server(request: Any, cell: Cell, info: Any, **facts: Any) -> None:
    """The cell's ``server`` block in report.json: ``version`` and friends from
    ``/server_info`` (``Endpoint.info``) and whatever the serving code knows (``facts``)."""
    block = {k: info[k] for k in SERVER_INFO_KEYS if info.get(k) is not None}
    block.update(facts)
    item_of(request).user_properties.append(("hc_server", json.dumps({"cell": cell.id, **block}, default=str)))


def note_teardown_verdict(cell: Cell, options: Any, verdict: dict[str, Any]) -> None:
    """The cell's ``teardown`` verdict, filed on the test whose teardown closes its server."""
    TEARDOWN_PROPS.append(("hc_verdict", json.dumps({"cell": cell_json(cell, options), "check": "teardown", "verdict": verdict}, default=float)))


def note_server_end(cell: Cell, **facts: Any) -> None:
    """Facts known at the cell's teardown (``alive_at_end``, ...), for the tearing-down test's report."""
    TEARDOWN_PROPS.append(("hc_server", json.dumps({"cell": cell.id, **facts}, default=str)))


def check_of(keywords: Iterable[str], nodeid: str) -> str:
    """The check a test belongs to: ``pool`` for the pool tier, else its check marker,
    else its suite folder (``conformance/<suite>/``), else ``test``."""
    keys = set(keywords)
    if "pool" in keys:
        return "pool"
    for check in CHECKS:
        if check in keys:
            return check
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) >= 2 and parts[-2] in CHECKS:
        return parts[-2]
    return "test"


def one_line(report: Any, limit: int = 300) -> str:
    """The cause of a failed or skipped report in one line."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2])
        return text.removeprefix("Skipped: ")[:limit]
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) if crash is not None else None
    if not text:
        lines = [ln.strip() for ln in str(longrepr or "").splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("E ")]
        text = (errs[-1][1:].strip() if errs else lines[-1]) if lines else "no reason recorded"
    first = text.strip().splitlines()[0] if text.strip() else "no reason recorded"
    first = first.removeprefix("Failed: ")
    return first[:limit]


def cell_of_nodeid(nodeid: str, cell_ids: Iterable[str]) -> str | None:
    """The cell a test id is parametrised with: the longest known cell id inside its
    ``[...]`` whose ends fall on ``-`` separators (ids can prefix each other)."""
    if "[" not in nodeid:
        return None
    params = nodeid[nodeid.index("[") + 1 : nodeid.rindex("]")] if "]" in nodeid else ""
    best = None
    for cid in cell_ids:
        i = params.find(cid)
        while i >= 0:
            end = i + len(cid)
            if (i == 0 or params[i - 1] == "-") and (end == len(params) or params[end] == "-"):
                if best is None or len(cid) > len(best):
                    best = cid
                break
            i = params.find(cid, i + 1)
    return best


def _props(report: Any, key: str) -> list[Any]:
    return [json.loads(v) for k, v in getattr(report, "user_properties", ()) if k == key]


@dataclass
class Outcomes:
    """What the controller has seen of the run so far."""

    tests: Counter = field(default_factory=Counter)
    collected: dict[str, str | None] = field(default_factory=dict)  # nodeid -> cell id
    reported: set[str] = field(default_factory=set)
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell id -> its description
    verdicts: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # cell -> check -> filed
    synthesized: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # cell -> check -> from outcomes
    launches: dict[str, dict[str, Any]] = field(default_factory=dict)  # launch uid -> {cell, kind}
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell id -> server facts
    unbound: list[dict[str, str]] = field(default_factory=list)
    collection_errors: list[dict[str, str]] = field(default_factory=list)
    _seen: set[tuple[str, str]] = field(default_factory=set)

    # -- feeding ------------------------------------------------------------------
    def expect(self, nodeids: Iterable[tuple[str, str | None]]) -> None:
        """The collected tests (after deselection) and their cells."""
        for nodeid, cid in nodeids:
            self.collected.setdefault(nodeid, cid)

    def add_collect_error(self, nodeid: str, reason: str) -> None:
        self.collection_errors.append({"nodeid": nodeid, "reason": reason})

    def add(self, report: Any) -> None:
        when, nodeid = report.when, report.nodeid
        self.reported.add(nodeid)
        self._count(report)
        cells = _props(report, "hc_cell")
        cid = cells[0]["id"] if cells else self.collected.get(nodeid)
        if cells:
            self.cells.setdefault(cid, cells[0])
        for launch in _props(report, "hc_launch"):
            self.launches.setdefault(launch["uid"], {"cell": launch["cell"], "kind": launch.get("kind", "server")})
        for server in _props(report, "hc_server"):
            self.servers.setdefault(server.pop("cell"), {}).update(server)
        filed = self._file_verdicts(report)
        if cid is None:
            if report.failed:
                self.unbound.append({"nodeid": nodeid, "when": when, "reason": one_line(report)})
            return
        check = check_of(getattr(report, "keywords", {}) or {}, nodeid)
        if when == "teardown":
            if report.failed and not self.verdicts.get(cid, {}).get("teardown"):  # else filed with its findings
                reason = one_line(report)
                status = "fail" if any(t in reason for t in TEARDOWN_FINDINGS) else "error"
                self._synth(cid, "teardown", status, reason)
            return
        if report.failed and "fail" not in filed:  # raised (or failed in setup) without a failing verdict
            self._synth(cid, check, "error", f"{'setup' if when == 'setup' else 'test'} {_short(nodeid)}: {one_line(report)}")
        elif filed:
            return
        elif report.skipped:
            self._synth(cid, check, "skip", one_line(report))
        elif when == "call" and report.passed:
            self._synth(cid, check, "pass", "")

    def _count(self, report: Any) -> None:
        if getattr(report, "wasxfail", None) is not None:
            return
        if report.when == "call":
            key = "passed" if report.passed else "failed" if report.failed else "skipped"
        elif report.failed:
            key = "errors"
        elif report.skipped:
            key = "skipped"
        else:
            return
        self.tests[key] += 1

    def _file_verdicts(self, report: Any) -> list[str]:
        """File the verdicts this test recorded (once each); the statuses it recorded."""
        statuses: list[str] = []
        for key, value in getattr(report, "user_properties", ()):
            if key != "hc_verdict":
                continue
            data = json.loads(value)
            if not data.get("cell"):
                continue
            statuses.append(data["verdict"].get("status", ""))
            if (report.nodeid, value) in self._seen:
                continue
            self._seen.add((report.nodeid, value))
            cid = data["cell"]["id"]
            self.cells.setdefault(cid, data["cell"])
            self.verdicts.setdefault(cid, {}).setdefault(data["check"], []).append(data["verdict"])
        return statuses

    def _synth(self, cid: str, check: str, status: str, reason: str) -> None:
        v: dict[str, Any] = {"status": status, "metrics": {}}
        if reason:
            v["reason"] = reason
        self.synthesized.setdefault(cid, {}).setdefault(check, []).append(v)

    # -- reading ------------------------------------------------------------------
    def test_counts(self) -> dict[str, int]:
        return {k: int(self.tests.get(k, 0)) for k in TEST_COUNTS}

    def not_run(self) -> list[str]:
        """Collected tests that never reported (interrupted, stopped early, worker lost)."""
        return [n for n in self.collected if n not in self.reported]

    def cells_not_run(self) -> tuple[list[str], list[str]]:
        """(cells none of whose tests ran, cells some of whose tests did not run)."""
        missing = self.not_run()
        by_cell: dict[str, list[bool]] = {}
        for nodeid, cid in self.collected.items():
            if cid is not None:
                by_cell.setdefault(cid, []).append(nodeid in self.reported)
        none_ran = sorted(c for c, ran in by_cell.items() if not any(ran))
        partly = sorted(c for c, ran in by_cell.items() if any(ran) and not all(ran))
        return none_ran, partly if missing else []


def _short(nodeid: str) -> str:
    name = nodeid.split("::")[-1]
    return name.split("[", 1)[0]
