"""What a client awaits from its server, and what each reply does: ``Replies``.

Torch-free: imports the client's errors and shm session, ``runtime.link.client_protocol``, the protocol.
``handle`` runs in the reader, holding the socket (``runtime.client.connection``); the
futures it answers go into a ``done`` list that ``complete`` resolves once the socket
and every lock are released (their callbacks may call the client again).

    Client._send: add(id, Pending) ---------> pending[id]           (under ``lock``)
    reader: handle(header, frames, done)
      a stream's chunk (pending[id] stays) -> decode -> done, for its StreamState (``seq`` checked)
      a reply to pending[id] --------------> decode (frames, shm result views) -> done;
                                             its shm inputs: freed, or held[id] when
                                             the reply says ``inputs_held``
      inputs_done(id) ---------------------> held[id] freed
      ping (any): a new server_id ---------> everything in flight fails; a new ShmSession,
                                             whose register handle() returns, to go out at once
      register ----------------------------> session.on_registered (or refused: frames)
    I/O thread: heartbeat(now) ------------> requests silent past heartbeat_timeout_s fail
    monitor (runtime.client.handshake): connection_lost(reason, done) after a handshake;
      refuse(message, permanent, done) when the server refused it, served() once one succeeds
    I/O thread failure: connection_lost(reason, done)

Invariants:
- ``pending`` (futures in flight), ``held`` (requests whose shm inputs the server still
  reads), ``awaited`` (replies due without a future: "heartbeat", "register") and
  ``closed`` change under ``lock``, which the client's ``ReaderRole`` shares: ``awaiting()``
  tells the role whether to hand the reading on.
- A request's shm blocks are freed once the server is done with them: at its reply, or at
  ``inputs_done`` when the reply said ``inputs_held``, also for a request failed here.
- ``session`` belongs to one ``server_id`` and changes under ``shm_lock``; a new server
  id or a lost connection fails everything in flight and drops the session (its views
  stay valid; their releases are dropped: that server frees the whole session).
- While ``refused`` (the server refused our handshake) a request fails at ``add`` with
  ``HandshakeError``; a refusal for good (libzmq gave the address up) stays. While ``unreachable``
  (no server listens at the ipc:// path) it fails there with ``ServerUnavailableError``, naming the path.
- Every future is completed once (``runtime.core.futures.resolve``), by ``complete``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgpack
import zmq

from runtime.client.errors import (ConnectionLostError, HandshakeError, ServerError, ServerUnavailableError,
                                   error_from_reply)
from runtime.client.shm import ShmSession
from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.link.client_protocol import SUBMIT_REPLY_PREFIX, register_header
from runtime.transport.endpoints import ipc_unreachable
from runtime.transport.protocol import TensorResolver, numpy_tensor, numpy_view, torch_tensor, torch_view, unpack_header
from runtime.transport.arena import sweep_stale

log = logging.getLogger("phyrt.client")

#: marks the server's Cancelled reply in a ``done`` list: (future, message, _CANCELLED)
_CANCELLED = object()
#: marks a stream's chunk in a ``done`` list: (StreamState, chunk, _CHUNK)
_CHUNK = object()

Blocks = list[tuple[str, int]]


class Pending:
    """A request in flight: its future, and the shm blocks its inputs occupy."""

    __slots__ = ("future", "op", "sent_at", "blocks", "session", "released", "stream")

    def __init__(self, future: Future, op: str, sent_at: float, blocks: Blocks | None = None,
                 session: ShmSession | None = None, released: list[list[Any]] | None = None,
                 stream: Any = None) -> None:
        self.future = future
        self.op = op
        self.sent_at = sent_at
        self.blocks = blocks if blocks is not None else []
        self.session = session
        #: result blocks whose release rides in this submit's header (given back if it is not sent)
        self.released = released
        #: a stream op's ``runtime.client.streams.StreamState`` (its chunks go there); None for a submit
        self.stream = stream


def complete(done: list[tuple[Future, Any, Any]]) -> None:
    """Resolve ``(future, result, error)`` triples; call it holding no lock and not the socket."""
    for future, result, error in done:
        if error is _CHUNK:
            future.deliver(result)
        elif error is _CANCELLED:
            if not future.cancel():
                resolve(future, error=ServerError.for_request(f"Cancelled: {result}",
                                                              getattr(future, "request_id", None)))
        else:
            resolve(future, result, error)


def _no_ext(code: int, body: bytes) -> Any:
    raise ProtocolError("a tensor reference")  # own() leaves such a reply to handle()


def _more(header: dict[str, Any]) -> bool:
    """Whether a reply is a stream's chunk that more replies follow."""
    return header.get("op") == "stream" and header.get("ok") is True and header.get("final") is not True


