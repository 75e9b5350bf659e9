"""What a requester end awaits from its peer, and what each reply does: ``Awaited``.

Torch-free: imports ``runtime.link`` (pending table, client protocol, shm session), the transport's
protocol and ``runtime.core``. The errors it makes come from the ``errors`` namespace it is given
(``runtime.client.server_errors`` for the client). ``handle`` runs in the link's reader, holding
the socket (``runtime.link.link``); the futures it answers go into a ``done`` list that
``complete`` resolves once the socket is given back or no lock is held (callbacks may call again).

    Link: table.add_locked(Request) -------> table[id]               (under ``lock``)
    reader: handle(header, frames, done)
      a stream's chunk (table[id] stays) --> decode -> done, for its StreamState (``seq`` checked)
      a reply to table[id] (claimed) ------> decode (frames, shm result views) -> done;
                                             its shm inputs: freed, or held by the
                                             session when the reply says ``inputs_held``
      inputs_done(id) ---------------------> the session frees them (ShmSession.inputs_done)
      ping (any): a new server_id ---------> everything in flight fails; a new ShmSession,
                                             whose register handle() returns, to go out at once
      register ----------------------------> shm.registered (or refused: frames)
    link thread: silent(now) --------------> requests silent past heartbeat_timeout_s fail
    monitor (runtime.link.handshake): fail_all after a handshake; refuse/served

Invariants:
- ``table`` (requests in flight, claimed exactly once: reply, silence, failure or close), ``due``
  (replies due without a future: "heartbeat", "register") and the states change under ``lock`` (the
  table's), which the link also uses for who reads its socket: ``awaiting()`` tells whether to hand
  the reading on (the session's ``held``, requests whose shm inputs the server still reads, counts).
- A request's shm blocks are freed once the server is done with them: at its reply, or at
  ``inputs_done`` when the reply said ``inputs_held``, also for a request failed here.
- The shm session belongs to one ``server_id``; a new server id or a lost connection fails
  everything in flight and drops the session (its views stay valid; their releases are dropped).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from runtime.core.errors import ProtocolError
from runtime.core.futures import resolve
from runtime.link.pending import Entry, PendingTable
from runtime.link.current_session import CurrentSession
from runtime.link.session import ShmSession
from runtime.transport.endpoints import ipc_unreachable
from runtime.transport.protocol import TensorResolver, numpy_tensor, numpy_view, torch_tensor, torch_view, unpack_header

__all__ = ["Awaited", "Request"]

log = logging.getLogger("phyrt.client")

#: marks the server's Cancelled reply in a ``done`` list: (future, message, _CANCELLED)
_CANCELLED = object()
#: marks a stream's chunk in a ``done`` list: (StreamState, chunk, _CHUNK)
_CHUNK = object()


class Request(Entry):
    """A request in flight: its future, and the shm blocks its inputs occupy."""

    __slots__ = ("future", "op", "sent_at", "blocks", "session", "released", "stream")

    def __init__(self, key: int, future: Any, op: str, sent_at: float, blocks: list | None = None,
                 session: ShmSession | None = None, released: list | None = None, stream: Any = None) -> None:
        self.key, self.deadline, self.claimed = key, None, False  # (Entry's fields; the silence rule is a scan)
        self.future = future
        self.op = op
        self.sent_at = sent_at
        self.blocks = blocks
        self.session = session
        #: result blocks whose release rides in this submit's header (given back if it is not sent)
        self.released = released
        #: a stream op's StreamState (its chunks go there: ``deliver``, ``seq``); None for a submit
        self.stream = stream

    def free_inputs(self) -> None:
        if self.blocks and self.session is not None:
            self.session.free(self.blocks)


def _more(header: dict[str, Any]) -> bool:
    """Whether a reply is a stream's chunk that more replies follow."""
    return header.get("op") == "stream" and header.get("ok") is True and header.get("final") is not True


