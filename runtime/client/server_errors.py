"""The errors a ``Client`` raises: a server's error reply, or a lost connection.

Leaf module: imports nothing from the project but ``runtime.core.errors``, nothing
beyond the standard library, so that the torch-free client and the server share
these types. ``type`` is the name a reply's ``error.type`` carries on the wire
(see ``runtime.link.client_protocol``):

    ServerError                         any error reply; an unknown type keeps its name
    ├── InvalidRequestError (ValueError)        InvalidRequest
    ├── DeadlineExceededError (TimeoutError)    DeadlineExceeded
    ├── OverloadedError                         Overloaded
    ├── PluginError                             PluginError
    └── ServerUnavailableError                  EngineUnavailable
        │   (also runtime.core.errors.EngineUnavailableError)
        └── ConnectionLostError                 raised by the client itself, never sent
            └── HandshakeError                  the server refused this client's handshake
                                                (CURVE keys), also raised by the client only
"""

from __future__ import annotations

from typing import Any

from runtime.core.errors import EngineUnavailableError, PhyrtError


class ServerError(PhyrtError):
    """The server answered a request with an error ``{type, message}``."""

    type = "ServerError"
    #: the id of the request it answers (None when the server could not tell)
    request_id: Any = None

    @classmethod
    def for_request(cls, message: str, request_id: Any) -> "ServerError":
        # one constructor argument only: TimeoutError (an OSError) reads two as errno, strerror
        error = cls(message)
        error.request_id = request_id
        return error


class InvalidRequestError(ServerError, ValueError):
    type = "InvalidRequest"


class DeadlineExceededError(ServerError, TimeoutError):
    type = "DeadlineExceeded"


class OverloadedError(ServerError):
    """More requests were in flight than the server's ``--max-inflight``; retry later."""

    type = "Overloaded"


class PluginError(ServerError):
    type = "PluginError"


class ServerUnavailableError(ServerError, EngineUnavailableError):
    """The server's engine cannot serve (closed, shutting down, no healthy replica); or no server
    listens at the client's ipc:// path (raised by the client, naming the path); or, from a
    client over several servers (``Client([address, ...])``), none of them is in its rotation:
    ``causes`` then maps each address to that server's last cause, which the message names too."""

    type = "EngineUnavailable"
    #: a client over several servers with none in rotation: address -> why that server left it
    causes: dict[str, str] | None = None

    @classmethod
    def for_servers(cls, causes: dict[str, str]) -> "ServerUnavailableError":
        listed = "; ".join(f"{address}: {cause}" for address, cause in causes.items())
        error = cls(f"no server is in the rotation ({listed}); each is probed and comes back once it answers")
        error.causes = dict(causes)
        return error


class ConnectionLostError(ServerUnavailableError):
    """The connection to the server was lost with the request in flight (client side)."""

    type = "ConnectionLost"


class HandshakeError(ConnectionLostError):
    """The server refused this client's handshake (CURVE keys missing or wrong, or a client key
    it does not authorize): nothing reaches it until that is fixed. The message names the cause."""

    type = "Handshake"


_ERROR_CLASSES = {cls.type: cls for cls in (InvalidRequestError, DeadlineExceededError, OverloadedError,
                                            PluginError, ServerUnavailableError)}


def error_from_reply(error: Any, request_id: Any = None) -> ServerError:
    """The exception for a reply's ``error`` field (a malformed one becomes a plain ServerError)."""
    if not isinstance(error, dict):
        return ServerError.for_request(f"malformed error reply: {error!r}"[:500], request_id)
    kind, message = str(error.get("type")), str(error.get("message"))
    cls = _ERROR_CLASSES.get(kind)
    if cls is None:
        return ServerError.for_request(f"{kind}: {message}", request_id)
    return cls.for_request(message, request_id)
