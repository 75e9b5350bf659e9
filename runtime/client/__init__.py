"""The light client of a phyrt server: ``Client`` (threads), ``AsyncClient`` (asyncio),
their errors, and ``ObservationGate`` for sensor callbacks.

Needs pyzmq, msgpack and numpy only: nothing here imports torch (see ``client``).

Modules: ``client`` (``Client``: verbs, lifecycle), ``async_client`` (``AsyncClient``),
``connection`` (the socket, its outbox, reading), ``replies`` (requests in flight, decoding
replies, shm bookkeeping), ``io_thread`` (fallback reader, heartbeats, monitor),
``handshake`` (what the socket monitor's events mean), ``routing`` (``RoutingClient``:
``Client([address, ...])`` over several servers) and ``rotation`` (its choice of server),
``shm`` (the shm session), ``streams`` (the iterators of ``Client.stream`` and
``AsyncClient.stream``), ``errors``, ``gate``. What is sent (the headers) is
``runtime.link.client_protocol``'s.
"""

from runtime.client.async_client import AsyncClient
from runtime.client.client import Client
from runtime.client.errors import (ConnectionLostError, DeadlineExceededError, HandshakeError, InvalidRequestError,
                                   OverloadedError, PluginError, ServerError, ServerUnavailableError)
from runtime.client.gate import ObservationGate
from runtime.client.routing import RoutingClient

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "HandshakeError",
    "InvalidRequestError", "ObservationGate", "OverloadedError", "PluginError", "RoutingClient", "ServerError",
    "ServerUnavailableError",
]
