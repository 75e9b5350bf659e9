"""``Client``: the thread-safe light client of ``runtime.serving.server``; its verbs, lifecycle and
``ClientStream`` (the iterator of ``Client.stream``).

Needs pyzmq, msgpack and numpy only: torch is used when the caller hands in torch
tensors or asks for torch results, never imported here otherwise. The client is a thin user of
its ``runtime.link.link.Link`` (the socket, the requests in flight, the reading, the link thread);
the errors are ``runtime.client.server_errors``'; ``AsyncClient`` is in ``runtime.client.async_client``.

    call(p)      Link.call: the caller takes the socket when free, sends and reads until its own
                 ``Slot`` is done (other replies it reads on the way are completed too)
    submit(p)    Link.submit: a ``concurrent.futures.Future``, completed by whoever reads (a caller,
                 or the link's thread "phyrt-client"); ``result()`` only waits
    stream(p)    Link.submit with a ``StreamState``: chunks go to the stream's queue as read
    ping/info/cancel: Link.control, then Link.wait (reads while nobody else does)

Why a caller reads: handing each request to an I/O thread and each reply back costs two
thread switches per round trip (tens of µs each under the GIL on a busy machine). So a
lone caller's round trip involves no other Python thread of this process, and it polls
``budget_ns("client")`` (``runtime.transport.spin``) before it sleeps.

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

import math
import queue
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Callable

import numpy as np

from runtime.client import server_errors
from runtime.client.routing import RoutingClient
from runtime.client.server_errors import ConnectionLostError, DeadlineExceededError
from runtime.core.chunk_stream import ChunkStream
from runtime.core.priority import check_priority
from runtime.link.link import Link, LinkOptions
from runtime.link.link_thread import LinkThread
from runtime.link.session import ShmSession
from runtime.transport.arena import sweep_stale
from runtime.transport.protocol import DEFAULT_SHM_THRESHOLD

__all__ = ["Client", "ClientStream", "StreamState"]


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
        if shm_on:
            sweep_stale()  # names left by phyrt processes that were killed
        options = LinkOptions(tensor_type, shm_on, shm_threshold, heartbeat_interval_s, heartbeat_timeout_s,
                              server_public_key, public_key, secret_key)
        self._link = Link(address, options, server_errors, LinkThread("phyrt-client"))

    # -- the verbs ---------------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None, priority: int = 0) -> Future:
        """Send one request; the Future gets the result, or a ``ServerError`` subclass.

        ``timeout`` (seconds) is the request's deadline on the server: past it the
        Future fails with ``DeadlineExceededError``. ``future.cancel()`` also asks
        the server to drop the request if it is still queued. ``priority``: an int in
        -2**31..2**31-1, larger is sooner (``Engine.submit``'s); TypeError or ValueError
        before anything is sent.
        """
        future = self._submit(payload, timeout, None, priority)
        future.add_done_callback(self._on_future_done)
        return future

    def call(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> Any:
        """``submit(payload, timeout=timeout, priority=priority).result(timeout)``; raises
        DeadlineExceededError on time-out."""
        _check_timeout(timeout)
        if type(priority) is not int or priority:  # 0, the default, needs no check and is not sent
            check_priority(priority)
        self._check_open()
        slot = self._link.call(payload, timeout, priority)
        if slot.done():
            return slot.result()
        if slot.cancel():
            self._link.cancel(slot.request_id)
        elif not slot.cancelled():
            return slot.result()
        raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                slot.request_id) from None

    def stream(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> ClientStream:
        """Send one request as a stream: an iterator of its chunks as the server's plugin makes
        them (``ClientStream``, below); leaving it early cancels the request on the server.
        ``timeout`` bounds the whole stream (``DeadlineExceededError``); ``priority`` as in ``submit``."""
        stream = ClientStream(self.address, timeout)
        future = self._submit(payload, timeout, stream.state, priority)
        return stream.start(future, self._canceller(future.request_id))  # type: ignore[attr-defined]

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
        if nbytes >= self._shm_threshold and self._link.wants_shm():
            # a new client (or one whose server restarted) has no shared memory yet: the first
            # ping's answer starts the session and sends its registration, which the server
            # answers before the second ping (one connection's messages are handled in order)
            for _ in range(2):
                if not self._link.wants_shm():
                    break
                self.ping()
        lent = self._link.lend(nbytes) if nbytes >= self._shm_threshold else None
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
        self._link.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def _session(self) -> ShmSession | None:
        """The shared-memory session with the current server instance (None: frames only, or not yet)."""
        return self._link.session

    # -- what AsyncClient and RoutingClient use ------------------------------------------

    def _submit(self, payload: Any, timeout: float | None, stream: Any = None, priority: int = 0) -> Future:
        """Send a submit (a stream op with ``stream``, a ``StreamState``); its future, with ``request_id``."""
        _check_timeout(timeout)
        if type(priority) is not int or priority:  # 0, the default, needs no check and is not sent
            check_priority(priority)
        self._check_open()
        return self._link.submit(payload, timeout, stream, priority)

    def _control(self, op: str, **fields: Any) -> Future:
        """Send a control op (``ping``, ``info``, ``cancel``); its future."""
        self._check_open()
        return self._link.control(op, **fields)

    def _control_async(self, op: str) -> Future:
        """A control op whose future nobody here waits on: the link's thread reads its reply."""
        future = self._control(op)
        self._link.need_reader()
        return future

    def _result(self, future: Future, timeout: float | None) -> Any:
        if not self._link.wait(future, timeout) and not future.done():
            raise FutureTimeoutError()
        return future.result()

    def _check_open(self) -> None:
        if self._link.awaited.closed:
            raise ConnectionLostError(f"the client of {self.address} is closed")

    def _on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` after each failure of the link (lost, restarted, refused, silent past
        heartbeat_timeout_s), on the link's thread with no lock held (``Link.on_failure``)."""
        self._link.on_failure(callback)

    @property
    def _unreachable(self) -> str | None:
        """Why no server listens at the ipc:// path (None: one may)."""
        return self._link.awaited.unreachable

    def _need_reader(self) -> None:
        """Replies are due: wake the link's thread to read them unless a thread reads already."""
        self._link.need_reader()

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled() and not self._link.awaited.closed:
            self._link.cancel(future.request_id)  # type: ignore[attr-defined]

    def _cancel_in_flight(self, request_id: int) -> None:
        self._link.cancel(request_id)

    def _canceller(self, request_id: int) -> Callable[[], None]:
        link = self._link
        return lambda: link.cancel(request_id)


def _check_timeout(timeout: Any) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


# -- Client.stream's iterator (AsyncClientStream, in runtime.client.async_client, shares _Base) --


class StreamState:
    """What the reader hands a stream's chunks to: ``deliver(chunk)``, and the next ``seq`` due."""

    __slots__ = ("deliver", "seq")

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.deliver = deliver
        self.seq = 0


class _Base(ChunkStream):
    """What the sync and async iterators share: ``runtime.core.chunk_stream.ChunkStream``, and the
    server's address for the deadline's error."""

    def __init__(self, address: str, timeout: float | None) -> None:
        super().__init__(timeout)
        self._address = address

    def _expired(self) -> DeadlineExceededError:
        self._leave()
        return DeadlineExceededError.for_request(f"the stream did not end within {self._timeout} s from "
                                                 f"{self._address} (it was cancelled)",
                                                 getattr(self._future, "request_id", None))


class ClientStream(_Base):
    """The chunks of one request as they come (``Client.stream``): iterate, or ``close()``.

    ``timeout`` bounds the whole stream, from ``stream()`` to its end: the chunks (and the end)
    received before the deadline are handed out even when read after it; ``next()`` raises
    ``DeadlineExceededError`` where it would wait past the deadline (or reach a chunk that came
    after it), and the request is cancelled on the server. A server error ends it with its
    ``ServerError`` subclass; a lost connection or the client's ``close()`` with
    ``ConnectionLostError``. Leaving early (``close()``, leaving a ``with`` block, or dropping
    the iterator) cancels the request on the server.
    """

    def __init__(self, address: str, timeout: float | None) -> None:
        super().__init__(address, timeout)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.state = StreamState(self._arrivals(self._queue.put))

    def start(self, future: Future, cancel: Callable[[], None]) -> "ClientStream":
        self._start(future, cancel)
        return self

    def __iter__(self) -> "ClientStream":
        return self

    def __next__(self) -> Any:
        return self._next_from(self._queue)

    def close(self) -> None:
        """Leave the stream (cancelled on the server if still running). Idempotent."""
        self._leave()

    def __enter__(self) -> "ClientStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


Client.stream_type = ClientStream  # type: ignore[attr-defined]  # what RoutingClient.stream makes
