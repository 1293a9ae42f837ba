"""The kit's error type: one clear line naming the cause, never a traceback wall."""

from __future__ import annotations


class KitError(Exception):
    """A user-facing failure (bad input, unreachable or dead server, bad matrix).

    ``str(err)`` is the single line printed to the user.
    """


class ServerStartError(KitError):
    """A server process exited during start-up or never became healthy."""


class PortTakenError(ServerStartError):
    """The port picked for a server was taken by another process before the server bound it."""


class ServerDiedError(KitError):
    """A server process died while a check was talking to it."""
