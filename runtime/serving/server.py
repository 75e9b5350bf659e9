"""Server: an Engine behind a ZeroMQ ROUTER socket (the wire is described in runtime.transport.protocol).

    clients (DEALER)                  I/O thread (IoLoop, loop.py)                        engine
    [header, *tensor frames] ----->  ServerSocket.read_batch (router.py; tensor frames: no copy)
                                     MessageHandler.handle (handlers.py): decode, check,
                                       engine.submit ----------------------------------->  Future
                                       ping, info, cancel, register, release
                                     Replies.settle (replies.py): deadlines from a heap
                                                          done callback, on the engine's thread:
    <----- [header, *tensor frames] ------------------    Replies.on_done encodes and sends the
                                     (the I/O thread      reply (ServerSocket.send: never blocks)
                                     sends it instead
                                     when a deadline
                                     answered first)

With an inline engine, two I/O threads take turns running the loop (``Turns``, turns.py):
an idle engine runs a submit in the thread that read it (``Engine.inline_runner()``), which
gives the loop to the other thread meanwhile; an idle server answers with no hop to the
engine's thread. Otherwise one I/O thread runs it.

    Server(engine, address, ...)   binds (ServerSocket), nothing runs yet
    start()                        the I/O thread(s)
    stop_accepting()               new submits refused; ping and info still answer
    wait_drained(timeout)          until the engine holds none of our requests
    close(drain_timeout_s)         stop accepting, drain, close the engine (failing what is
                                   left), let the last replies out, stop the threads, release
                                   the socket, every segment and the ipc socket file

Invariants:
- The server owns the engine it serves, the socket, the threads and the clients' shared
  memory; ``close()`` releases them all, once (idempotent).
- Request tensors that arrive as frames are read-only views of the received frame (no
  copy); from shared memory they are views of the client's block. Plugins must not write
  into their inputs.
- Shared memory (ipc:// only) is per connection (``runtime.serving.shm``): inputs from
  segments that the client registered (mapped, then unlinked at once), results into an
  arena the server keeps for that client, each name unlinked once the client has mapped
  it. A client silent for ``client_timeout_s`` loses this state.
- Same-host trust: ipc:// sockets live in an owner-only directory, so a peer is a process
  of the same user; such a process can also signal or ptrace the server, so shared memory
  does not try to defend against it (it could, say, truncate a segment it registered).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from runtime.serving.handlers import (DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES,
                                      MessageHandler, ServerOptions)
from runtime.serving.loop import IoLoop
from runtime.serving.router import ServerSocket
from runtime.serving.turns import Turns
from runtime.transport.endpoints import CurveKeys, check_address
from runtime.transport.arena import sweep_stale

__all__ = ["Server", "ServerOptions", "DEFAULT_MAX_INFLIGHT", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES"]

log = logging.getLogger("phyrt.server")


class Server:
    """Serves ``engine`` on ``address`` (bound here; ``start()`` runs the I/O thread)."""

    def __init__(self, engine: Any, address: str, *, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, curve: CurveKeys | None = None,
                 client_timeout_s: float = 60.0, info: dict[str, Any] | None = None,
                 metrics: Any = None) -> None:
        options = ServerOptions(max_inflight, max_message_bytes, client_timeout_s, dict(info or {}))
        check_address(address, curve is not None)
        self._engine = engine
        self._closed = False
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self._turns = Turns()
        self._socket = ServerSocket(address, max_message_bytes, curve, self._turns.held_here)
        self.address: str = self._socket.address
        try:
            self._messages = MessageHandler(engine, self.address, self._socket.send, options, metrics=metrics,
                                            wake=self._socket.wake)
        except BaseException:
            self._socket.close(0)
            raise
        self._shm = self._messages.shm
        self._loop = IoLoop(self._socket, self._messages, self._turns)

    @property
    def server_id(self) -> str:
        return self._messages.server_id

    @property
    def inflight(self) -> int:
        """Requests the engine still holds for this server (what ``max_inflight`` counts)."""
        return self._messages.inflight

    def info(self) -> dict[str, Any]:
        """What ``info`` answers: plugin, topology, replicas, versions, limits."""
        return self._messages.info()

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> "Server":
        sweep_stale()  # names left by phyrt processes that were killed
        # the second I/O thread stands by for a looping thread that runs a request itself
        count = 2 if self._messages.runs_here else 1
        self._threads = [threading.Thread(target=self._turns.serve, args=(self._loop.run,),
                                          name=f"phyrt-server-{i}", daemon=True) for i in range(count)]
        self._thread = self._threads[0]
        for thread in self._threads:
            thread.start()
        return self

    def stop_accepting(self) -> None:
        """New submits get EngineUnavailable from now on; ping and info still answer."""
        self._messages.stop_accepting()
        self._socket.wake()

    def skip_drain(self) -> None:
        """Make a ``close()`` that waits for in-flight requests stop waiting now."""
        self.stop_accepting()
        self._loop.drained.set()

    def wait_drained(self, timeout: float | None) -> bool:
        """After ``stop_accepting``: wait until the engine holds no request; False on time-out."""
        return self._loop.drained.wait(timeout)

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_timeout_s``,
        then close the engine (failing what is left), send the last replies and release
        every socket, segment and the ipc socket file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        running = self._thread is not None and self._thread.is_alive()
        if running:
            self.stop_accepting()
            if not self.wait_drained(drain_timeout_s):
                log.warning("%d request(s) still in flight after %.1f s; failing them", self.inflight,
                            drain_timeout_s)
        try:
            self._engine.close(timeout=2.0)
        finally:
            if running:
                self._loop.idle.wait(2.0)  # the engine failed what it held: let those replies go out
                self._loop.stop()
                for thread in self._threads:
                    thread.join(10)
            # a moment for the last replies to reach their clients
            self._socket.close(linger_ms=500 if self._thread is not None else 0)
            self._messages.close()
            sweep_stale()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
