"""The light client of a phyrt server: ``Client`` (threads), ``AsyncClient`` (asyncio),
their errors, and ``ObservationGate`` for sensor callbacks.

Needs pyzmq, msgpack and numpy only: nothing here imports torch (see ``client``).
"""

from runtime.client.client import AsyncClient, Client
from runtime.client.errors import (ConnectionLostError, DeadlineExceededError, InvalidRequestError, OverloadedError,
                                   PluginError, ServerError, ServerUnavailableError)
from runtime.client.gate import ObservationGate

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "InvalidRequestError",
    "ObservationGate", "OverloadedError", "PluginError", "ServerError", "ServerUnavailableError",
]
