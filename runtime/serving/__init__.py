"""The server side of the front door: an ``Engine`` behind a ZeroMQ ROUTER socket
(``server``), its requests and shared memory per client, and the metrics endpoint.

Imports ``runtime.core`` and ``runtime.transport``; the engine is handed in.
"""
