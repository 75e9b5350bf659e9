"""The light client of a phyrt server: ``Client`` (threads), ``AsyncClient`` (asyncio),
their errors, and ``ObservationGate`` for sensor callbacks.

Needs pyzmq, msgpack and numpy only: nothing here imports torch (see ``client``).

Modules: ``client`` (``Client``: verbs, lifecycle; ``ClientStream``), ``async_client``
(``AsyncClient``, ``AsyncClientStream``), ``routing`` (``RoutingClient``: ``Client([address, ...])``
over several servers) and ``rotation`` (its choice of server), ``server_errors``, ``gate``. The
socket, the requests in flight, the reading, the link thread and the shm session are the
link's: ``runtime.link.link`` (``Link``), ``runtime.link.client_protocol`` says what is sent.
"""

from runtime.client.async_client import AsyncClient
from runtime.client.client import Client
from runtime.client.server_errors import (ConnectionLostError, DeadlineExceededError, HandshakeError,
                                          InvalidRequestError, OverloadedError, PluginError, ServerError,
                                          ServerUnavailableError)
from runtime.client.gate import ObservationGate
from runtime.client.routing import RoutingClient

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "HandshakeError",
    "InvalidRequestError", "ObservationGate", "OverloadedError", "PluginError", "RoutingClient", "ServerError",
    "ServerUnavailableError",
]
