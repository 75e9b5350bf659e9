"""``Client``: the thread-safe light client of ``runtime.serving.server``; its verbs and lifecycle.

Needs pyzmq, msgpack and numpy only: torch is used when the caller hands in torch
tensors or asks for torch results, never imported here otherwise. The wire, the ops and
the shared-memory protocol are in ``runtime.transport.protocol``; the errors in
``runtime.client.errors``; ``AsyncClient`` (asyncio) in ``runtime.client.async_client``.

    caller threads                                                     server (ROUTER)
    call(p), nobody reading: take the reader role (take_free), encode, Replies.add,
      Connection.exchange: send now, poll, read ---- [header, *tensor frames] ---->
      its own plain reply answered at once (Replies.own), any other as read_until does
    submit(p) / call(p) otherwise: encode (tensors -> frames | shm), Replies.add,
      Connection.send: the socket free? send now ---- [header, *tensor frames] ---->
      held by a reader: it sends them (woken through the reader role)
    call(), ping(), info(), cancel(): ReaderRole.wait(future, timeout, read_until):
      nobody reads: this thread holds the socket,  <--- [header, *tensor frames] ---
      polls, reads, completes futures (Replies)
      somebody reads: sleep on the future, which that reader completes
    submit() futures with no caller reading: the I/O thread reads (runtime.client.io_thread),
      and sends heartbeats; a lost connection, a refused handshake or silence -> in-flight requests fail

Why a caller reads: handing each request to an I/O thread and each reply back costs two
thread switches per round trip (tens of µs each under the GIL on a busy machine). So a
lone caller's round trip involves no other Python thread of this process, and it polls
``budget_ns("client")`` (``runtime.transport.spin``) before it sleeps.

Invariants (each module states its own):
- Who reads the socket is decided only by the ``ReaderRole`` (one holder; it re-enters, so
  a completion callback may call this client again from the reader's thread).
- Every future is a ``concurrent.futures.Future`` (``call``'s, which nobody else sees, a lighter
  ``runtime.core.futures.Slot``), completed once, with no lock held (but a ``Slot``, which runs no
  callbacks, by its own caller holding the socket: ``Replies.own``).
- ``close()`` fails what is in flight, then closes the role (the reader leaves), then the
  I/O thread closes the socket; the descriptors and the context go once it has ended.

Shared-memory results (ipc://). A result tensor of at least 64 KiB comes back as a *view*
of the block the server wrote it into, not a copy: a numpy array (or ``torch.from_numpy``
of one, with ``tensor_type="torch"``) whose ``.base`` chain ends in that block. It is

- valid for as long as you hold it (or anything made from it): the server reuses the
  block only after this client sent its ``release``, which happens only once the last of
  those is collected. It stays valid after ``close()``, a lost connection, and the
  server's exit or death (the mapping goes with the last view, never before);
- writable: the block is yours until it is collected;
- memory the server set aside for this client: unreleased result blocks of one client
  hold at most ``runtime.serving.shm.RESULT_SHM_LIMIT`` bytes (512 MiB); past that the
  server sends results as frames (copies). Keeping many results for long is where
  ``.copy()`` (and dropping the view) helps: it gives the block back at once.

Only this process's arrays count: a child forked while holding one shares the block
(``MAP_SHARED``) and sees it change once this process dropped its arrays; it should keep
a ``.copy()``. A block's ``release`` rides with the next message to the server, at the
latest the next heartbeat. Views of a session that is gone (closed, connection lost,
server restarted) release nothing: that server frees the whole session. Results sent as
frames (tcp://, ``shm=False``, small tensors) are copies the caller owns.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import numpy as np

from runtime.client.connection import Connection
from runtime.client.errors import ConnectionLostError, DeadlineExceededError
from runtime.client.io_thread import IOThread
from runtime.client.placement import Placement
from runtime.client.replies import Pending, Replies
from runtime.client.routing import RoutingClient
from runtime.client.shm import ShmSession
from runtime.client.streams import ClientStream
from runtime.core.futures import Slot, resolve
from runtime.link.client_protocol import control_header, plain_submit, submit_message
from runtime.transport.protocol import DEFAULT_SHM_THRESHOLD
from runtime.transport.reader import ReaderRole
from runtime.transport.arena import sweep_stale
from runtime.transport.wake_pipe import WakePipe

__all__ = ["Client"]


class Client:
    """A thread-safe connection to a phyrt server.

    ``submit`` returns a ``concurrent.futures.Future`` at once and never waits on the
    network, so it is safe inside a ROS callback. Results hold numpy arrays, or torch
    tensors with ``tensor_type="torch"``. ``shm`` (default: on for ipc://) sends
    tensors of at least ``shm_threshold`` bytes through shared memory, and large
    results come back as views of shared memory, valid until collected (see the
    module's docstring). CURVE: ``server_public_key`` plus this client's
    ``public_key``/``secret_key`` (z85 text or key files); without them the client
    speaks plain ZMQ. A handshake the server refuses (keys missing, wrong or not
    authorized) fails the requests in flight and later ones with ``HandshakeError`` (a
    ``ConnectionLostError``) naming the cause, within moments. While no server listens at an
    ``ipc://`` address (no socket at its path, or a stale one) each request fails at once with
    ``ServerUnavailableError`` naming the path; once one listens there, requests go out.

    ``Client([address, ...])`` (a list or tuple) returns a ``RoutingClient`` over those
    servers, with the same verbs, the keyword arguments above for each server, and
    ``refresh``/``refresh_interval_s`` (``runtime.client.routing``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        address = args[0] if args else kwargs.get("address")
        if isinstance(address, (list, tuple)):
            kwargs.pop("address", None)
            return RoutingClient(address, cls, *args[1:], **kwargs)
        return super().__new__(cls)

    def __init__(self, address: str, *, tensor_type: str = "numpy", shm: bool | None = None,
                 shm_threshold: int = DEFAULT_SHM_THRESHOLD, heartbeat_interval_s: float = 1.0,
                 heartbeat_timeout_s: float = 5.0, server_public_key: str | bytes | None = None,
                 public_key: str | bytes | None = None, secret_key: str | bytes | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"address must look like ipc:///path or tcp://host:port, got {address!r}")
        if tensor_type not in ("numpy", "torch"):
            raise ValueError(f'tensor_type must be "numpy" or "torch", got {tensor_type!r}')
        if not 0 < heartbeat_interval_s < heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s, got "
                             f"{heartbeat_interval_s} and {heartbeat_timeout_s}")
        self.address = address
        shm_on = address.startswith("ipc://") and shm is not False
        self._shm_threshold = shm_threshold
        self._ids = itertools.count()
        if shm_on:
            sweep_stale()  # names left by phyrt processes that were killed
        self._replies = Replies(address, tensor_type, shm_on)
        self._replies.look()
        wake_io = WakePipe()
        self._role = ReaderRole(self._replies.awaiting, wake_io.wake, self._replies.lock)
        try:
            self._conn = Connection(address, self._replies, self._role, heartbeat_interval_s,
                                    server_public_key, public_key, secret_key)
        except BaseException:
            self._role.dispose()
            wake_io.close()
            raise
        self._read = self._conn.read_until  # bound once: call() allocates no more than it must
        self._placement = Placement(self._replies, self._conn.outbox, shm_threshold)
        self._io = IOThread(self._conn, self._replies, self._role, wake_io, heartbeat_interval_s,
                            heartbeat_timeout_s)
        try:
            self._io.start()
        except BaseException:  # no thread to close the socket: close it here
            self._conn.shut()
            self._conn.term()
            self._role.dispose()
            wake_io.close()
            raise

    # -- the verbs ---------------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None) -> Future:
        """Send one request; the Future gets the result, or a ``ServerError`` subclass.

        ``timeout`` (seconds) is the request's deadline on the server: past it the
        Future fails with ``DeadlineExceededError``. ``future.cancel()`` also asks
        the server to drop the request if it is still queued.
        """
        future = self._submit(payload, timeout)
        future.add_done_callback(self._on_future_done)
        self._need_reader()
        return future

    def call(self, payload: Any, timeout: float | None = None) -> Any:
        """``submit(payload, timeout=timeout).result(timeout)``; raises DeadlineExceededError on time-out."""
        role = self._role
        reads = role.take_free()  # nobody reads: this thread sends and reads itself
        try:
            future, frames = self._prepare(payload, timeout, slot=True)  # nobody else sees it: a Slot
            deadline = None if timeout is None else time.monotonic() + timeout
            if reads:
                self._conn.exchange(future.request_id, frames, future, deadline)
            else:
                self._conn.send(future.request_id, frames)
        finally:
            if reads:
                role.leave()
        if future.done() or role.wait(future, None if deadline is None else deadline - time.monotonic(),
                                      self._read) or future.done():
            return future.result()
        if future.cancel():
            self._cancel_in_flight(future.request_id)
        elif not future.cancelled():
            return future.result()
        raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                future.request_id) from None

    def stream(self, payload: Any, timeout: float | None = None) -> ClientStream:
        """Send one request as a stream: an iterator of its chunks as the server's plugin makes
        them (``runtime.client.streams``); leaving it early cancels the request on the server.
        ``timeout`` bounds the whole stream (``DeadlineExceededError``)."""
        stream = ClientStream(self.address, timeout)
        future = self._submit(payload, timeout, stream.state)
        stream.start(future, functools.partial(self._cancel_in_flight, future.request_id))  # type: ignore[attr-defined]
        self._need_reader()
        return stream

    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A new, uninitialised array placed where the server reads it: this client's shared
        memory with a same-host server (``ipc://``), so a request carrying it (or a contiguous
        slice of it) crosses with no copy. Over tcp://, with ``shm=False``, or before the
        server took this client's shared memory, an ordinary array (sent as frames).

        The ownership rules of ``Engine.empty``: yours to write and send as often as you like;
        its memory goes back to this client's pool once you dropped it and every request that
        carried it was answered; do not write it while such a request runs (the server and
        its plugin may read the new values, the old or a mix; never freed memory). After
        ``close()`` or a server restart it is still valid memory and is sent as a copy.
        """
        dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if not isinstance(dims, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"shape must be an int or a sequence of ints >= 0, got {shape!r}")
        dtype = np.dtype(dtype)
        if dtype.kind not in "biuf" or dtype.byteorder == ">":
            raise TypeError(f"dtype must be a little-endian bool, int, uint or float dtype, got {dtype!r}")
        self._check_open()
        dims = tuple(int(d) for d in dims)
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes >= self._shm_threshold and self._replies.wants_shm():
            # a new client (or one whose server restarted) has no shared memory yet: the first
            # ping's answer starts the session and sends its registration, which the server
            # answers before the second ping (one connection's messages are handled in order)
            for _ in range(2):
                if not self._replies.wants_shm():
                    break
                self.ping()
        lent = self._placement.lend(nbytes) if nbytes >= self._shm_threshold else None
        if lent is None:
            return np.empty(dims, dtype)
        return np.frombuffer(lent, dtype=dtype, count=math.prod(dims)).reshape(dims)

    def cancel(self, future: Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a submitted request; True if it was still queued and is dropped."""
        request_id = getattr(future, "request_id", None)
        if request_id is None:
            raise ValueError("not a future returned by this client's submit()")
        reply = self._result(self._control("cancel", target=request_id), timeout)
        return bool(reply.get("cancelled")) if isinstance(reply, dict) else False

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to the server's I/O thread, in seconds."""
        started = time.monotonic()
        self._result(self._control("ping"), timeout)
        return time.monotonic() - started

    def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's plugin, topology, replicas (health, in flight) and versions."""
        return self._result(self._control("info"), timeout)

    def close(self) -> None:
        """Fail what is in flight, stop the I/O thread, release sockets and segments. Idempotent.

        Shared-memory results already returned stay valid (their mappings go with them)."""
        pending = self._replies.close()
        if pending is None:
            return
        for p in pending.values():  # first: a caller reading for one of them then lets go
            resolve(p.future, error=ConnectionLostError(f"the client of {self.address} was closed"))
        self._role.close()
        self._role.leave(hand_on=False)  # closed from a callback run by the reading caller
        ended = self._io.stop()
        self._replies.close_session()
        if ended:
            self._io.dispose()
            self._role.dispose()
            self._conn.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def _session(self) -> ShmSession | None:
        """The shared-memory session with the current server instance (None: frames only, or not yet)."""
        return self._replies.session

    # -- sending -----------------------------------------------------------------------

    def _submit(self, payload: Any, timeout: float | None, stream: Any = None) -> Future:
        """Encode and send a submit (a stream op with ``stream``, a ``StreamState``); its future,
        with ``request_id`` (for ``cancel``)."""
        future, frames = self._prepare(payload, timeout, stream)
        self._conn.send(future.request_id, frames)
        return future

    def _prepare(self, payload: Any, timeout: float | None, stream: Any = None,
                 slot: bool = False) -> tuple[Any, list[Any]]:
        """A submit's future, in flight from now on, and the frames to send: a ``Slot`` with
        ``slot``, for a caller that waits for it itself and hands it to nobody."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self._check_open()
        request_id = next(self._ids)
        session = self._replies.session
        shm_results = session is not None and session.result_mapper is not None
        # a plain payload needs no encoder, unless dropped results' blocks are to ride in its header
        data = plain_submit(request_id, timeout, shm_results, payload, stream is not None) \
            if session is None or not session.released else None
        blocks, released, frames = None, None, [data]
        if data is None:
            encoder = self._placement.encoder(session)
            # dropped results' blocks ride in the header: one message for the server to read, not two
            released = session.take_released() if session is not None and session.released else None
            try:
                data = submit_message(encoder, request_id, timeout, shm_results, payload, released, stream is not None)
            except BaseException:
                if session is not None:
                    session.free(encoder.blocks)
                    if released:  # they ride with a later message
                        session.give_back(released)
                raise
            blocks, frames = encoder.blocks, [data, *encoder.frames]
        future: Any = Slot() if slot else Future()
        future.request_id = request_id
        self._replies.add(request_id, Pending(future, "submit", time.monotonic(), blocks, session, released, stream))
        return future, frames

    def _control(self, op: str, **fields: Any) -> Future:
        """Send a control op (``ping``, ``info``, ``cancel``); its future."""
        self._check_open()
        request_id = next(self._ids)
        future: Future = Future()
        future.request_id = request_id  # type: ignore[attr-defined]
        self._replies.add(request_id, Pending(future, op, time.monotonic()))
        self._conn.send(request_id, [control_header(op, request_id, **fields)])
        return future

    def _control_async(self, op: str) -> Future:
        """A control op whose future nobody here waits on: the I/O thread reads its reply."""
        future = self._control(op)
        self._need_reader()
        return future

    def _result(self, future: Future, timeout: float | None) -> Any:
        if not self._role.wait(future, timeout, self._read) and not future.done():
            raise FutureTimeoutError()
        return future.result()

    def _check_open(self) -> None:
        if self._replies.closed:
            raise ConnectionLostError(f"the client of {self.address} is closed")

    def _need_reader(self) -> None:
        """Replies are due: wake the I/O thread to read them unless a thread reads already."""
        if self._role.holder is None:
            self._io.wake()

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled() and not self._replies.closed:
            self._cancel_in_flight(future.request_id)  # type: ignore[attr-defined]

    def _cancel_in_flight(self, request_id: int) -> None:
        if request_id in self._replies.pending:  # still in flight: ask the server to drop it
            self._conn.send(None, [control_header("cancel", "cancel", target=request_id)])
