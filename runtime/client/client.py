"""The light client of ``runtime.serving.server``: ``Client`` (threads) and ``AsyncClient`` (asyncio).

Needs pyzmq, msgpack and numpy only: torch is used when the caller hands in torch
tensors or asks for torch results, never imported here otherwise. The wire, the
ops and the shared-memory protocol are described in ``runtime.transport.protocol``; the
errors are in ``runtime.client.errors`` (and importable from here).

    caller threads                                            server (ROUTER)
    submit(payload) / call(payload)
      encode: tensors -> frames | shm
      pending[id] = future; outbox.append(frames)
      the socket free: take it and send ------ [header, *tensor frames] ---->
      held by a reader: it sends them
    call(), ping(), info(), cancel(): the *reader*
      when no other thread reads: hold the
      socket, poll it, read, complete futures <- [header, *tensor frames] ----
      otherwise wait on the future
                                   I/O thread: "ping" every heartbeat_interval_s;
                                   the reader when no caller is (submit() futures,
                                   heartbeats, register replies); socket monitor:
                                   DISCONNECTED -> in-flight requests fail

Why. Handing each request to an I/O thread and each reply back costs two thread
switches per round trip (tens of µs each under the GIL on a busy machine). So a
caller sends from its own thread, and a caller blocked in ``call()`` reads the
replies itself when no other thread does (leader/follower): a lone caller's round
trip involves no other Python thread of this process. Such a caller polls for up to
300 µs before it sleeps (``runtime.transport.spin``; ``PHYRT_SPIN_US``, 0 = off; off on
a single core): a small request's answer then finds it awake, and a long request
costs at most that much CPU.

Invariants:
- The socket is used under ``_sock_lock`` only, and no thread ever blocks on that
  lock to send: frames go to ``_outbox``, and whoever holds the lock sends them
  (``_kick``); a reader that sleeps in ``poll`` holding it (``_polling``) is woken
  through ``_poll_pipe`` to do so. The outbox is FIFO, so a segment's ``register``
  goes out before the first request that uses it.
- At most one thread is the reader (``_reader``); it polls the socket itself (so
  no edge-triggered descriptor is involved) and completes futures with the lock
  released (their callbacks may call this client). A reader leaving hands the role
  to the I/O thread when replies are still awaited.
- A request's shared-memory blocks are freed once the server is done with them: at
  its reply, or at ``inputs_done`` when the reply said ``inputs_held``. A result
  block is not copied: the result is a view of it (below), and once that is
  collected the block waits in the session's ``released`` for the next message or
  heartbeat, which carries its ``release`` (a send of its own would wake other
  threads, which costs a caller its CPU on a busy machine). Every future is
  completed once (``runtime.core.futures.resolve``).

Shared-memory results (ipc://). A result tensor of at least 64 KiB comes back as a
*view* of the block the server wrote it into, in shared memory, not as a copy: a
numpy array (or ``torch.from_numpy`` of one, with ``tensor_type="torch"``) whose
``.base`` chain ends in that block. It is

- valid for as long as you hold it (or anything made from it: a slice, a
  reshape, a torch tensor): the server reuses the block only after this client
  sent its ``release``, which happens only once the last of those is collected.
  ``.copy()`` is not needed to keep a result; it stays valid after
  ``Client.close()``, after a lost connection, and after the server exits or is
  killed (the mapping goes with the last view, never before, so nothing dangles);
- writable: the block is yours until it is collected, and the server neither
  reads nor writes it meanwhile (writing into it changes nothing anywhere else);
- memory the server set aside for this client: unreleased result blocks of one
  client hold at most ``runtime.serving.shm.RESULT_SHM_LIMIT`` bytes (512 MiB), and
  past that the server sends results as frames, which are copied. Keeping many
  results for long (a dataset, say) is where ``.copy()`` (and dropping the view)
  helps: it gives the block back to the server at once.

Only this process's arrays count: a child forked while holding one shares the
block (``MAP_SHARED``), and sees it change once this process has dropped its own
arrays and the server reused it; such a child should keep a ``.copy()``.

A block is released once: its ``release`` rides with the next message to the
server, at the latest with the next heartbeat (``heartbeat_interval_s``). Views
of a session that is gone (closed, connection lost, server restarted) release
nothing: that server frees (or has freed) the whole session. Results sent as
frames (tcp://, ``shm=False``, small tensors) are copies the caller owns.

Failure. A lost connection (the socket monitor's DISCONNECTED, or no word from the
server for ``heartbeat_timeout_s`` while requests are in flight) fails those
requests with ``ConnectionLostError``; the socket reconnects by itself, and a
server restart (a new ``server_id``) starts a fresh shared-memory session.

One module for both clients: ``AsyncClient`` is a thin adapter over ``Client``'s
futures, and the two are the one public surface of this file.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.client.errors import (ConnectionLostError, DeadlineExceededError, InvalidRequestError,
                                   OverloadedError, PluginError, ServerError, ServerUnavailableError,
                                   error_from_reply)
from runtime.client.shm import ShmSession
from runtime.transport.endpoints import load_key
from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.transport.protocol import (DEFAULT_SHM_THRESHOLD, PROTOCOL_VERSION, PayloadEncoder, TensorResolver, numpy_tensor,
                              numpy_view, pack_header, torch_tensor, torch_view, unpack_header)
from runtime.transport.shm import sweep_stale
from runtime.transport.spin import budget_ns, spin
from runtime.transport.wake_pipe import WakePipe

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "InvalidRequestError",
    "OverloadedError", "PluginError", "ServerError", "ServerUnavailableError",
]

log = logging.getLogger("phyrt.client")

_IO_THREAD = "io"  # ``_reader`` when the I/O thread reads
_CANCELLED = object()  # marks the server's Cancelled reply in a list of completions
# plain ints: pyzmq's enum members cost microseconds in every ``|`` and call on the hot path
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
#: a submit header up to its id, and its other fields, as msgpack (built by hand: see _submit_header)
_SUBMIT_HEAD = b"\xa1v" + msgpack.packb(PROTOCOL_VERSION) + b"\xa2op\xa6submit\xa2id"
_TIMEOUT_KEY, _SHM_RESULTS, _PAYLOAD_KEY = msgpack.packb("timeout_s"), msgpack.packb("shm_results") + b"\xc3", \
    msgpack.packb("payload")
_RELEASE_KEY = msgpack.packb("release")
_CALL_LOCK = threading.Lock()  # completes _Calls (any thread may try; the first wins)


class _Call:
    """The future of a ``call()`` (and of ``ping``, ``info``, ``cancel``): lighter than a
    ``concurrent.futures.Future``, which nobody outside ever sees. Completed once, by
    whichever thread gets there first; waited on by its one caller."""

    __slots__ = ("request_id", "_state", "_value", "_waiter")
    _PENDING, _RESULT, _ERROR, _CANCEL = 0, 1, 2, 3

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._state = 0
        self._value: Any = None
        self._waiter: Any = None  # a held lock, released at completion, once the caller blocks on it

    def done(self) -> bool:
        return self._state != 0

    def cancelled(self) -> bool:
        return self._state == 3

    def _finish(self, state: int, value: Any) -> bool:
        with _CALL_LOCK:
            if self._state:
                return False
            self._state, self._value = state, value
            waiter = self._waiter
        if waiter is not None:
            waiter.release()
        return True

    def set_result(self, result: Any) -> None:
        if not self._finish(1, result):
            raise InvalidStateError("already completed")

    def set_exception(self, error: BaseException) -> None:
        if not self._finish(2, error):
            raise InvalidStateError("already completed")

    def cancel(self) -> bool:
        return self._finish(3, None) or self._state == 3

    def wait(self, timeout: float | None) -> bool:
        """Block until completed (True) or ``timeout`` passed (False)."""
        with _CALL_LOCK:
            if self._state:
                return True
            if self._waiter is None:
                self._waiter = threading.Lock()
                self._waiter.acquire()
            waiter = self._waiter
        return waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)) or self._state != 0

    def result(self) -> Any:
        if self._state == 1:
            return self._value
        if self._state == 2:
            raise self._value
        if self._state == 3:
            raise CancelledError()
        raise InvalidStateError("not completed")


class _Pending:
    __slots__ = ("future", "op", "sent_at", "blocks", "session", "released")

    def __init__(self, future: Any, op: str, sent_at: float, blocks: list[tuple[str, int]] | None = None,
                 session: ShmSession | None = None, released: list[list[Any]] | None = None) -> None:
        self.future = future
        self.op = op
        self.sent_at = sent_at
        self.blocks = blocks if blocks is not None else []
        self.session = session
        #: result blocks whose release rides in this submit's header (given back if it is not sent)
        self.released = released


class Client:
    """A thread-safe connection to a phyrt server.

    ``submit`` returns a ``concurrent.futures.Future`` at once and never waits on the
    network, so it is safe inside a ROS callback. Results hold numpy arrays, or torch
    tensors with ``tensor_type="torch"``. ``shm`` (default: on for ipc://) sends
    tensors of at least ``shm_threshold`` bytes through shared memory, and large
    results come back as views of shared memory, valid until collected (see the
    module's docstring). CURVE:
    ``server_public_key`` plus this client's ``public_key``/``secret_key`` (z85 text
    or key files); without them the client speaks plain ZMQ.
    """

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
        self._make = torch_tensor if tensor_type == "torch" else numpy_tensor
        self._make_shm = torch_view if tensor_type == "torch" else numpy_view
        self._shm = address.startswith("ipc://") and shm is not False
        self._shm_threshold = shm_threshold
        self._hb_interval = heartbeat_interval_s
        # a caller waiting for its answer polls a moment before sleeping (runtime.transport.spin)
        self._spin_budget = budget_ns("client")
        self._hb_timeout = heartbeat_timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()  # pending, held, awaited, the reader, closed
        self._reader_left = threading.Condition(self._lock)
        self._sock_lock = threading.Lock()  # the socket (see the module's invariants)
        self._shm_lock = threading.Lock()  # the session and its arena
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, tuple[ShmSession, list[tuple[str, int]]]] = {}
        self._awaited: dict[str, float] = {}  # replies without a future ("heartbeat", "register"): sent at
        # (request id or None, frames) for the server, in order
        self._outbox: collections.deque[tuple[int | None, list[Any]]] = collections.deque()
        self._polling = False  # the holder of the socket sleeps in poll (wake it to send)
        self._reader: Any = None  # _IO_THREAD, the ident of a caller thread, or None
        self._session: ShmSession | None = None
        self._server_id: str | None = None
        self._last_heard = time.monotonic()
        self._closed = False
        self._broken: str | None = None  # why the I/O thread died, if it did
        if self._shm:
            sweep_stale()  # names left by phyrt processes that were killed

        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket | None = None
        self._sock_open = False
        success = False
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)  # replies are never dropped on this side
            self._sock.setsockopt(zmq.SNDHWM, 100_000)
            self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if server_public_key is not None:
                self._sock.curve_serverkey = load_key(server_public_key, secret=False)
                own_secret = load_key(secret_key, secret=True)
                if own_secret is None:
                    raise ValueError("CURVE needs this client's secret_key too (public_key is derived from it)")
                self._sock.curve_secretkey = own_secret
                self._sock.curve_publickey = load_key(public_key, secret=False) or zmq.curve_public(own_secret)
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            self._sock.connect(address)
            success = True
        finally:
            if not success:
                if self._monitor is not None:
                    self._monitor.close(0)
                self._sock.close(0)
                self._ctx.term()
        self._sock_open = True
        self._wake_pipe = WakePipe()  # wakes the I/O thread
        self._poll_pipe = WakePipe()  # wakes the reader polling with the socket held
        self._reader_poller = zmq.Poller()  # the reading caller's (one at a time)
        self._reader_poller.register(self._sock, zmq.POLLIN)
        self._reader_poller.register(self._poll_pipe.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="phyrt-client", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None) -> Future:
        """Send one request; the Future gets the result, or a ``ServerError`` subclass.

        ``timeout`` (seconds) is the request's deadline on the server: past it the
        Future fails with ``DeadlineExceededError``. ``future.cancel()`` also asks
        the server to drop the request if it is still queued.
        """
        future: Future = Future()
        self._submit(payload, timeout, future)
        future.add_done_callback(self._on_future_done)
        self._need_reader()
        return future

    def call(self, payload: Any, timeout: float | None = None) -> Any:
        """``submit(payload, timeout=timeout).result(timeout)``; raises DeadlineExceededError on time-out."""
        future = self._submit(payload, timeout, None, kick=False)  # sent by _wait (as the reader) or a kick
        if self._wait(future, timeout) or future.done():
            return future.result()
        if future.cancel():
            self._cancel_in_flight(future.request_id)
        elif not future.cancelled():
            return future.result()
        raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                future.request_id) from None

    def cancel(self, future: Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a submitted request; True if it was still queued and is dropped."""
        request_id = getattr(future, "request_id", None)
        if request_id is None:
            raise ValueError("not a future returned by this client's submit()")
        reply = self._result(self._control("cancel", None, target=request_id), timeout)
        return bool(reply.get("cancelled")) if isinstance(reply, dict) else False

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to the server's I/O thread, in seconds."""
        started = time.monotonic()
        self._result(self._control("ping", None), timeout)
        return time.monotonic() - started

    def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's plugin, topology, replicas (health, in flight) and versions."""
        return self._result(self._control("info", None), timeout)

    def close(self) -> None:
        """Fail what is in flight, stop the I/O thread, release sockets and segments. Idempotent.

        Shared-memory results already returned stay valid (their mappings go with them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
            if self._reader == threading.get_ident():  # closed from a callback of the reading caller
                self._reader = None
        self._wake()
        self._poll_pipe.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(10)
        for p in pending.values():
            resolve(p.future, error=ConnectionLostError(f"the client of {self.address} was closed"))
        with self._shm_lock:
            if self._session is not None:
                self._session.close()
                self._session = None
        if not self._thread.is_alive():
            self._wake_pipe.close()
            self._poll_pipe.close()
            self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLostError(f"the client of {self.address} is closed")

    def _submit(self, payload: Any, timeout: float | None, future: Future | None, kick: bool = True) -> Any:
        """Encode and send a submit; ``future``, or a new ``_Call`` when None. ``kick=False``: queue
        it only (the caller then ``_wait``s, which sends it)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self._check_open()
        request_id = next(self._ids)
        session = self._session
        place = None if session is None else functools.partial(self._place, session)
        # frames stay views of the caller's arrays: _send has zmq copy them at once, or snapshots them
        encoder = PayloadEncoder(copy=False, place=place, shm_threshold=self._shm_threshold)
        try:
            packed = encoder.pack(payload)
        except BaseException:
            if session is not None:
                session.free(encoder.blocks)
            raise
        # dropped results' blocks ride in the header: one message for the server to read, not two
        released = session.take_released() if session is not None and session.released else None
        header = _submit_header(request_id, timeout, session is not None and session.result_mapper is not None,
                                packed.data, released)
        if future is None:
            future = _Call(request_id)
        else:
            future.request_id = request_id  # type: ignore[attr-defined]  # for Client.cancel
        self._send(request_id, _Pending(future, "submit", time.monotonic(), encoder.blocks, session, released),
                   [header, *encoder.frames] if encoder.frames else [header], kick)
        return future

    def _control(self, op: str, future: Future | None, **fields: Any) -> Any:
        """Send a control op; ``future`` (then the I/O thread reads its reply), or a new ``_Call``."""
        self._check_open()
        request_id = next(self._ids)
        call = _Call(request_id) if future is None else future
        self._send(request_id, _Pending(call, op, time.monotonic()),
                   [pack_header({"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})], future is not None)
        if future is not None:
            self._need_reader()
        return call

    def _result(self, call: _Call, timeout: float | None) -> Any:
        if not self._wait(call, timeout) and not call.done():
            raise FutureTimeoutError()
        return call.result()

    def _send(self, request_id: int, pending: _Pending, frames: list[Any], kick: bool = True) -> None:
        with self._lock:
            if self._closed or self._broken:
                if pending.session is not None:
                    pending.session.free(pending.blocks)
                raise ConnectionLostError(f"the client of {self.address} is {self._broken or 'closed'}")
            self._pending[request_id] = pending
        if len(frames) > 1:  # tensor frames view the caller's arrays: send them now, or send a snapshot later
            if self._sock_lock.acquire(False):
                failed: list = []
                try:
                    self._outbox.append((request_id, frames))
                    self._flush(failed)  # zmq copies each frame as it is queued
                finally:
                    self._sock_lock.release()
                if failed:
                    self._complete(failed)
                if self._outbox:  # queued by others meanwhile
                    self._kick()
                return
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        self._outbox.append((request_id, frames))
        if kick:
            self._kick()

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of our arena for a request tensor; registers a new segment before its first use."""
        with self._shm_lock:
            if session is not self._session or not session.usable:
                return None
            segment, offset, view, new = session.place(nbytes)
            if new:  # queued under the shm lock: no request using this segment can be queued before it
                self._outbox.append((None, [_register_header(session, [segment])]))
            return segment, offset, view

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled() and not self._closed:
            self._cancel_in_flight(future.request_id)  # type: ignore[attr-defined]

    def _cancel_in_flight(self, request_id: int) -> None:
        if request_id in self._pending:  # still in flight: ask the server to drop it
            self._outbox.append((None, [pack_header({"v": PROTOCOL_VERSION, "op": "cancel", "id": "cancel",
                                                     "target": request_id})]))
            self._kick()

    def _wake(self) -> None:
        self._wake_pipe.wake()  # a no-op once close() gave the descriptors back

    # -- the socket: one holder at a time ---------------------------------------------

    def _kick(self) -> None:
        """Send what is queued, unless another thread holds the socket: then that one sends it."""
        lock = self._sock_lock
        while self._outbox:
            if not lock.acquire(False):
                if self._polling:  # it sleeps in poll: wake it (otherwise it looks before it lets go)
                    self._poll_pipe.wake()
                return
            failed: list = []
            try:
                self._flush(failed)
            finally:
                lock.release()
            if failed:
                self._complete(failed)

    def _flush(self, failed: list) -> None:
        """Holding the socket: send the releases that wait for a ride, then the outbox; the futures
        of what could not go into ``failed``."""
        sock = self._sock
        # releases first: a server runs a request in the thread that read it only if no message
        # came after it (one that did must not wait for it), and a release needs no answer
        session = self._session
        while session is not None and session.released and self._sock_open and self._outbox:
            blocks = session.take_released()
            if not blocks:
                break
            try:
                sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release", "blocks": blocks}),
                          _NOBLOCK)
            except zmq.Again:  # the queue is full: they ride with a later message
                session.released.extendleft(tuple(b) for b in reversed(blocks))
                break
            except zmq.ZMQError as exc:
                log.warning("dropped a release of result blocks to %s: %s", self.address, exc)
        while self._outbox:
            request_id, frames = self._outbox.popleft()
            if not self._sock_open:
                continue  # closed: close() fails what is in flight
            try:
                if len(frames) == 1:
                    sock.send(frames[0], _NOBLOCK)
                else:
                    sock.send_multipart(frames, _NOBLOCK)
                continue
            except zmq.Again:
                reason = "the send queue to the server is full (is it reachable?)"
            except zmq.ZMQError as exc:
                reason = f"the message could not be sent ({exc})"
            if request_id is None:
                log.warning("dropped a message to %s: %s", self.address, reason)
                continue
            with self._lock:
                p = self._pending.pop(request_id, None)
            if p is not None:
                if p.session is not None:
                    p.session.free(p.blocks)
                    if p.released:  # their release rides with a later message
                        p.session.released.extendleft((b[0], b[1]) for b in reversed(p.released))
                failed.append((p.future, None, ConnectionLostError.for_request(f"{reason}: {self.address}",
                                                                               request_id)))

    def _poll(self, poller: zmq.Poller, timeout_s: float, done: list, spin_budget: int = 0) -> dict:
        """Holding the socket: send what is queued, wait up to ``timeout_s`` for a message and read it
        (polling for ``spin_budget`` ns before sleeping: ``runtime.transport.spin``)."""
        self._polling = True
        try:
            if self._outbox:
                self._flush(done)
            events = None
            if spin_budget and timeout_s > 0 and not done:
                events = dict(spin(functools.partial(poller.poll, 0), spin_budget))
            if not events:
                events = dict(poller.poll(int(timeout_s * 1000) + 1 if timeout_s > 0 and not done else 0))
        finally:
            self._polling = False
        if self._poll_pipe.fd in events:
            self._poll_pipe.drain()
        if self._sock in events:
            self._read_one(done)
        return events

    def _read_one(self, done: list) -> None:
        sock = self._sock
        head = sock.recv(_NOBLOCK, copy=False)  # a Frame knows in C whether parts follow
        frames = []
        more = head.more
        while more:  # the parts of a message arrive together
            frame = sock.recv(copy=False)
            frames.append(frame)
            more = frame.more
        self._last_heard = time.monotonic()
        try:
            self._handle_reply(head.bytes, frames, done)
        except ProtocolError as exc:
            log.warning("dropped a malformed reply from %s: %s", self.address, exc)
        except Exception:  # a bug must not lose the replies after this one
            log.exception("failed to handle a reply from %s", self.address)

    def _complete(self, done: list[tuple[Any, Any, Any]]) -> None:
        """Complete futures (without the socket: their callbacks may call this client)."""
        for future, result, error in done:
            if error is _CANCELLED:
                if not future.cancel():
                    resolve(future, error=ServerError.for_request(f"Cancelled: {result}",
                                                                  getattr(future, "request_id", None)))
            else:
                resolve(future, result, error)

    # -- reading: whoever is the reader -----------------------------------------------

    def _need_reader(self) -> None:
        """Replies are awaited: wake the I/O thread to read them unless a thread reads already."""
        if self._reader is None:
            self._wake()

    def _wait(self, future: Any, timeout: float | None) -> bool:
        """Wait until ``future`` is done (True) or ``timeout`` passed (False), reading if no one else does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        while not future.done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            with self._lock:
                read = self._reader is None and not self._closed
                if read:
                    self._reader = me
            if not read:  # another thread reads: it, or the I/O thread after it, completes our future
                if self._outbox:
                    self._kick()
                if isinstance(future, _Call):
                    future.wait(remaining)
                else:
                    try:
                        future.exception(remaining)
                    except (FutureTimeoutError, CancelledError):
                        pass
                continue
            try:
                self._read_until(future, deadline)
            finally:
                self._leave_reader(wake_io=True)
        return True

    def _read_until(self, future: Any, deadline: float | None) -> None:
        lock, poller = self._sock_lock, self._reader_poller
        lock.acquire()
        held = True
        try:
            while not future.done() and not self._closed and self._sock_open:
                wait = self._hb_interval
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return
                done: list = []
                self._poll(poller, wait, done, self._spin_budget)
                if done:
                    lock.release()
                    held = False
                    self._complete(done)
                    if future.done():
                        return
                    lock.acquire()
                    held = True
        finally:
            if held:
                lock.release()
            if self._outbox:  # queued while we held the socket, after our last look
                self._kick()

    def _leave_reader(self, wake_io: bool) -> None:
        with self._lock:
            if self._reader != threading.get_ident() and self._reader != _IO_THREAD:
                return  # close() took the role from us
            self._reader = None
            wake_io = wake_io and self._awaiting()
            if self._closed:  # the I/O thread waits for the socket's last reader before closing it
                self._reader_left.notify_all()
        if wake_io:
            self._wake()

    def _awaiting(self) -> bool:
        """Under ``_lock``: some reply is still expected."""
        return bool(self._pending or self._held or self._awaited)

    # -- the I/O thread -------------------------------------------------------------

    def _run(self) -> None:
        idle = zmq.Poller()
        idle.register(self._wake_pipe.fd, zmq.POLLIN)
        idle.register(self._monitor, zmq.POLLIN)
        reading = zmq.Poller()
        reading.register(self._sock, zmq.POLLIN)
        reading.register(self._poll_pipe.fd, zmq.POLLIN)
        reading.register(self._wake_pipe.fd, zmq.POLLIN)
        reading.register(self._monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._closed:
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(now)
                    next_beat = now + self._hb_interval
                with self._lock:
                    read = self._reader is None and self._awaiting() and not self._closed
                    if read:
                        self._reader = _IO_THREAD
                wait = max(0.0, next_beat - time.monotonic())
                if read:
                    done: list = []
                    try:
                        with self._sock_lock:
                            events = self._poll(reading, wait, done) if self._sock_open else {}
                    finally:
                        self._leave_reader(wake_io=False)
                    self._complete(done)
                else:
                    events = dict(idle.poll(int(wait * 1000) + 1))
                if self._wake_pipe.fd in events:
                    self._wake_pipe.drain()
                if self._outbox:
                    self._kick()
                if self._monitor in events:
                    self._drain_monitor()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("the client's I/O thread failed")
            self._broken = f"the client's I/O thread failed: {exc!r}"
            done = []
            self._connection_lost(self._broken, done)
            self._complete(done)
        finally:
            with self._lock:  # a caller still reading lets go at once (close() woke it)
                self._reader_left.wait_for(lambda: self._reader is None or self._reader == _IO_THREAD, 2.0)
            with self._sock_lock:
                self._sock_open = False
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._sock.close(0)

    def _heartbeat(self, now: float) -> None:
        with self._lock:
            self._awaited = {k: t for k, t in self._awaited.items() if now - t <= self._hb_timeout}
            self._awaited.setdefault("heartbeat", now)
        self._outbox.append((None, [pack_header({"v": PROTOCOL_VERSION, "op": "ping", "id": "heartbeat"})]))
        self._kick()
        with self._lock:
            silent = [(i, p) for i, p in self._pending.items()
                      if now - max(p.sent_at, self._last_heard) > self._hb_timeout]
            for request_id, p in silent:
                del self._pending[request_id]
                if p.blocks and p.session is not None:  # the server may still read them: wait for its word
                    self._held[request_id] = (p.session, p.blocks)
        self._complete([(p.future, None, ConnectionLostError.for_request(
            f"no word from the server at {self.address} for more than {self._hb_timeout} s "
            f"(heartbeat_timeout_s) while request {request_id} was in flight", request_id))
            for request_id, p in silent])

    # -- replies (by the reader, holding the socket) --------------------------------------

    def _handle_reply(self, head: bytes, frames: list[zmq.Frame], done: list) -> None:
        refs: list = []
        header = unpack_header(head, 1 << 30, refs)
        op, request_id = header.get("op"), header.get("id")
        if op == "ping" and not isinstance(request_id, int):
            if request_id == "heartbeat":
                with self._lock:
                    self._awaited.pop("heartbeat", None)
            if header.get("ok") and isinstance(header.get("result"), dict):
                self._on_server_id(header["result"].get("server_id"), done)
            return
        if op == "register":
            with self._lock:
                self._awaited.pop("register", None)
            self._on_registered(header)
            return
        if op == "inputs_done":
            with self._lock:
                held = self._held.pop(request_id, None)
            if held is not None:
                held[0].free(held[1])
            return
        with self._lock:
            p = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        try:
            self._answer(header, p, bool(refs), frames, done)
        except Exception as exc:  # a bug here must not leave the request's caller waiting
            if p is not None:
                done.append((p.future, None, ServerError.for_request(
                    f"the reply could not be read: {type(exc).__name__}: {exc}", request_id)))
            raise

    def _answer(self, header: dict[str, Any], p: _Pending | None, refs: bool, frames: list[zmq.Frame],
                done: list) -> None:
        """The reply to a request of ours (``p``; None: failed here already) into ``done``."""
        op, request_id = header.get("op"), header.get("id")
        if op == "ping" and p is not None and header.get("ok") and isinstance(header.get("result"), dict):
            self._on_server_id(header["result"].get("server_id"), done)
        result, error = header.get("result"), None
        if refs or frames:
            session = self._session
            # shared-memory results are views of their blocks: each block is released (see
            # ShmSession.result_view) once the caller's arrays over it are collected
            resolver = TensorResolver(frames, self._make, session.result_view if session is not None else None,
                                      self._make_shm)
            try:
                result = resolver.resolve(result)
                resolver.finish()
            except ProtocolError as exc:  # no traceback: its frames would keep the views made so far alive
                result, error = None, exc.with_traceback(None)
        if p is None:  # failed here already; free its inputs once the server is done with them
            if isinstance(request_id, int):
                with self._lock:
                    held = self._held.pop(request_id, None)
                    if held is not None and header.get("inputs_held") is True:
                        self._held[request_id] = held
                        held = None
                if held is not None:
                    held[0].free(held[1])
            return
        if p.blocks and p.session is not None:
            if header.get("inputs_held") is True:
                with self._lock:
                    self._held[request_id] = (p.session, p.blocks)
            else:
                p.session.free(p.blocks)
        if error is None and header.get("ok") is not True:
            err = header.get("error")
            if isinstance(err, dict) and err.get("type") == "Cancelled":
                done.append((p.future, err.get("message"), _CANCELLED))
                return
            error = error_from_reply(err, request_id)
        done.append((p.future, result, error))

    def _on_server_id(self, server_id: Any, done: list) -> None:
        if not isinstance(server_id, str) or server_id == self._server_id:
            return
        if self._server_id is not None:
            self._connection_lost(f"the server at {self.address} restarted", done)
        self._server_id = server_id
        if self._shm:
            with self._shm_lock:
                self._session = ShmSession(server_id)
                with self._lock:
                    self._awaited["register"] = time.monotonic()
                self._sock.send(_register_header(self._session, [], pid=os.getpid()), _NOBLOCK)

    def _on_registered(self, header: dict[str, Any]) -> None:
        result = header.get("result")
        with self._shm_lock:
            session = self._session
            if session is None or not isinstance(result, dict) or result.get("run_id") != session.run_id:
                if session is not None and header.get("ok") is not True:
                    session.refused = True
                    log.warning("the server at %s refused shared memory (%s); tensors go as frames",
                                self.address, header.get("error"))
                return
            session.on_registered(result)

    # -- the connection (I/O thread, or a reader) -----------------------------------------

    def _drain_monitor(self) -> None:
        done: list = []
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._connection_lost(f"the connection to the server at {self.address} was lost", done)
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                log.warning("handshake with %s failed (CURVE keys?): event %s", self.address, kind)
        self._complete(done)

    def _connection_lost(self, reason: str, done: list) -> None:
        """Fail every request in flight (into ``done``) and drop the shared-memory session."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._held.clear()
            self._awaited.clear()
        with self._shm_lock:
            session, self._session = self._session, None
        self._server_id = None
        for request_id, p in pending.items():
            done.append((p.future, None, ConnectionLostError.for_request(
                f"{reason} while request {request_id} was in flight (the client reconnects by itself; "
                "send it again)", request_id)))
        if session is not None:
            session.close()
            sweep_stale()  # the server's unreleased result segments, if it was killed


def _submit_header(request_id: int, timeout: float | None, shm_results: bool, payload: bytes,
                   release: list[list[Any]] | None = None) -> bytes:
    """``pack_header`` of a submit, built by hand: the same bytes, a few microseconds sooner."""
    fields = 4 + (timeout is not None) + shm_results + bool(release)
    parts = [bytes((0x80 | fields,)), _SUBMIT_HEAD, msgpack.packb(request_id)]
    if timeout is not None:
        parts += (_TIMEOUT_KEY, msgpack.packb(float(timeout)))
    if shm_results:
        parts.append(_SHM_RESULTS)
    if release:
        parts += (_RELEASE_KEY, msgpack.packb(release))
    parts += (_PAYLOAD_KEY, payload)
    return b"".join(parts)


def _register_header(session: ShmSession, segments: list[str], **extra: Any) -> bytes:
    return pack_header({"v": PROTOCOL_VERSION, "op": "register", "id": "register", "run_id": session.run_id,
                        "segments": segments, **extra})


class AsyncClient:
    """``Client`` for asyncio: the same verbs, awaitable. Takes ``Client``'s keyword arguments.

    Cancelling an awaited ``submit`` also asks the server to drop the request if it
    is still queued.
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._client = Client(address, **kwargs)
        self.address = address
        self._sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def submit(self, payload: Any, *, timeout: float | None = None) -> asyncio.Future:
        """Send one request from the running loop; await the returned future for the result."""
        source = self._client.submit(payload, timeout=timeout)
        future = asyncio.wrap_future(source)
        self._sources[future] = source
        return future

    async def call(self, payload: Any, timeout: float | None = None) -> Any:
        future = self._client.submit(payload, timeout=timeout)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except DeadlineExceededError:
            raise
        except asyncio.TimeoutError:
            raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                    future.request_id) from None  # type: ignore[attr-defined]

    async def cancel(self, future: asyncio.Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a request from ``submit``; True if it was still queued."""
        source = self._sources.get(future)
        if source is None:
            raise ValueError("cancel() takes a future returned by this AsyncClient's submit()")
        return await asyncio.to_thread(self._client.cancel, source, timeout)

    async def ping(self, timeout: float = 5.0) -> float:
        started = time.monotonic()
        await asyncio.wait_for(asyncio.wrap_future(self._client._control("ping", Future())), timeout)
        return time.monotonic() - started

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.wrap_future(self._client._control("info", Future())), timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
