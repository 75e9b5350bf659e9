"""The light client of ``runtime.server``: ``Client`` (threads) and ``AsyncClient`` (asyncio).

Needs pyzmq, msgpack and numpy only: torch is used when the caller hands in torch
tensors or asks for torch results, never imported here otherwise. The wire, the
ops and the shared-memory protocol are described in ``runtime.protocol``; the
errors are in ``runtime.client_errors`` (and importable from here).

    caller threads                      I/O thread (owns the DEALER)              server (ROUTER)
    submit(payload) -> Future
      encode: tensors -> frames | shm
      pending[id] = Future
      outbox.append(frames); wake ----> send ------ [header, *tensor frames] ---->
    Future.set_result / set_exception <- recv <----- [header, *tensor frames] -----
                                        "ping" every heartbeat_interval_s
                                        socket monitor: DISCONNECTED -> in-flight fail

Invariants: only the I/O thread touches the socket; callers hand it frames through
the outbox and the wake pipe. A request's shared-memory blocks are freed once the
server is done with them: at its reply, or at ``inputs_done`` when the reply said
``inputs_held``. Every Future is completed once (``runtime.futures.resolve``).

Failure. A lost connection (the socket monitor's DISCONNECTED, or no word from the
server for ``heartbeat_timeout_s`` while requests are in flight) fails those
requests with ``ConnectionLostError``; the socket reconnects by itself, and a
server restart (a new ``server_id``) starts a fresh shared-memory session.

One module for both clients: ``AsyncClient`` is a thin adapter over ``Client``'s
I/O thread and futures, and the two are the one public surface of this file.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.client_errors import (ConnectionLostError, DeadlineExceededError, InvalidRequestError,
                                   OverloadedError, PluginError, ServerError, ServerUnavailableError,
                                   error_from_reply)
from runtime.client_shm import ShmSession
from runtime.endpoints import load_key
from runtime.errors import ProtocolError
from runtime.futures import resolve
from runtime.protocol import (DEFAULT_SHM_THRESHOLD, PROTOCOL_VERSION, PayloadEncoder, TensorResolver, numpy_tensor,
                              pack_header, torch_tensor, unpack_header)
from runtime.shm import sweep_stale
from runtime.wake_pipe import WakePipe

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "InvalidRequestError",
    "OverloadedError", "PluginError", "ServerError", "ServerUnavailableError",
]

log = logging.getLogger("phyrt.client")


@dataclass
class _Pending:
    future: Future
    op: str
    sent_at: float
    blocks: list[tuple[str, int]] = field(default_factory=list)
    session: "ShmSession | None" = None


class Client:
    """A thread-safe connection to a phyrt server.

    ``submit`` returns a ``concurrent.futures.Future`` at once and never waits on the
    network, so it is safe inside a ROS callback. Results hold numpy arrays, or torch
    tensors with ``tensor_type="torch"``. ``shm`` (default: on for ipc://) sends
    tensors of at least ``shm_threshold`` bytes through shared memory. CURVE:
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
        self._shm = address.startswith("ipc://") and shm is not False
        self._shm_threshold = shm_threshold
        self._hb_interval = heartbeat_interval_s
        self._hb_timeout = heartbeat_timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()  # pending, outbox order, closed
        self._shm_lock = threading.Lock()  # the session and its arena
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, tuple[ShmSession, list[tuple[str, int]]]] = {}
        self._outbox: collections.deque[list[Any]] = collections.deque()
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
        self._wake_pipe = WakePipe()
        self._thread = threading.Thread(target=self._run, name="phyrt-client", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None) -> Future:
        """Send one request; the Future gets the result, or a ``ServerError`` subclass.

        ``timeout`` (seconds) is the request's deadline on the server: past it the
        Future fails with ``DeadlineExceededError``. ``future.cancel()`` also asks
        the server to drop the request if it is still queued.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self._check_open()
        request_id = next(self._ids)
        session = self._session
        place = None if session is None else (lambda nbytes: self._place(session, nbytes))
        encoder = PayloadEncoder(copy=True, place=place, shm_threshold=self._shm_threshold)
        try:
            header = {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "payload": encoder.encode(payload)}
        except BaseException:
            if session is not None:
                session.free(encoder.blocks)
            raise
        if timeout is not None:
            header["timeout_s"] = float(timeout)
        if session is not None and session.result_mapper is not None:
            header["shm_results"] = True
        future: Future = Future()
        future.request_id = request_id  # type: ignore[attr-defined]  # for Client.cancel
        self._send(request_id, _Pending(future, "submit", time.monotonic(), encoder.blocks, session),
                   [pack_header(header), *encoder.frames])
        future.add_done_callback(self._on_future_done)
        return future

    def call(self, payload: Any, timeout: float | None = None) -> Any:
        """``submit(payload, timeout=timeout).result(timeout)``; raises DeadlineExceededError on time-out."""
        future = self.submit(payload, timeout=timeout)
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            if future.done() and not future.cancelled():
                return future.result()
            future.cancel()
            raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                    future.request_id) from None  # type: ignore[attr-defined]

    def cancel(self, future: Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a submitted request; True if it was still queued and is dropped."""
        request_id = getattr(future, "request_id", None)
        if request_id is None:
            raise ValueError("not a future returned by this client's submit()")
        reply = self._control("cancel", target=request_id).result(timeout)
        return bool(reply.get("cancelled")) if isinstance(reply, dict) else False

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to the server's I/O thread, in seconds."""
        started = time.monotonic()
        self._control("ping").result(timeout)
        return time.monotonic() - started

    def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's plugin, topology, replicas (health, in flight) and versions."""
        return self._control("info").result(timeout)

    def close(self) -> None:
        """Fail what is in flight, stop the I/O thread, release sockets and segments. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
        self._wake()
        self._thread.join(10)
        for p in pending.values():
            resolve(p.future, error=ConnectionLostError(f"the client of {self.address} was closed"))
        with self._shm_lock:
            if self._session is not None:
                self._session.close()
                self._session = None
        self._wake_pipe.close()
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLostError(f"the client of {self.address} is closed")

    def _control(self, op: str, **fields: Any) -> Future:
        self._check_open()
        request_id = next(self._ids)
        future: Future = Future()
        self._send(request_id, _Pending(future, op, time.monotonic()),
                   [pack_header({"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})])
        return future

    def _send(self, request_id: int, pending: _Pending, frames: list[Any]) -> None:
        with self._lock:
            if self._closed or self._broken:
                if pending.session is not None:
                    pending.session.free(pending.blocks)
                raise ConnectionLostError(f"the client of {self.address} is {self._broken or 'closed'}")
            self._pending[request_id] = pending
            self._outbox.append(frames)
        self._wake()

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of our arena for a request tensor; registers a new segment before its first use."""
        with self._shm_lock:
            if session is not self._session or not session.usable:
                return None
            segment, offset, view, new = session.place(nbytes)
            if new:  # queued under the shm lock: no request using this segment can be queued before it
                self._outbox.append([_register_header(session, [segment])])
            return segment, offset, view

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled() and not self._closed:
            request_id = future.request_id  # type: ignore[attr-defined]
            if request_id in self._pending:  # still in flight: ask the server to drop it
                self._outbox.append([pack_header({"v": PROTOCOL_VERSION, "op": "cancel", "id": "cancel",
                                                  "target": request_id})])
                self._wake()

    def _wake(self) -> None:
        self._wake_pipe.wake()  # a no-op once close() gave the descriptors back

    # -- the I/O thread -------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_pipe.fd, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._closed:
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(now)
                    next_beat = now + self._hb_interval
                events = dict(poller.poll(max(0.0, next_beat - now) * 1000 + 1))
                if self._wake_pipe.fd in events:
                    self._wake_pipe.drain()
                self._flush_outbox()
                if self._sock in events:
                    self._drain_replies()
                if self._monitor in events:
                    self._drain_monitor()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("the client's I/O thread failed")
            self._broken = f"the client's I/O thread failed: {exc!r}"
            self._connection_lost(self._broken)
        finally:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    def _flush_outbox(self) -> None:
        while self._outbox:
            frames = self._outbox.popleft()
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._fail_unsent(frames, "the send queue to the server is full (is it reachable?)")

    def _fail_unsent(self, frames: list[Any], reason: str) -> None:
        try:
            request_id = unpack_header(frames[0], 1 << 30).get("id")
        except ProtocolError:
            return
        with self._lock:
            p = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if p is not None:
            if p.session is not None:
                p.session.free(p.blocks)
            resolve(p.future, error=ConnectionLostError.for_request(f"{reason}: {self.address}", request_id))

    def _heartbeat(self, now: float) -> None:
        try:
            self._sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "ping", "id": "heartbeat"}), zmq.NOBLOCK)
        except zmq.Again:
            pass
        with self._lock:
            silent = [(i, p) for i, p in self._pending.items()
                      if now - max(p.sent_at, self._last_heard) > self._hb_timeout]
            for request_id, _ in silent:
                del self._pending[request_id]
        for request_id, p in silent:
            if p.blocks and p.session is not None:  # the server may still read them: wait for its word
                self._held[request_id] = (p.session, p.blocks)
            resolve(p.future, error=ConnectionLostError.for_request(
                f"no word from the server at {self.address} for more than {self._hb_timeout} s "
                f"(heartbeat_timeout_s) while request {request_id} was in flight", request_id))

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                self._handle_reply(frames)
            except ProtocolError as exc:
                log.warning("dropped a malformed reply from %s: %s", self.address, exc)

    def _handle_reply(self, frames: list[zmq.Frame]) -> None:
        header = unpack_header(frames[0].buffer, 1 << 30)
        op, request_id = header.get("op"), header.get("id")
        if op == "ping" and header.get("ok") and isinstance(header.get("result"), dict):
            self._on_server_id(header["result"].get("server_id"))
        if op == "register":
            self._on_registered(header)
            return
        if op == "inputs_done":
            held = self._held.pop(request_id, None)
            if held is not None:
                held[0].free(held[1])
            return
        with self._lock:
            p = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        session = self._session
        resolver = TensorResolver(frames[1:], self._make, session.result_view if session is not None else None)
        try:
            result = resolver.resolve(header.get("result"))
            resolver.finish()
        except ProtocolError as exc:
            result, error = None, exc
        else:
            error = None
        if resolver.shm_blocks:  # copied out: the server may reuse them, and unlink a segment we mapped
            self._sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release",
                                         "blocks": [list(b) for b in resolver.shm_blocks]}), zmq.NOBLOCK)
        if p is None:  # failed here already; free its inputs once the server is done with them
            held = self._held.pop(request_id, None) if isinstance(request_id, int) else None
            if held is not None and header.get("inputs_held") is True:
                self._held[request_id] = held
            elif held is not None:
                held[0].free(held[1])
            return
        if p.blocks and p.session is not None:
            if header.get("inputs_held") is True:
                self._held[request_id] = (p.session, p.blocks)
            else:
                p.session.free(p.blocks)
        if error is None and header.get("ok") is not True:
            err = header.get("error")
            if isinstance(err, dict) and err.get("type") == "Cancelled":
                if not p.future.cancel():
                    resolve(p.future, error=ServerError.for_request(f"Cancelled: {err.get('message')}", request_id))
                return
            error = error_from_reply(err, request_id)
        resolve(p.future, result=result, error=error)

    def _on_server_id(self, server_id: Any) -> None:
        if not isinstance(server_id, str) or server_id == self._server_id:
            return
        if self._server_id is not None:
            self._connection_lost(f"the server at {self.address} restarted")
        self._server_id = server_id
        if self._shm:
            with self._shm_lock:
                self._session = ShmSession(server_id)
                self._sock.send(_register_header(self._session, [], pid=os.getpid()), zmq.NOBLOCK)

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

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._connection_lost(f"the connection to the server at {self.address} was lost")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                log.warning("handshake with %s failed (CURVE keys?): event %s", self.address, kind)

    def _connection_lost(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        with self._shm_lock:
            session, self._session = self._session, None
        self._server_id = None
        self._held.clear()
        for request_id, p in pending.items():
            resolve(p.future, error=ConnectionLostError.for_request(
                f"{reason} while request {request_id} was in flight (the client reconnects by itself; "
                "send it again)", request_id))
        if session is not None:
            session.close()
            sweep_stale()  # the server's unreleased result segments, if it was killed


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
        await asyncio.wait_for(asyncio.wrap_future(self._client._control("ping")), timeout)
        return time.monotonic() - started

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.wrap_future(self._client._control("info")), timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