class Awaited:
    """The requests in flight of one link, its shm session, its states and the decoding of replies."""

    def __init__(self, address: str, tensor_type: str, shm: CurrentSession, errors: Any) -> None:
        self.address = address
        self.errors = errors
        self._make = torch_tensor if tensor_type == "torch" else numpy_tensor
        self._make_shm = torch_view if tensor_type == "torch" else numpy_view
        self.shm = shm
        self.table: PendingTable[Request] = PendingTable()
        self.lock = self.table.lock
        self.due: dict[str, float] = {}  # name -> sent at
        self.server_id: str | None = None
        self.last_heard = time.monotonic()
        self.closed = False
        self.broken: str | None = None  # why the link's thread died, if it did
        self.refused: str | None = None  # why the server refused our handshake, while it does
        self.refused_for_good = False  # libzmq gave the address up: no handshake will follow
        self.unreachable: str | None = ipc_unreachable(address)  # why no server listens at the ipc:// path

    def awaiting(self) -> bool:
        """Under ``lock``: some reply is still due (``inputs_done`` included)."""
        session = self.shm.current
        return bool(self.table.table or self.due or (session is not None and session.held))

    def refusal(self, request: Request) -> BaseException | None:
        """Under ``lock``: why ``request`` cannot go (its blocks freed), or None. ConnectionLostError once
        closed or broken, HandshakeError while refused, ServerUnavailableError while nothing listens."""
        if not (self.closed or self.broken or self.refused or self.unreachable):
            return None
        request.free_inputs()
        errors, key = self.errors, request.key
        if self.closed or self.broken:
            return errors.ConnectionLostError(f"the client of {self.address} is {self.broken or 'closed'}")
        if self.refused:
            return errors.HandshakeError.for_request(self.refused, key)
        return errors.ServerUnavailableError.for_request(f"{self.unreachable}: is the server running, with this "
                                                         "address on its ready line?", key)

    def complete(self, done: list[tuple[Any, Any, Any]]) -> None:
        """Resolve ``(future, result, error)`` triples; call it holding no lock."""
        for future, result, error in done:
            if error is _CHUNK:
                future.deliver(result)
            elif error is _CANCELLED:
                if not future.cancel():
                    resolve(future, error=self.errors.ServerError.for_request(
                        f"Cancelled: {result}", getattr(future, "request_id", None)))
            else:
                resolve(future, result, error)

    def unsent(self, request_id: int, reason: str, failed: list) -> None:
        """A request that could not be sent fails (into ``failed``); its releases wait for a later ride."""
        p = self.table.claim(request_id)
        if p is None:
            return
        p.free_inputs()
        if p.released and p.session is not None:
            p.session.give_back(p.released)
        failed.append((p.future, None, self.errors.ConnectionLostError.for_request(f"{reason}: {self.address}",
                                                                                   request_id)))

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
                    self.due.pop("heartbeat", None)
            return self._on_ping(header, done)
        if op == "register":
            with self.lock:
                self.due.pop("register", None)
            if not self.shm.registered(header):
                log.warning("the server at %s refused shared memory (%s); tensors go as frames",
                            self.address, header.get("error"))
                return None
            lane = self.shm.lane_request()  # sent at once: a lane for submits (runtime.link.lane)
            if lane is not None:
                with self.lock:
                    self.due["lane"] = time.monotonic()  # read soon: the lane is up before it is needed
            return lane
        if op == "lane":
            with self.lock:
                self.due.pop("lane", None)
            self.shm.lane_opened(header)
            return None
        if op == "inputs_done":
            session = self.shm.current
            if session is not None:
                session.inputs_done(request_id)
            return None
        p = None
        if isinstance(request_id, int):
            with self.lock:
                p = self.table.get(request_id)
                if p is not None and not (p.stream is not None and _more(header)):
                    p = self.table.claim_locked(request_id)  # its one reply, or a stream's last
        try:
            return self._answer(header, p, bool(refs), frames, done)
        except Exception as exc:  # a bug here must not leave the request's caller waiting
            if p is not None:
                done.append((p.future, None, self.errors.ServerError.for_request(
                    f"the reply could not be read: {type(exc).__name__}: {exc}", request_id)))
            raise

    def _answer(self, header: dict[str, Any], p: Request | None, refs: bool, frames: list[zmq.Frame],
                done: list) -> bytes | None:
        """The reply to a request of ours (``p``; None: failed here already) into ``done``."""
        request_id = header.get("id")
        register = self._on_ping(header, done) if header.get("op") == "ping" and p is not None else None
        result, error = header.get("result"), None
        if refs or frames:
            session = self.shm.current
            # shared-memory results are views of their blocks: each block is released (see
            # ShmSession.tracked_view) once the caller's arrays over it are collected
            resolver = TensorResolver(frames, self._make, session.tracked_view if session is not None else None,
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
                self.table.claim(request_id)
                error = self.errors.ServerError.for_request(
                    f"stream {request_id}: chunk {header.get('seq')!r} came where {p.stream.seq} was due "
                    "(a chunk was lost)", request_id)
            elif _more(header):
                p.stream.seq += 1
                done.append((p.stream, result, _CHUNK))
                return register
        if p.blocks and p.session is not None:
            if header.get("inputs_held") is True:
                p.session.hold(request_id, p.blocks)
            else:
                p.session.free(p.blocks)
        if error is None and header.get("ok") is not True:
            err = header.get("error")
            if isinstance(err, dict) and err.get("type") == "Cancelled":
                done.append((p.future, err.get("message"), _CANCELLED))
                return register
            error = self.errors.error_from_reply(err, request_id)
        done.append((p.future, result, error))
        return register

    def _late(self, request_id: Any, inputs_held: bool) -> None:
        """The reply to a request failed here already: free its inputs once the server is done."""
        session = self.shm.current
        if isinstance(request_id, int) and session is not None and not inputs_held:
            session.inputs_done(request_id)

    def _on_ping(self, header: dict[str, Any], done: list) -> bytes | None:
        """A ping's answer names the server instance: a new one starts a fresh session."""
        result = header.get("result")
        if not header.get("ok") or not isinstance(result, dict):
            return None
        server_id = result.get("server_id")
        if not isinstance(server_id, str) or server_id == self.server_id:
            return None
        if self.server_id is not None:
            self.fail_all(done, self._lost(f"the server at {self.address} restarted"))
        self.server_id = server_id
        register = self.shm.start(server_id)
        if register is not None:
            with self.lock:
                self.due["register"] = time.monotonic()
        return register

    # -- failures (the link's thread, or the reader) ------------------------------------

    def silent(self, now: float, timeout: float) -> list:
        """A heartbeat goes out: forget replies due for longer than ``timeout``, await its own,
        and fail (returned as ``done``) the requests with no word from the server for that long."""
        heard = self.last_heard
        with self.lock:
            self.due = {k: t for k, t in self.due.items() if now - t <= timeout}
            self.due.setdefault("heartbeat", now)
            silent = [p for p in self.table.table.values() if now - max(p.sent_at, heard) > timeout]
            for p in silent:
                self.table.claim_locked(p.key)
                if p.blocks and p.session is not None:  # the server may still read them: wait for its word
                    p.session.hold(p.key, p.blocks)
        return [(p.future, None, self.errors.ConnectionLostError.for_request(
            f"no word from the server at {self.address} for more than {timeout} s "
            f"(heartbeat_timeout_s) while request {p.key} was in flight", p.key)) for p in silent]

    def _lost(self, reason: str) -> Callable[[int], BaseException]:
        return lambda request_id: self.errors.ConnectionLostError.for_request(
            f"{reason} while request {request_id} was in flight (the client reconnects by itself; "
            "send it again)", request_id)

    def connection_lost(self, reason: str, done: list) -> None:
        """Fail every request in flight (into ``done``) and drop the shared-memory session."""
        self.fail_all(done, self._lost(reason))

    def refuse(self, message: str, permanent: bool, done: list) -> bool:
        """The server refused our handshake: what is in flight fails (into ``done``), later requests
        at once, until ``served()`` (a refusal for good stays). Whether it was not refused before."""
        with self.lock:
            new = self.refused is None
            if permanent or not self.refused_for_good:
                self.refused = message
            self.refused_for_good = self.refused_for_good or permanent
        self.fail_all(done, lambda request_id: self.errors.HandshakeError.for_request(message, request_id))
        return new

    def served(self) -> bool:
        """A handshake succeeded: requests go out again. Whether a refusal was lifted."""
        with self.lock:
            lifted = self.refused is not None and not self.refused_for_good
            if lifted:
                self.refused = None
        return lifted

    def fail_all(self, done: list, error: Callable[[int], BaseException]) -> None:
        taken = self.table.take_all()
        with self.lock:
            self.due.clear()
        self.server_id = None
        done.extend((p.future, None, error(p.key)) for p in taken)
        self.shm.drop(swept=True)  # the server's unreleased result segments, if it was killed
