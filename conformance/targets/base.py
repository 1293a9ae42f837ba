"""What a server target hands to a suite: a running endpoint for one cell."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from conformance.matrix.cells import Cell

if TYPE_CHECKING:  # annotations only: a launch spec's makers need neither httpx nor the launcher
    from conformance.client import SGLangClient
    from conformance.targets.launcher import ServerProcess


@dataclass
class LaunchSpec:
    """The exact command and environment that start one cell's server."""

    argv: list[str]
    env: dict[str, str]
    port: int
    host: str = "127.0.0.1"
    health_path: str = "/health"
    start_timeout_s: float = 120.0
    entry: str | None = None  # "module:function" to fork from the preloaded forkserver
    entry_argv: list[str] = field(default_factory=list)
    preload: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()  # kit plugins that must prove they ran inside the server
    preimport: bool = False  # may be forked from a pre-imported launcher (conformance.targets.preimport)
    term_grace_s: float = 10.0  # how long the server may take to exit on SIGTERM before the kit SIGKILLs its group

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Endpoint:
    """A healthy server for one cell, shared by every check of that cell."""

    cell: Cell
    target: str
    base_url: str
    client: SGLangClient
    process: ServerProcess | None = None
    info: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process else None

    def log_text(self) -> str:
        return self.process.log_text() if self.process else ""

    @property
    def pid(self) -> int | None:
        """The server's process id (None for a server the kit did not start)."""
        return self.process.pid if self.process else None

    def alive(self) -> bool:
        return self.process.alive() if self.process else True


class ServerTarget(Protocol):
    """A target that can serve a cell over SGLang's HTTP API."""

    name: str

    def supports(self, cell: Cell) -> str | None:
        """None if the cell can be served, else the reason it cannot (recorded as n/a)."""

    def launch_spec(self, cell: Cell, *, port: int, gpus: list[int] | None = None) -> LaunchSpec:
        """The command and env for the cell (launching nothing)."""
