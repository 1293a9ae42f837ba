"""Recordings shared between the cells of a run, one JSON file per (kind, cell).

Used where a check compares a cell with a sibling cell of the same model: the lazy
resident track slots (extra_buffer_lazy vs extra_buffer under the same burst) and GSM8K
agreement or paired tests (a strategy vs its paired baseline cell). The folder is the run's report
directory, or a temp folder shared by the xdist workers of the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from conformance.recordings import OccupancySample
from conformance.matrix.cells import Cell


def sibling_key(cell: Cell, strategy: str, fault: str = "none") -> str:
    return f"{cell.model.id}-{strategy}-p{cell.page_size}-t{cell.track_interval}-{fault}"


@dataclass(frozen=True)
class CellStore:
    root: Path

    def save(self, kind: str, cell: Cell, payload: Any) -> Path:
        folder = self.root / kind
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{sibling_key(cell, cell.strategy.name, cell.fault.name)}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)
        return path

    def load(self, kind: str, key: str) -> Any | None:
        path = self.root / kind / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    # -- occupancy timelines ------------------------------------------------------
    def save_timeline(self, cell: Cell, timeline: Sequence[OccupancySample]) -> Path:
        return self.save("occupancy", cell, [[s.t_s, dict(s.values)] for s in timeline])
