"""A client's DEALER socket to its server: one holder at a time, an outbox, reading one message.

Torch-free. The socket's *reader* (who polls it for replies) is decided by the client's
``ReaderRole`` (``runtime.transport.reader``); this module is what the reader does.

    any thread: send(id, frames) -> outbox --- kick(): the socket free? hold it, flush() --> server
                                               held by a reader asleep in poll(): role.wake(),
                                               and the reader flushes before it polls on
    the reader: exchange(id, frames, future, deadline)  (Client.call, the role free: sends first)
                read_until(future, deadline) = exchange with nothing to send (ReaderRole.wait's ``read``)
      socket held: flush(); poll, spinning budget_ns("client") first;      <-- replies
                   a Slot's own plain reply: Replies.own; any other: read_one() -> Replies.handle -> done
      socket released: complete(done), then hold it again until ``future`` is done
    the I/O thread, when nobody reads: poll() once, then the role goes back

Invariants:
- The socket is used under ``lock`` only, and no thread blocks on that lock to send:
  frames go to ``outbox`` and whoever holds the lock sends them; a reader that sleeps in
  ``poll`` holding it (``polling``) is woken through ``role.fd``. The outbox is FIFO, so
  a segment's ``register`` goes out before the first request that uses it.
- Only the holder of the reader role polls the socket for replies; it completes futures
  with ``lock`` released (their callbacks may call the client, even ``call()``: the role
  re-enters), and it leaves the role once the role is closed.
- Tensor frames that view a caller's arrays are sent at once (zmq copies them as they are
  queued) or, when the socket is held, queued as a snapshot.
- Released result blocks ride with the next message (a message of their own would wake
  other threads, which costs a waiting caller its CPU on a busy machine).
- ``open`` turns False once, under ``lock``, when the I/O thread closes the socket.
- The monitor is read under ``monitor_lock`` (``watch_monitor``): by the I/O thread when it
  fires, and by a sender whose send found no connection to queue on (a refused handshake,
  after which libzmq gives the address up, explains that). It costs a request nothing.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.client.handshake import LOST, MONITORED, REFUSED, SERVED, HandshakeWatch
from runtime.client.replies import Replies, complete
from runtime.core.errors import ProtocolError
from runtime.core.futures import Slot
from runtime.link.client_protocol import release_header
from runtime.transport.endpoints import load_key
from runtime.transport.reader import ReaderRole
from runtime.transport.spin import Spinner, budget_ns
from runtime.transport.zmq_context import io_context

log = logging.getLogger("phyrt.client")

# plain ints: pyzmq's enum members cost microseconds in every ``|`` and call on the hot path
_NOBLOCK, _POLLIN = int(zmq.NOBLOCK), int(zmq.POLLIN)


class Connection:
    """The socket (and its monitor) to one server address, used by one holder at a time."""

    def __init__(self, address: str, replies: Replies, role: ReaderRole, poll_s: float,
                 server_public_key: str | bytes | None = None, public_key: str | bytes | None = None,
                 secret_key: str | bytes | None = None) -> None:
        self.address = address
        self._replies = replies
        self._role = role
        self._poll_s = poll_s  # a reader looks at the role (closed?) at least this often
        self._spinner = Spinner(budget_ns("client"))  # a waiting caller polls a moment before it sleeps
        self.lock = threading.Lock()  # the socket
        self.outbox: collections.deque[tuple[int | None, list[Any]]] = collections.deque()  # (id or None, frames)
        self.polling = False  # the holder of the socket sleeps in poll (wake it to send)
        self._ctx = io_context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket | None = None
        self.monitor_lock = threading.Lock()
        self._watch = HandshakeWatch(address, server_public_key is not None)
        success = False
        try:
            self._configure(server_public_key, public_key, secret_key)
            self.monitor = self.sock.get_monitor_socket(MONITORED)
            self.sock.connect(address)
            success = True
        finally:
            if not success:
                if self.monitor is not None:
                    self.monitor.close(0)
                self.sock.close(0)
                self._ctx.term()
        self.open = True
        # the reading caller's poll (one at a time): zmq_poll itself (zmq.Poller.poll wraps it in
        # Python), and the spinner's look
        self._items = [(self.sock, _POLLIN), (role.fd, _POLLIN)]
        self._look = functools.partial(zmq.zmq_poll, self._items, 0)

    def _configure(self, server_public_key: str | bytes | None, public_key: str | bytes | None,
                   secret_key: str | bytes | None) -> None:
        sock = self.sock
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # replies are never dropped on this side
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if server_public_key is not None:
            sock.curve_serverkey = load_key(server_public_key, secret=False)
            own_secret = load_key(secret_key, secret=True)
            if own_secret is None:
                raise ValueError("CURVE needs this client's secret_key too (public_key is derived from it)")
            sock.curve_secretkey = own_secret
            sock.curve_publickey = load_key(public_key, secret=False) or zmq.curve_public(own_secret)

    # -- sending ------------------------------------------------------------------------

    def send(self, request_id: int | None, frames: list[Any]) -> None:
        """Queue a message (``request_id``: its future fails if it cannot go); send it now if the
        socket is free. Tensor frames view the caller's arrays: sent now, or snapshotted."""
        if len(frames) > 1:
            if self.lock.acquire(False):
                failed: list = []
                try:
                    self.outbox.append((request_id, frames))
                    self.flush(failed)  # zmq copies each frame as it is queued
                finally:
                    self.lock.release()
                if failed:
                    complete(failed)
                if self.outbox:  # queued by others meanwhile
                    self.kick()
                return
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        self.outbox.append((request_id, frames))
        self.kick()

    def kick(self) -> None:
        """Send what is queued, unless another thread holds the socket: then that one sends it."""
        lock = self.lock
        while self.outbox:
            if not lock.acquire(False):
                if self.polling:  # it sleeps in poll: wake it (otherwise it looks before it lets go)
                    self._role.wake()
                return
            failed: list = []
            try:
                self.flush(failed)
            finally:
                lock.release()
            if failed:
                complete(failed)

    def flush(self, failed: list) -> None:
        """Holding the socket: the releases that wait for a ride, then the outbox; the futures of
        what could not go into ``failed``."""
        sock = self.sock
        # releases first: a server runs a request in the thread that read it only if no message
        # came after it (one that did must not wait for it), and a release needs no answer
        session = self._replies.session
        while session is not None and session.released and self.open and self.outbox:
            blocks = session.take_released()
            if not blocks:
                break
            try:
                sock.send(release_header(blocks), _NOBLOCK)
            except zmq.Again:  # the queue is full: they ride with a later message
                session.give_back(blocks)
                break
            except zmq.ZMQError as exc:
                log.warning("dropped a release of result blocks to %s: %s", self.address, exc)
        while self.outbox:
            request_id, frames = self.outbox.popleft()
            if not self.open:
                continue  # closed: close() fails what is in flight
            try:
                if len(frames) == 1:
                    sock.send(frames[0], _NOBLOCK)
                else:
                    sock.send_multipart(frames, _NOBLOCK)
                continue
            except zmq.Again:
                self.watch_monitor(failed)  # a refused handshake fails it (and all in flight) with its cause
                reason = "the send queue to the server is full (is it reachable?)"
            except zmq.ZMQError as exc:
                reason = f"the message could not be sent ({exc})"
            if request_id is None:
                log.warning("dropped a message to %s: %s", self.address, reason)
            else:
                self._replies.unsent(request_id, reason, failed)

    # -- reading (the holder of the reader role) -------------------------------------------

    def read_until(self, future: Any, deadline: float | None) -> None:
        """``ReaderRole.wait``'s ``read``: ``exchange`` with nothing to send; once the role is
        closed, give it up (so that the wait sleeps on the future, which close() fails)."""
        self.exchange(None, None, future, deadline)
        if self._role.closed and not future.done():
            self._role.leave(hand_on=False)

    def exchange(self, request_id: int | None, frames: list[Any] | None, future: Any, deadline: float | None) -> None:
        """Holding the reader role: send ``frames`` (None: nothing) and read until ``future`` is
        done, ``deadline`` passes or the role is closed. Other futures' answers are completed with
        the socket released; a ``Slot`` (``Client.call``'s, which runs no callbacks) is answered
        by its own plain reply at once (``Replies.own``). Each wait spins first
        (``runtime.transport.spin``). One function, not three: with many client processes on
        few cores, every function a small request runs costs it cache misses."""
        lock, sock, role = self.lock, self.sock, self._role
        own = self._replies.own if type(future) is Slot else None
        failed: list = []
        lock.acquire()
        try:
            if frames is not None:  # one frame now, unless others wait (tensor frames queue too)
                if self.outbox or len(frames) > 1:
                    self.outbox.append((request_id, frames))
                else:
                    try:
                        sock.send(frames[0], _NOBLOCK)
                    except zmq.ZMQError:  # flush says why, and fails the request
                        self.outbox.append((request_id, frames))
            while not future.done() and self.open and not role.closed:
                if self.outbox:
                    self.flush(failed)
                wait = self._poll_s if deadline is None else min(self._poll_s, deadline - time.monotonic())
                if wait <= 0:
                    return
                if not failed:  # (a request that could not go is answered first)
                    self.polling = True
                    try:
                        events = self._spinner.wait(self._look, zmq.zmq_poll, self._items, int(wait * 1000) + 1)
                    finally:
                        self.polling = False
                    for what, _ in events:
                        if what is not sock:
                            role.drain()
                            continue
                        head = sock.recv(_NOBLOCK, copy=False)
                        if head.more or own is None or not own(head.bytes, future):
                            self.read_one(failed, head)
                if failed:
                    lock.release()
                    try:
                        complete(failed)
                    finally:
                        failed = []
                        lock.acquire()
        finally:
            lock.release()
            if failed:
                complete(failed)
            if self.outbox:  # queued while we held the socket, after our last look
                self.kick()

    def poll(self, poller: zmq.Poller, timeout_s: float, done: list) -> list:
        """The I/O thread, holding the socket: send what is queued, wait up to ``timeout_s`` for a
        message and read it; what fired, as ``zmq.Poller.poll`` lists it."""
        self.polling = True
        try:
            if self.outbox:
                self.flush(done)
            events = poller.poll(int(timeout_s * 1000) + 1 if timeout_s > 0 and not done else 0)
        finally:
            self.polling = False
        sock = self.sock
        for what, _ in events:
            if what is sock:
                self.read_one(done)
            elif what == self._role.fd:
                self._role.drain()
        return events

    def read_one(self, done: list, head: Any = None) -> None:
        """Read one message (its first frame ``head`` if read already) and handle it."""
        sock = self.sock
        if head is None:
            head = sock.recv(_NOBLOCK, copy=False)  # a Frame knows in C whether parts follow
        frames = []
        more = head.more
        while more:  # the parts of a message arrive together
            frame = sock.recv(copy=False)
            frames.append(frame)
            more = frame.more
        try:
            register = self._replies.handle(head.bytes, frames, done)
            if register is not None:  # a new session: before anything that could use it
                sock.send(register, _NOBLOCK)
        except ProtocolError as exc:
            log.warning("dropped a malformed reply from %s: %s", self.address, exc)
        except Exception:  # a bug must not lose the replies after this one
            log.exception("failed to handle a reply from %s", self.address)

    # -- the monitor (the I/O thread, or a sender that found no connection) ------------------

    def watch_monitor(self, done: list) -> None:
        """Act on what the monitor reported: a connection lost after its handshake, or a handshake
        the server refused, fails the requests in flight into ``done`` (runtime.client.handshake)."""
        with self.monitor_lock:
            monitor = self.monitor
            while monitor is not None:
                try:
                    event = recv_monitor_message(monitor, _NOBLOCK)
                except zmq.Again:
                    return
                verdict = self._watch.on_event(event["event"], event["value"])
                if verdict is None:
                    continue
                if verdict.action == LOST:
                    self._replies.connection_lost(f"the connection to the server at {self.address} was lost", done)
                elif verdict.action == REFUSED:
                    if self._replies.refuse(verdict.message, verdict.permanent, done):
                        log.warning("%s", verdict.message)
                elif verdict.action == SERVED and self._replies.served():
                    log.warning("the handshake with %s succeeded: requests go out again", self.address)

    # -- closing (the I/O thread, then the client) --------------------------------------------

    def shut(self) -> None:
        """Close the socket and its monitor, once no reader holds the role."""
        with self.lock, self.monitor_lock:
            self.open = False
            self.sock.disable_monitor()
            if self.monitor is not None:
                self.monitor.close(0)
                self.monitor = None
            self.sock.close(0)

    def term(self) -> None:
        """Once the I/O thread has ended (after ``shut``)."""
        self._ctx.term()
