"""Typed errors of serving: the server, its ports, its repository and its answers."""
from __future__ import annotations

from workbench.core.errors import DependencyMissingError, WorkbenchError


class TritonNotFoundError(DependencyMissingError):
    """No tritonserver binary could be found."""


class ServerStartError(WorkbenchError):
    """The server did not become ready; the message carries its log."""


class PortInUseError(WorkbenchError):
    """A port the server should bind is taken."""


class ServedError(WorkbenchError):
    """The server answered a request with an error."""


class RepositoryError(WorkbenchError):
    """A model repository cannot be written or is not valid."""


class ServerUnreachableError(ServedError):
    """A request never got an answer: connection refused, the server closed the connection, or it timed out."""
