"""``Dealer``: a client link's DEALER socket, used by one thread at a time: the caller that reads.

Torch-free; imports ``runtime.core``, ``runtime.transport`` and ``runtime.link`` only.

    enter(request), socket free: [lock: register + take the socket]; transmit: send at once
    read(future): poll (spinning budget_ns("client") first), read until ``future`` is done; a Slot's
      plain reply: [lock: claim + give the socket back] (``_own``); others: ``Awaited.handle``
    held by another thread: transmit queues to ``outbox`` (``runtime.link.outbox``: what the holder
      sends, in order, releases riding first), waking a holder asleep in poll;
      wait(future) sleeps on the future, which the reader completes
    leave(): the socket back; replies still due and nobody reading: the link thread is woken

Invariants:
- The socket is used by its *holder* only: the holder of its ``ReaderRole`` (``runtime.link.reader``,
  under ``lock``, the pending table's), which reads and sends both. The outbox is FIFO, so a segment's ``register`` goes
  out before a request that uses it; a holder flushes before each poll (and after setting
  ``polling``), and whoever gives the socket back sends what came meanwhile.
- Nesting: a thread holding the socket (a done callback run by the reader) may send and read as
  the holder; only the outermost taker gives it back (a take answers 1 taken now, 2 held here, 0 not).
- Tensor frames that view a caller's arrays are sent at once (zmq copies them as they are
  queued) or, when another thread holds the socket, queued as a snapshot (``Outbox``).
- The monitor is read under ``monitor_lock`` (``watch_monitor``): by the link thread when it fires,
  and by a sender whose send found no connection to queue on (a refused handshake explains that).
- ``stopped`` (the role closed: the link closed or broken): nobody takes the socket any more;
  ``shut`` closes it once the last holder left (it was woken through the role's pipe).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any

import msgpack
import zmq

from runtime.core.errors import ProtocolError
from runtime.core.futures import Slot
from runtime.link.awaited import Awaited, Request
from runtime.link.client_protocol import SUBMIT_REPLY_PREFIX
from runtime.link.handshake import LOST, REFUSED, SERVED, HandshakeWatch, open_dealer, read_verdicts
from runtime.link.outbox import Outbox
from runtime.link.reader import ReaderRole
from runtime.transport.endpoints import ipc_unreachable
from runtime.transport.spin import Spinner, budget_ns

__all__ = ["Dealer", "plain_result"]

log = logging.getLogger("phyrt.client")

# plain ints: pyzmq's enum members cost microseconds in every ``|`` and call on the hot path
_NOBLOCK, _POLLIN = int(zmq.NOBLOCK), int(zmq.POLLIN)


def _no_ext(code: int, body: bytes) -> Any:
    raise ProtocolError("a tensor reference")  # a reply with one is left to Awaited.handle


def plain_result(head: bytes, request_id: int) -> dict[str, Any] | None:
    """The header of ``request_id``'s reply if it is a submit's plain success (``SUBMIT_REPLY_PREFIX``'s
    five fields, no tensor); None for anything else, which ``Awaited.handle`` reads."""
    if not head.startswith(SUBMIT_REPLY_PREFIX) or 0xFF in head:  # (0xFF: a Timestamp may hide there)
        return None
    try:  # msgpack's own checks: the server packs the result of a plain dict, whose keys are unique
        header = msgpack.unpackb(head, strict_map_key=True, ext_hook=_no_ext)
    except Exception:  # a tensor reference, or malformed: handle() says which
        return None
    # five distinct fields (the prefix's map size): no field twice
    if len(header) != 5 or header.get("id") != request_id or header.get("ok") is not True or "result" not in header:
        return None
    return header


class Dealer:
    """One client's DEALER socket to its server and who holds it (see the module)."""

    def __init__(self, address: str, options: Any, awaited: Awaited, thread: Any) -> None:
        self.address = address
        self.awaited = awaited
        self.lock = awaited.lock
        self._table = awaited.table
        self._thread = thread  # woken when replies are due and nobody reads
        self._poll_s = options.heartbeat_interval_s  # a reader looks at ``stopped`` at least this often
        self.outbox = Outbox(address, awaited)  # what the holder sends, in order
        self.role = ReaderRole(awaited.awaiting, self._left, self.lock)  # who holds the socket; wakes it
        self.polling = False  # the holder sleeps in poll (wake it to send)
        self.failures: collections.deque[str] = collections.deque()  # for the link's callbacks
        self._spinner = Spinner(budget_ns("client"))  # a waiting caller polls a moment before it sleeps
        try:
            self._ctx, self.sock, self.monitor = open_dealer(address, options)
        except BaseException:
            self.role.dispose()
            raise
        self.monitor_lock = threading.Lock()
        self._watch = HandshakeWatch(address, options.server_public_key is not None)
        self.open = True
        self._items = [(self.sock, _POLLIN), (self.role.fd, _POLLIN)]
        self._replies = awaited.shm.replies  # announces the lane's replies (runtime.link.lane)
        self.lane_fd = None if self._replies is None else self._replies.fd
        if self.lane_fd is not None:
            self._items.append((self.lane_fd, _POLLIN))
        self._look = functools.partial(zmq.zmq_poll, self._items, 0)

    def enter(self, request: Request) -> int:
        """Register ``request`` and take the socket if free, under one hold of ``lock``: 1 taken now,
        2 held by this thread already, 0 held by another. Raises the request's refusal, if any."""
        awaited = self.awaited
        if awaited.unreachable is not None:  # looked at again for each request: it may have come up since
            awaited.unreachable = ipc_unreachable(self.address)
        with self.lock:
            refusal = awaited.refusal(request)
            if refusal is None:
                self._table.add_locked(request)
                return self.role.take_locked()
        raise refusal

    @property
    def stopped(self) -> bool:
        """Closed or broken: nobody takes the socket any more."""
        return self.role.closed

    def take(self) -> int:
        """The socket for this thread: 1 taken now, 2 held here already, 0 held by another (or stopped)."""
        return self.role.take()

    def leave(self, hand_on: bool = True) -> None:
        """Give the socket back (if this thread holds it): ``_left``."""
        self.role.leave(hand_on)

    def _left(self, hand_on: bool) -> None:
        """The socket was given back: send what was queued meanwhile, then with ``hand_on`` (replies
        still due) wake the link thread to read them."""
        if self.outbox:
            self._kick()
        if hand_on:
            self._thread.wake()

    def transmit(self, request_id: int | None, frames: list[Any], owned: int, keep: bool = False) -> None:
        """Send a message: at once if this thread holds the socket (``owned``; given back unless ``keep``),
        else queued (tensor frames snapshotted) for the holder."""
        if not owned:
            self.outbox.queue(request_id, frames)
            if self.polling:
                self.role.wake()
            elif self.role.holder is None:
                self._kick()
            return
        failed: list = []
        try:
            self.outbox.send(self, request_id, frames, failed)
        finally:
            if owned == 1 and not keep:
                self.leave()
        if failed:
            self.awaited.complete(failed)

    def _kick(self) -> None:
        """Send what is queued, unless another thread holds the socket: then that one sends it."""
        if not self.outbox:
            return
        owned = self.take()
        if not owned:
            if self.polling:
                self.role.wake()
            return
        failed: list = []
        try:
            self.outbox.flush(self, failed)
        finally:
            if owned == 1:
                self.leave()
        self.awaited.complete(failed)

    # -- reading (the holder of the socket) ----------------------------------------------

    def read(self, future: Any, deadline: float | None, leave: bool) -> None:
        """Holding the socket: read until ``future`` is done, ``deadline`` passes or the link stops;
        give the socket back at the end if ``leave`` (a Slot's own plain reply: with its claim)."""
        sock, role, spinner, look, items = self.sock, self.role, self._spinner, self._look, self._items
        own = type(future) is Slot
        failed: list = []
        try:
            while not future.done() and self.open and not role.closed:
                if self.outbox:
                    self.outbox.flush(self, failed)
                if failed:  # (a request that could not go is answered first)
                    self.awaited.complete(failed)
                    failed = []
                    continue
                wait = self._poll_s if deadline is None else min(self._poll_s, deadline - time.monotonic())
                if wait <= 0:
                    return
                self.polling = True
                try:
                    events = [] if self.outbox else spinner.wait(look, zmq.zmq_poll, items, int(wait * 1000) + 1)
                finally:
                    self.polling = False
                for what, _ in events:
                    if what is not sock:
                        if what != self.lane_fd:
                            role.drain()
                        elif self._read_lane(future if own else None, leave, failed):
                            leave = False  # given back with its claim
                            return
                        continue
                    head = sock.recv(_NOBLOCK, copy=False)
                    if own and not head.more and self._own(head.bytes, future, leave):
                        leave = False  # given back with its claim
                        return
                    self.read_one(failed, head)
                if failed:
                    self.awaited.complete(failed)
                    failed = []
        finally:
            if leave:
                self.leave()
            if failed:  # the lane's other replies, read with this caller's own
                self.awaited.complete(failed)

    def read_lane(self, done: list) -> None:
        """(The link thread, holding the socket.) The replies the lane announced."""
        self._read_lane(None, False, done)

    def _read_lane(self, future: Slot | None, leave: bool, done: list) -> bool:
        """Holding the socket: each reply the lane announced, handled; ``future``'s own plain reply
        last, as ``_own`` answers it (True: answered, and the socket given back with ``leave``)."""
        count, lane = self._replies.count(), self.awaited.shm.reply_lane
        if not count or lane is None:  # (announcements of a session dropped since)
            return False
        mine = header = None
        for parts in lane.take(count):
            if future is not None and mine is None and len(parts) == 1:
                header = plain_result(parts[0], future.request_id)
                if header is not None:
                    mine = parts[0]
                    continue
            self._handle(parts[0], parts[1:], done)
        if mine is None:
            return False
        if self._own(mine, future, leave, header):
            return True
        self._handle(mine, [], done)
        return False

    def _own(self, head: bytes, future: Slot, leave: bool, header: dict | None = None) -> bool:
        """``future``'s reply if it is a submit's plain success (``plain_result``; ``header`` if read
        already): claimed (and the socket given back, with ``leave``, in the same hold of ``lock``)
        and answered, True; anything else is left to ``Awaited.handle`` (False)."""
        request_id = future.request_id
        if header is None:
            header = plain_result(head, request_id)
        if header is None:
            return False
        awaited = self.awaited
        with self.lock:
            p = self._table.claim_locked(request_id)
            if p is None:  # failed here already: handle() frees what the server held for it
                return False
            due = self.role.release_locked() if leave else None
        awaited.last_heard = time.monotonic()
        if due is not None:
            self._left(due)
        if p.blocks and p.session is not None:
            p.session.free(p.blocks)
        future.set_result(header["result"])  # a Slot: no callbacks
        return True

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
        self._handle(head.bytes, frames, done)

    def _handle(self, head: bytes, frames: list, done: list) -> None:
        """One message from the server (by the socket or the lane), answered into ``done``."""
        server_id = self.awaited.server_id
        try:
            register = self.awaited.handle(head, frames, done)
            if register is not None:  # a new session (or its lane): before anything that could use it
                self.sock.send(register, _NOBLOCK)
        except ProtocolError as exc:
            log.warning("dropped a malformed reply from %s: %s", self.address, exc)
        except Exception:  # a bug must not lose the replies after this one
            log.exception("failed to handle a reply from %s", self.address)
        if server_id is not None and self.awaited.server_id != server_id:
            self._failed(f"the server at {self.address} restarted")

    # -- failures and the link thread ----------------------------------------------------

    def watch_monitor(self, done: list) -> None:
        """Act on the monitor's verdicts: a connection lost after its handshake, or a handshake the
        server refused, fails the requests in flight into ``done``."""
        awaited = self.awaited
        for verdict in read_verdicts(self.monitor_lock, self, self._watch):
            if verdict.action == LOST:
                reason = f"the connection to the server at {self.address} was lost"
                awaited.connection_lost(reason, done)
                self._failed(reason)
            elif verdict.action == REFUSED:
                if awaited.refuse(verdict.message, verdict.permanent, done):
                    log.warning("%s", verdict.message)
                self._failed(verdict.message)
            elif verdict.action == SERVED and awaited.served():
                log.warning("the handshake with %s succeeded: requests go out again", self.address)

    def _failed(self, reason: str) -> None:
        """A failure for the link's callbacks: they run on the link thread (``failures``)."""
        self.failures.append(reason)
        self._thread.wake()

    def shut(self) -> None:
        """The link thread, on its way out: close the socket and its monitor once no other thread
        holds the socket (a reader was woken: it sees ``stopped``)."""
        self.role.close()
        self.role.wait_released(2.0)
        with self.lock:
            self.open = False
        with self.monitor_lock:
            self.sock.disable_monitor()
            if self.monitor is not None:
                self.monitor.close(0)
                self.monitor = None
            self.sock.close(0)

    def term(self) -> None:
        """Once the link thread has ended (after ``shut``)."""
        self.role.dispose()
        self._ctx.term()
