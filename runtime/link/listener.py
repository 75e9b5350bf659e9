"""The responder end of a link: ``Listener``, a bound ROUTER whose peers send requests and get replies.

Torch-free; imports ``runtime.link`` (pending, peer_shm) and ``runtime.transport`` (protocol,
endpoints, wake pipe, zmq context) of the project. The server (``runtime.serving``) is its user.

    Responder(address, send)     the socket-less part: the requests in flight and the peers' shm
      pending                    PendingTable of PeerEntry by (identity, id): claim-once replies,
                                   deadlines, each peer's count of requests in flight
      peers                      PeerSessions: each peer's ClientShm, a ShmSession (ipc:// only)
      send(identity, header, frames=()) -> bool;  wake()
    Listener(address, ...)       a Responder over a ROUTER bound on ``address``:
      looping thread:            poll(fd, wake_fd) -> read_batch() -> [(identity, [header, *frames])]
      any thread:                send(...) (never blocking), wake()

Invariants:
- A reply to a request is sent once: whoever claims its entry (``pending.claim_entry``, or
  ``pending.expired`` for a deadline) sends it; the loser sends nothing of its own.
- The ROUTER is used under ``_lock`` only (ZMQ sockets are not thread-safe): the looping
  thread reads and answers there, and the thread that completes a request sends its
  reply at once, without a hop back to the looping thread.
- The looping thread sleeps in ``poll`` on the socket's (edge-triggered) ``ZMQ_FD``
  without the lock, and a send may take the signal of a message that came meanwhile: so
  the looping thread's own send sets ``recheck`` (it reads before sleeping), and any other
  sender checks ``EVENTS`` after its send and wakes the looping thread if messages wait.
- Replies go out with NOBLOCK under ROUTER_MANDATORY: a peer that left or does not read
  loses its own replies (``send`` answers False), nobody else waits. ``MAXMSGSIZE``
  drops an oversized message and its sender's connection.
- ``close()`` closes the socket under ``_lock`` (a later reply is dropped), terminates
  the context, removes an ipc:// socket file, makes ``wake()`` a no-op and closes every
  peer's shared memory.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import zmq

from runtime.link.lane import Doorbell
from runtime.link.peer_shm import ClientShm, PeerSessions
from runtime.link.pending import Entry, PendingTable
from runtime.transport.endpoints import CurveKeys
from runtime.transport.protocol import pack_header
from runtime.transport.wake_pipe import WakePipe
from runtime.transport.zmq_context import io_context

log = logging.getLogger("phyrt.server")

#: messages read in one go; then completions and deadlines get their turn
RECV_BATCH = 256
# plain ints: pyzmq's enum members cost microseconds in every ``&`` and call on the hot path
_NOBLOCK, _SNDMORE, _POLLIN = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.POLLIN)
#: whether a message waits (level-triggered): ``Socket.get(EVENTS)``, pyzmq's compiled getsockopt, a
#: plain int. ``zmq_poll(..., 0)`` tells the same with a ``poll`` of the socket's fd besides (a syscall
#: per look, two looks per request); pyzmq's ``getsockopt`` makes a ``PollEvent`` of it
_EVENTS = int(zmq.EVENTS)

#: ``send(identity, header, frames=()) -> bool``: ``header`` a dict or its packed bytes; False when
#: the reply could not be sent
Send = Callable[..., bool]


class PeerEntry(Entry):
    """A request of peer ``identity`` in flight, keyed (identity, id); ``peer``: its shm session, if
    any (counted in ``ClientShm.requests`` while in the table)."""

    __slots__ = ("identity", "id", "peer")

    def __init__(self, identity: bytes, id: Any, peer: ClientShm | None, deadline: float | None) -> None:
        self.key = (identity, id)  # (Entry's fields set here: one Python frame less per request)
        self.deadline = deadline
        self.claimed = False
        self.identity = identity
        self.id = id
        self.peer = peer


def _enter(entry: PeerEntry) -> None:
    if entry.peer is not None:
        entry.peer.requests += 1


def _leave(entry: PeerEntry) -> None:
    if entry.peer is not None:
        entry.peer.requests -= 1


def _nothing() -> None:
    pass


class Responder:
    """The requests in flight and the peers' shared memory of one responder end; replies go
    through ``send`` (a ``Listener``'s socket, or a function of a test or a fuzzer)."""

    def __init__(self, address: str, send: Send | None = None, wake: Callable[[], None] | None = None) -> None:
        self.address = address
        if send is not None:  # (a Listener's are its methods)
            self.send = send
        if wake is not None:
            self.wake = wake
        self.pending: PendingTable[Any] = PendingTable(_enter, _leave)
        self.peers = PeerSessions()

    def send(self, identity: bytes, header: dict[str, Any] | bytes, frames: Any = ()) -> bool:
        raise NotImplementedError

    def wake(self) -> None:
        """Make the looping thread look at what it owes (a no-op without a socket)."""

    def close(self, linger_ms: int = 0) -> None:
        """Close every peer's shared memory. Idempotent."""
        self.peers.close()


class Listener(Responder):
    """A ROUTER bound on ``address`` (checked by the caller). ``looping_here()`` tells
    whether the calling thread is the one that polls and reads the socket."""

    def __init__(self, address: str, max_message_bytes: int, curve: CurveKeys | None,
                 looping_here: Callable[[], bool]) -> None:
        self._looping_here = looping_here
        self._ipc = address.startswith("ipc://")
        self._lock = threading.Lock()
        self._ctx = io_context()
        self._auth: Any = None
        self._router: Any = None
        self._open = False
        self._wake_pipe: WakePipe | None = None
        self.recheck = False  # the looping thread's own send may have hidden waiting messages from poll
        bound: str | None = None
        success = False
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if curve is not None:
                self._serve_curve(curve)
            self._router.bind(address)
            bound = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._ipc:
                os.chmod(bound[len("ipc://"):], 0o600)
            self.fd = self._router.getsockopt(zmq.FD)
            self._open = True
            self._wake_pipe = WakePipe()
            success = True
        finally:
            self.address = bound
            if not success:
                self.close(0)
        super().__init__(bound)
        if self._ipc:  # same-host clients may ask for a lane (runtime.link.lane)
            self.peers.doorbell = Doorbell()
        #: poll it beside ``fd`` (None: no lanes); ``read_batch`` reads it
        self.doorbell_fd = None if self.peers.doorbell is None else self.peers.doorbell.fd

    def _serve_curve(self, curve: CurveKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=curve.authorized_clients or zmq.auth.CURVE_ALLOW_ANY)
        self._router.curve_secretkey = curve.secret
        self._router.curve_publickey = curve.public
        self._router.curve_server = True

    # -- the looping thread ---------------------------------------------------------------

    @property
    def wake_fd(self) -> int:
        """Poll it beside ``fd``; ``drain_wake()`` when it fires."""
        return self._wake_pipe.fd

    def drain_wake(self) -> None:
        self._wake_pipe.drain()

    def read_batch(self) -> tuple[list[tuple[bytes, list[Any]]], bool]:
        """What has arrived, as (identity, [header bytes, *tensor Frames]); True if a full batch (read on).
        The lanes' requests come first, read after the ROUTER: a cancel sent after a lane's submit
        follows it."""
        batch: list[tuple[bytes, list[Any]]] = []
        full = self._read_router(batch)
        if self.doorbell_fd is not None and self._open:
            lanes = self.peers.read_lanes()
            if lanes:
                batch = lanes + batch
        return batch, full

    def _read_router(self, batch: list[tuple[bytes, list[Any]]]) -> bool:
        with self._lock:
            if not self._open:
                return False
            router = self._router
            while router.get(_EVENTS) & _POLLIN:
                identity = router.recv(_NOBLOCK)  # a ROUTER's first part: the peer's identity, never alone
                head = router.recv(copy=False)  # a Frame knows in C whether parts follow
                frames: list[Any] = [head.bytes]
                more = head.more
                while more:  # the parts of a message arrive together; tensors stay Frames (no copy)
                    frame = router.recv(copy=False)
                    frames.append(frame)
                    more = frame.more
                batch.append((identity, frames))
                if len(batch) >= RECV_BATCH:
                    return True
        return False

    # -- any thread -----------------------------------------------------------------------

    def send(self, identity: bytes, header: dict[str, Any] | bytes, frames: Any = ()) -> bool:
        """Send without ever blocking; False if the peer is gone or does not read its replies.
        ``header``: a dict, or its bytes already packed (a submit's reply)."""
        data = header if type(header) is bytes else pack_header(header)
        sent = False
        with self._lock:
            if not self._open:
                return False
            router = self._router
            try:
                router.send(identity, _NOBLOCK | _SNDMORE)  # EAGAIN or EHOSTUNREACH come here, or never
                if frames:
                    router.send(data, _NOBLOCK | _SNDMORE)
                    router.send_multipart(frames, _NOBLOCK, copy=False)  # below 64 KiB pyzmq copies anyway
                else:
                    router.send(data, _NOBLOCK)
                sent = True
            except zmq.Again:
                log.debug("dropped a reply to %r: its queue is full", identity)
            except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer left
                log.debug("dropped a reply to %r: %s", identity, exc)
            if self._looping_here():  # it reads before it sleeps: no look here (a syscall per reply)
                self.recheck = True
                return sent
            waiting = router.get(_EVENTS) & _POLLIN
        if waiting:  # this send took the signal of a message that came meanwhile: pass it on
            self.wake()
        return sent

    def wake(self) -> None:
        """Make the looping thread's ``poll`` return (a no-op once closed)."""
        self._wake_pipe.wake()

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket (``linger_ms`` for the last replies to reach their peers), the
        authenticator and the context; remove an ipc:// socket file; close every peer's
        shared memory. Idempotent."""
        with self._lock:  # a completion that comes later finds the socket closed, and drops its reply
            self._open = False
            if self._router is not None and not self._router.closed:
                self._router.close(linger=linger_ms)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()
        if self._ipc and self.address is not None:
            try:  # libzmq removes its socket file; make sure, so a restart can bind the path again
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass
        if self._wake_pipe is not None:  # a late callback's wake-up is a no-op from now on
            self._wake_pipe.close()
        if hasattr(self, "peers"):  # (not made when binding failed)
            self.peers.close()
