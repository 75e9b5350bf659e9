"""The exceptions phyrt raises.

Leaf module: imports nothing from the project and nothing beyond the standard
library, so that the torch-free client can share these types.

    PhyrtError
    ├── EngineUnavailableError   the backend can no longer serve (closed, a rank died,
    │   │                        a hard timeout fired); re-create the engine
    │   └── WorkerStartupError   a rank failed before it reported ready
    ├── ProtocolError            a message or tensor descriptor failed validation
    ├── RequestMismatchError     the ranks of an external engine got different requests
    └── RemoteError              a plugin error raised inside a managed rank, carried
                                 back as data (type name, message, traceback text)

Request-local failures on the inline and external executors are *not* wrapped:
the caller sees the plugin's own exception type.
"""

from __future__ import annotations


class PhyrtError(Exception):
    """Base class of every exception phyrt defines."""


class EngineUnavailableError(PhyrtError, RuntimeError):
    """The engine (or the replica a request went to) can no longer serve.

    Raised when the engine was closed, when no healthy replica is left, or when a
    managed worker group failed: a rank exited, missed its heartbeats, sent a
    malformed message or overran ``execution_timeout_s``. phyrt never retries or
    restarts; re-create the engine or let the layer above take it out of rotation.
    """


class WorkerStartupError(EngineUnavailableError):
    """A rank failed, or did not report ready in time, while the engine started."""


class ProtocolError(PhyrtError, ValueError):
    """A message, frame or tensor descriptor is malformed or not allowed."""


class RemoteError(PhyrtError):
    """An exception raised in another process, carried back as data.

    ``remote_type`` is the qualified name of the original exception type and
    ``remote_traceback`` its formatted traceback (text only: no object crosses
    a process boundary).
    """

    def __init__(self, remote_type: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = f"{self.remote_type}: {self.remote_message}"
        if self.remote_traceback:
            text += "\n--- remote traceback ---\n" + self.remote_traceback.rstrip()
        return text


class RequestMismatchError(PhyrtError, ValueError):
    """The ranks of an external engine were given different requests for the same step.

    Raised on every rank at the same point, before the plugin ran; the engine stays
    usable. ``fingerprints`` maps each world rank to its request's fingerprint.
    """

    def __init__(self, message: str, fingerprints: dict[int, int]) -> None:
        super().__init__(message)
        self.fingerprints = fingerprints