class Replies:
    """The requests in flight of one client, its shm session, and the decoding of replies."""

    def __init__(self, address: str, tensor_type: str, shm: bool) -> None:
        self.address = address
        self._make = torch_tensor if tensor_type == "torch" else numpy_tensor
        self._make_shm = torch_view if tensor_type == "torch" else numpy_view
        self._shm = shm
        self.lock = threading.Lock()  # pending, held, awaited, closed; shared with the ReaderRole
        self.shm_lock = threading.Lock()  # session and its arena
        self.pending: dict[int, Pending] = {}
        self.held: dict[int, tuple[ShmSession, Blocks]] = {}
        self.awaited: dict[str, float] = {}  # name -> sent at
        self.session: ShmSession | None = None
        self.server_id: str | None = None
        self.last_heard = time.monotonic()
        self.closed = False
        self.broken: str | None = None  # why the I/O thread died, if it did
        self.refused: str | None = None  # why the server refused our handshake, while it does
        self.refused_for_good = False  # libzmq gave the address up: no handshake will follow
        self.unreachable: str | None = None  # why no server listens at the ipc:// path, while none does (``look``)

    def wants_shm(self) -> bool:
        """Shared memory is on and not refused, but no usable session exists (yet)."""
        session = self.session
        return self._shm and not self.closed and (session is None or (not session.usable and not session.refused))

    def awaiting(self) -> bool:
        """Under ``lock``: some reply is still due."""
        return bool(self.pending or self.held or self.awaited)

    def look(self) -> None:
        """Whether a server listens at our ``ipc://`` path (``unreachable``: why not); the client asks at
        its start, and ``add`` again while none did."""
        self.unreachable = ipc_unreachable(self.address)

    def add(self, request_id: int, pending: Pending) -> None:
        """A request about to be sent; ConnectionLostError (its blocks freed) once closed or broken,
        HandshakeError while the server refuses our handshake, ServerUnavailableError while no server
        listens at the ipc:// path (looked at again for each request: it may have come up since)."""
        if self.unreachable is not None:
            self.look()
        with self.lock:
            if self.closed or self.broken or self.refused or self.unreachable:
                if pending.session is not None:
                    pending.session.free(pending.blocks)
                if self.closed or self.broken:
                    raise ConnectionLostError(f"the client of {self.address} is {self.broken or 'closed'}")
                if self.refused:
                    raise HandshakeError.for_request(self.refused, request_id)
                raise ServerUnavailableError.for_request(f"{self.unreachable}: is the server running, with this "
                                                         "address on its ready line?", request_id)
            self.pending[request_id] = pending

    def unsent(self, request_id: int, reason: str, failed: list) -> None:
        """A request that could not be sent fails (into ``failed``); its releases wait for a later ride."""
        with self.lock:
            p = self.pending.pop(request_id, None)
        if p is None:
            return
        if p.session is not None:
            p.session.free(p.blocks)
            if p.released:
                p.session.give_back(p.released)
        failed.append((p.future, None, ConnectionLostError.for_request(f"{reason}: {self.address}", request_id)))

    def close(self) -> dict[int, Pending] | None:
        """Accept no more requests; what was in flight (None if closed already)."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            pending, self.pending = self.pending, {}
        return pending

    def close_session(self) -> None:
        with self.shm_lock:
            if self.session is not None:
                self.session.close()
                self.session = None

    # -- replies (the reader, holding the socket) --------------------------------------

    def handle(self, head: bytes, frames: list[zmq.Frame], done: list) -> bytes | None:
        """One message from the server: answers into ``done``; a header to send at once, if any."""
        self.last_heard = time.monotonic()
        refs: list = []
        header = unpack_header(head, 1 << 30, refs)
        op, request_id = header.get("op"), header.get("id")
        if op == "ping" and not isinstance(request_id, int):
            if request_id == "heartbeat":
                with self.lock:
                    self.awaited.pop("heartbeat", None)
            return self._on_ping(header, done)
        if op == "register":
            with self.lock:
                self.awaited.pop("register", None)
            self._on_registered(header)
            return None
        if op == "inputs_done":
            with self.lock:
                held = self.held.pop(request_id, None)
            if held is not None:
                held[0].free(held[1])
            return None
        with self.lock:
            p = self.pending.get(request_id) if isinstance(request_id, int) else None
            if p is not None and not (p.stream is not None and _more(header)):
                del self.pending[request_id]  # its one reply, or a stream's last
        try:
            return self._answer(header, p, bool(refs), frames, done)
        except Exception as exc:  # a bug here must not leave the request's caller waiting
            if p is not None:
                done.append((p.future, None, ServerError.for_request(
                    f"the reply could not be read: {type(exc).__name__}: {exc}", request_id)))
            raise

    def own(self, head: bytes, future: Any) -> bool:
        """``future``'s reply if it is a submit's plain success (``SUBMIT_REPLY_PREFIX``'s five fields):
        answered, True; anything else is left to ``handle`` (False)."""
        if not head.startswith(SUBMIT_REPLY_PREFIX) or 0xFF in head:  # (0xFF: a Timestamp may hide there)
            return False
        try:  # msgpack's own checks: the server packs the result of a plain dict, whose keys are unique
            header = msgpack.unpackb(head, strict_map_key=True, ext_hook=_no_ext)
        except Exception:  # a tensor reference, or malformed: handle() says which
            return False
        request_id = future.request_id  # five distinct fields (the prefix's map size): no field twice
        if len(header) != 5 or header.get("id") != request_id or header.get("ok") is not True or "result" not in header:
            return False
        with self.lock:
            p = self.pending.pop(request_id, None)
        if p is None:  # failed here already: handle() frees what the server held for it
            return False
        self.last_heard = time.monotonic()
        if p.blocks and p.session is not None:
            p.session.free(p.blocks)
        future.set_result(header["result"])  # a Slot: no callbacks to run with the socket held
        return True

    def _answer(self, header: dict[str, Any], p: Pending | None, refs: bool, frames: list[zmq.Frame],
                done: list) -> bytes | None:
        """The reply to a request of ours (``p``; None: failed here already) into ``done``."""
        request_id = header.get("id")
        register = self._on_ping(header, done) if header.get("op") == "ping" and p is not None else None
        result, error = header.get("result"), None
        if refs or frames:
            session = self.session
            # shared-memory results are views of their blocks: each block is released (see
            # ShmSession.result_view) once the caller's arrays over it are collected
            resolver = TensorResolver(frames, self._make, session.result_view if session is not None else None,
                                      self._make_shm)
            try:
                result = resolver.resolve(result)
                resolver.finish()
            except ProtocolError as exc:  # no traceback: its frames would keep the views made so far alive
                result, error = None, exc.with_traceback(None)
        if p is None:
            self._late(request_id, header.get("inputs_held") is True)
            return register
        if p.stream is not None and error is None and header.get("ok") is True:
            if header.get("seq") != p.stream.seq:  # a chunk went missing: the stream ends here
                with self.lock:
                    self.pending.pop(request_id, None)
                error = ServerError.for_request(f"stream {request_id}: chunk {header.get('seq')!r} came where "
                                                f"{p.stream.seq} was due (a chunk was lost)", request_id)
            elif _more(header):
                p.stream.seq += 1
                done.append((p.stream, result, _CHUNK))
                return register
        if p.blocks and p.session is not None:
            if header.get("inputs_held") is True:
                with self.lock:
                    self.held[request_id] = (p.session, p.blocks)
            else:
                p.session.free(p.blocks)
        if error is None and header.get("ok") is not True:
            err = header.get("error")
            if isinstance(err, dict) and err.get("type") == "Cancelled":
                done.append((p.future, err.get("message"), _CANCELLED))
                return register
            error = error_from_reply(err, request_id)
        done.append((p.future, result, error))
        return register

    def _late(self, request_id: Any, inputs_held: bool) -> None:
        """The reply to a request failed here already: free its inputs once the server is done."""
        if not isinstance(request_id, int):
            return
        with self.lock:
            held = self.held.pop(request_id, None)
            if held is not None and inputs_held:
                self.held[request_id] = held
                held = None
        if held is not None:
            held[0].free(held[1])

    def _on_ping(self, header: dict[str, Any], done: list) -> bytes | None:
        """A ping's answer names the server instance: a new one starts a fresh session."""
        result = header.get("result")
        if not header.get("ok") or not isinstance(result, dict):
            return None
        server_id = result.get("server_id")
        if not isinstance(server_id, str) or server_id == self.server_id:
            return None
        if self.server_id is not None:
            self.connection_lost(f"the server at {self.address} restarted", done)
        self.server_id = server_id
        if not self._shm:
            return None
        with self.shm_lock:
            self.session = ShmSession(server_id)
            with self.lock:
                self.awaited["register"] = time.monotonic()
            return register_header(self.session.run_id, [], pid=os.getpid())

    def _on_registered(self, header: dict[str, Any]) -> None:
        result = header.get("result")
        with self.shm_lock:
            session = self.session
            if session is None or not isinstance(result, dict) or result.get("run_id") != session.run_id:
                if session is not None and header.get("ok") is not True:
                    session.refused = True
                    log.warning("the server at %s refused shared memory (%s); tensors go as frames",
                                self.address, header.get("error"))
                return
            session.on_registered(result)

    # -- failures (the I/O thread, or the reader) ---------------------------------------

    def heartbeat(self, now: float, timeout: float) -> list:
        """A heartbeat goes out: forget replies due for longer than ``timeout``, await its own,
        and fail (returned as ``done``) the requests with no word from the server for that long."""
        with self.lock:
            self.awaited = {k: t for k, t in self.awaited.items() if now - t <= timeout}
            self.awaited.setdefault("heartbeat", now)
            silent = [(i, p) for i, p in self.pending.items() if now - max(p.sent_at, self.last_heard) > timeout]
            for request_id, p in silent:
                del self.pending[request_id]
                if p.blocks and p.session is not None:  # the server may still read them: wait for its word
                    self.held[request_id] = (p.session, p.blocks)
        return [(p.future, None, ConnectionLostError.for_request(
            f"no word from the server at {self.address} for more than {timeout} s "
            f"(heartbeat_timeout_s) while request {request_id} was in flight", request_id))
            for request_id, p in silent]

    def connection_lost(self, reason: str, done: list) -> None:
        """Fail every request in flight (into ``done``) and drop the shared-memory session."""
        self._fail_all(done, lambda request_id: ConnectionLostError.for_request(
            f"{reason} while request {request_id} was in flight (the client reconnects by itself; "
            "send it again)", request_id))

    def refuse(self, message: str, permanent: bool, done: list) -> bool:
        """The server refused our handshake: what is in flight fails (into ``done``), later requests
        at ``add``, until ``served()`` (a refusal for good stays). Whether it was not refused before."""
        with self.lock:
            new = self.refused is None
            if permanent or not self.refused_for_good:
                self.refused = message
            self.refused_for_good = self.refused_for_good or permanent
        self._fail_all(done, lambda request_id: HandshakeError.for_request(message, request_id))
        return new

    def served(self) -> bool:
        """A handshake succeeded: requests go out again. Whether a refusal was lifted."""
        with self.lock:
            lifted = self.refused is not None and not self.refused_for_good
            if lifted:
                self.refused = None
        return lifted

    def _fail_all(self, done: list, error: Callable[[int], ConnectionLostError]) -> None:
        with self.lock:
            pending, self.pending = self.pending, {}
            self.held.clear()
            self.awaited.clear()
        with self.shm_lock:
            session, self.session = self.session, None
        self.server_id = None
        for request_id, p in pending.items():
            done.append((p.future, None, error(request_id)))
        if session is not None:
            session.close()
            sweep_stale()  # the server's unreleased result segments, if it was killed
