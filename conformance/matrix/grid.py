"""SGLang's cached-state grid for one (chunk, page size, track interval), computed once.

SGLang 0.5.23 resolves the mamba cache chunk as ``max(model chunk, page size)`` and stores
states on two grids::

    checkpoint_grid = lcm(chunk, page_size)                 # prefill checkpoints
    track_grid      = lcm(checkpoint_grid, track_interval)  # decode tracks

:class:`Grid` is that resolution; the matrix, the prefix oracle, the program judge, the
reference engine and the suites all take their grids from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class _ModelLike(Protocol):
    @property
    def mamba_chunk_size(self) -> int: ...


class _GridCell(Protocol):
    """What :meth:`Grid.of` reads of a matrix cell."""

    @property
    def model(self) -> _ModelLike: ...
    @property
    def page_size(self) -> int: ...
    @property
    def track_interval(self) -> int: ...


@dataclass(frozen=True)
class Grid:
    """The resolved chunk (SGLang's ``mamba_cache_chunk_size``), the page size and the track
    interval, with the two grids they make."""

    chunk: int
    page_size: int
    track_interval: int

    @classmethod
    def resolve(cls, model_chunk: int, page_size: int, track_interval: int) -> Grid:
        """The grid SGLang resolves for a model's chunk size, a page size and a track interval."""
        return cls(max(model_chunk, page_size), page_size, track_interval)

    @classmethod
    def of(cls, cell: _GridCell) -> Grid:
        """The grid of a matrix cell."""
        return cls.resolve(cell.model.mamba_chunk_size, cell.page_size, cell.track_interval)

    @staticmethod
    def refuses(model_chunk: int, page_size: int) -> str | None:
        """Why SGLang refuses a model's chunk size with ``page_size`` (None: it accepts them)."""
        if max(model_chunk, page_size) % min(model_chunk, page_size) == 0:
            return None
        return f"SGLang requires chunk size and page size to divide one another (chunk {model_chunk}, page {page_size})"

    @property
    def checkpoint_grid(self) -> int:
        """Prefill checkpoints land on multiples of this (``lcm(chunk, page_size)``)."""
        return math.lcm(self.chunk, self.page_size)

    @property
    def track_grid(self) -> int:
        """Decode tracks land on multiples of this (SGLang's ``mamba_track_grid``)."""
        return math.lcm(self.checkpoint_grid, self.track_interval)
