"""``Link``: the requester end of the client -> server link, read by its callers.

Torch-free; imports ``runtime.core``, ``runtime.transport`` and ``runtime.link`` only.

    Link                 the verbs (submit, call, control, wait, cancel), the request's encoding,
                         failure callbacks, close; what the LinkThread calls (tick, poll_items,
                         after_poll, broken, shut)
    ├── Dealer           the DEALER socket, used by its holder: the caller that reads, or the
    │                    LinkThread when replies are due and no caller reads (runtime.link.dealer)
    ├── Awaited          the PendingTable of requests in flight, the states (refused, lost,
    │                    closed), what each reply does (runtime.link.awaited)
    └── CurrentSession   the ShmSession with the current server instance (runtime.link.current_session)

    call(p), socket free: [lock: register + take the socket] send; read until its Slot is done;
      its own plain reply: [lock: claim + give the socket back]
    submit(p): [lock: register + take the socket if free] send; give it back, waking the LinkThread
      to read; the socket held by another thread: queued, its holder sends it
    LinkThread: heartbeats (requests silent for heartbeat_timeout_s fail), the monitor's verdicts
      (a lost connection or a refused handshake fails everything in flight), failure callbacks

Invariants:
- Every ``concurrent.futures.Future`` handed out only waits: ``result()`` does no I/O; ``call``'s
  ``Slot`` is answered by the caller reading (or by whoever reads, when another thread does).
- A failure (connection lost, server restarted, handshake refused, the thread broken) fails
  everything in flight once; ``on_failure`` callbacks run on the LinkThread, never under a lock
  nor on a submitter's stack.
- ``close()`` fails what is in flight, wakes the reader (it gives the socket back), then the
  LinkThread shuts the socket once nobody holds it; the context and pipes go once it ended.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from runtime.core.futures import Slot
from runtime.link.awaited import Awaited, Request
from runtime.link.client_protocol import HEARTBEAT, control_header, plain_submit, submit_message
from runtime.link.dealer import Dealer
from runtime.link.link_thread import LinkThread
from runtime.link.current_session import CurrentSession

__all__ = ["Link", "LinkOptions"]

log = logging.getLogger("phyrt.client")


@dataclass(frozen=True)
class LinkOptions:
    """Plain data: how the link decodes, uses shared memory, beats and authenticates."""

    tensor_type: str = "numpy"
    shm: bool = False
    shm_threshold: int = 64 << 10
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    server_public_key: str | bytes | None = None
    public_key: str | bytes | None = None
    secret_key: str | bytes | None = None


class Link:
    """One client's link to one server address (see the module). ``errors`` names the exception
    types (``runtime.client.server_errors``); the link owns ``thread`` from now on."""

    def __init__(self, address: str, options: LinkOptions, errors: Any, thread: LinkThread) -> None:
        self.address = address
        self._interval, self._timeout = options.heartbeat_interval_s, options.heartbeat_timeout_s
        self._shm = CurrentSession(options.shm, options.shm_threshold, self._post)
        self.awaited = Awaited(address, options.tensor_type, self._shm, errors)
        try:
            self.dealer = Dealer(address, options, self.awaited, thread)
        except BaseException:
            self._shm.close()
            raise
        self._ids = itertools.count()
        self._callbacks: list[Callable[[str], None]] = []
        self._thread_done: list = []  # what the thread read this turn, completed after it gave the socket back
        self._next_beat = time.monotonic()
        self._silent = False  # the silence past the timeout was reported
        self._thread = thread
        thread.add(self)
        try:
            thread.start()
        except BaseException:  # no thread to close the socket: close it here
            self.dealer.shut()
            self.dealer.term()
            self._shm.close()
            thread.dispose()
            raise

    # -- the verbs ---------------------------------------------------------------------

    def submit(self, payload: Any, timeout: float | None = None, stream: Any = None, priority: int = 0) -> Future:
        """Send a submit (a stream op with ``stream``, a StreamState); its Future, with ``request_id``.
        The link's thread reads the reply unless a caller does. ``priority``: checked by the caller."""
        future: Any = Future()
        request, frames = self._prepare(payload, timeout, stream, future, priority)
        dealer = self.dealer
        owned = dealer.enter(request)
        if not self._by_lane(request, frames):
            dealer.transmit(request.key, frames, owned)  # given back: the thread is woken to read
        elif owned == 1:
            dealer.leave()
        return future

    def call(self, payload: Any, timeout: float | None = None, priority: int = 0) -> Slot:
        """Send a submit and read until its Slot is done or ``timeout`` passed; the Slot."""
        slot = Slot()
        request, frames = self._prepare(payload, timeout, None, slot, priority)
        deadline = None if timeout is None else time.monotonic() + timeout
        dealer = self.dealer
        owned = dealer.enter(request)
        if not self._by_lane(request, frames):
            dealer.transmit(request.key, frames, owned, keep=True)
        if owned:
            dealer.read(slot, deadline, owned == 1)
        if not slot.done():
            self.wait(slot, None if deadline is None else deadline - time.monotonic())
        return slot

    def control(self, op: str, **fields: Any) -> Future:
        """Send a control op (``ping``, ``info``, ``cancel``); its Future."""
        request_id = next(self._ids)
        future: Any = Future()
        future.request_id = request_id
        request = Request(request_id, future, op, time.monotonic())
        self.dealer.transmit(request_id, [control_header(op, request_id, **fields)], self.dealer.enter(request))
        return future

    def need_reader(self) -> None:
        """Replies are due: wake the link thread to read them unless a thread reads already."""
        if self.dealer.role.holder is None:
            self._thread.wake()

    def cancel(self, request_id: int) -> None:
        """Ask the server to drop a request still in flight."""
        if request_id in self.awaited.table.table:
            self.dealer.transmit(None, [control_header("cancel", "cancel", target=request_id)], self.dealer.take())

    def wait(self, future: Any, timeout: float | None) -> bool:
        """Until ``future`` is done (True) or ``timeout`` passed (False): reading while the socket is
        free or this thread's, else sleeping on the future, which the reader completes."""
        return self.dealer.role.wait(future, timeout, self._read)

    def _read(self, future: Any, deadline: float | None) -> None:
        self.dealer.read(future, deadline, False)  # (the role's wait gives the socket back)

    def lend(self, nbytes: int) -> Any:
        return self._shm.lend(nbytes)

    def wants_shm(self) -> bool:
        return not self.awaited.closed and self._shm.wants()

    @property
    def session(self) -> Any:
        """The shared-memory session with the current server instance (None: frames only, or not yet)."""
        return self._shm.current

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` after each failure (connection lost, server restarted, handshake refused,
        no word past heartbeat_timeout_s, thread broken), on the link's thread, with no lock held."""
        self._callbacks.append(callback)

    def close(self) -> None:
        """Fail what is in flight, stop the thread, release sockets and segments. Idempotent."""
        awaited, dealer = self.awaited, self.dealer
        with awaited.lock:
            if awaited.closed:
                return
            awaited.closed = True  # no request enters from now on
        dealer.role.close()  # nor takes the socket
        taken = awaited.table.take_all()
        lost = awaited.errors.ConnectionLostError
        awaited.complete([(p.future, None, lost(f"the client of {self.address} was closed")) for p in taken])
        dealer.role.wake()  # a reading caller gives the socket back
        dealer.leave(hand_on=False)  # closed from a callback run by the reading caller
        ended = self._thread.stop()
        self._shm.drop()
        if ended:
            self._thread.dispose()
            dealer.term()
            self._shm.close()

    # -- sending -----------------------------------------------------------------------

    def _prepare(self, payload: Any, timeout: float | None, stream: Any, future: Any,
                 priority: int = 0) -> tuple[Request, list[Any]]:
        """A submit's Request (not yet in the table) and the frames to send."""
        request_id = next(self._ids)
        future.request_id = request_id
        session = self._shm.current
        shm_results = session is not None and session.mapper is not None
        # a plain payload needs no encoder, unless dropped results' blocks are to ride in its header
        data = plain_submit(request_id, timeout, shm_results, payload, stream is not None, priority) \
            if session is None or not session.released else None
        blocks, released, frames = None, None, [data]
        if data is None:
            encoder = self._shm.encoder(session)
            # dropped results' blocks ride in the header: one message for the server to read, not two
            released = session.take_released() if session is not None and session.released else None
            try:
                data = submit_message(encoder, request_id, timeout, shm_results, payload, released, stream is not None,
                                      priority)
            except BaseException:
                if session is not None:
                    session.free(encoder.blocks)
                    if released:  # they ride with a later message
                        session.give_back(released)
                raise
            blocks, frames = encoder.blocks, [data, *encoder.frames]
        return Request(request_id, future, "submit", time.monotonic(), blocks, session, released, stream), frames

    def _by_lane(self, request: Request, frames: list[Any]) -> bool:
        """Sent by the session's lane (``runtime.link.lane``): a submit (not a stream), with blocks of
        shared memory only while the segments of its session were all registered by that lane."""
        lane = self._shm.lane
        if lane is None or request.stream is not None:
            return False
        if request.blocks and (request.session is None or request.session.lane is not lane
                               or not request.session.registers_by_lane):
            return False
        return lane.send(frames)

    def _post(self, frames: list[Any]) -> None:
        """Queue a message with no reply (CurrentSession's registers go out before what uses them)."""
        self.dealer.outbox.append((None, frames))  # (a register: one frame, no snapshot needed)

    # -- the link thread ---------------------------------------------------------------

    def tick(self, now: float) -> float:
        """The heartbeat when due (requests silent too long fail; a silence past the timeout is a
        failure); failure callbacks."""
        dealer = self.dealer
        if now >= self._next_beat:
            if not self.awaited.refused and not dealer.stopped:
                silent = self.awaited.silent(now, self._timeout)
                dealer.transmit(None, [HEARTBEAT], dealer.take())
                self._fail(silent)
                self._watch_silence(now)
            self._next_beat = now + self._interval
        while dealer.failures:
            reason = dealer.failures.popleft()
            for callback in list(self._callbacks):
                try:
                    callback(reason)
                except Exception:
                    log.exception("a failure callback of the link to %s failed", self.address)
        return self._next_beat

    def _watch_silence(self, now: float) -> None:
        """A failure once the server has said nothing for heartbeat_timeout_s (again after it spoke)."""
        quiet = now - self.awaited.last_heard
        if quiet <= self._timeout:
            self._silent = False
        elif not self._silent:
            self._silent = True
            self.dealer.failures.append(f"no word from {self.address} for {quiet:.1f} s (heartbeat_timeout_s)")

    def poll_items(self) -> list[tuple[Any, Callable[[], None]]]:
        """The monitor; and the socket while replies are due and no caller reads it."""
        dealer = self.dealer
        items: list[tuple[Any, Callable[[], None]]] = []
        if dealer.monitor is not None:
            items.append((dealer.monitor, self._on_monitor))
        if dealer.role.take_if_due():
            dealer.polling = True
            done: list = []
            dealer.outbox.flush(dealer, done)
            if done or dealer.outbox:  # answer those first, and look again at once
                dealer.polling = False
                dealer.leave(hand_on=False)
                self._fail(done)
                self._thread.wake()
                return items
            items += [(dealer.sock, self._on_readable), (dealer.role.fd, dealer.role.drain)]
            if dealer.lane_fd is not None:
                items.append((dealer.lane_fd, self._on_lane))
        return items

    def _on_lane(self) -> None:
        self.dealer.read_lane(self._thread_done)

    def _on_readable(self) -> None:
        self.dealer.read_one(self._thread_done)

    def _on_monitor(self) -> None:
        done: list = []
        self.dealer.watch_monitor(done)
        self._fail(done)

    def after_poll(self) -> None:
        """Give the socket back (no hand-on: the thread looks again next turn); complete what it read."""
        dealer = self.dealer
        dealer.polling = False
        dealer.leave(hand_on=False)
        done, self._thread_done = self._thread_done, []
        self._fail(done)

    def broken(self, exc: BaseException) -> None:
        """The thread failed (a bug): everything fails, now and later."""
        awaited = self.awaited
        awaited.broken = f"the client's I/O thread failed: {exc!r}"
        self.dealer.role.close()
        done: list = []
        awaited.connection_lost(awaited.broken, done)
        self._fail(done)

    def _fail(self, done: list) -> None:
        """(On the link thread.) Complete ``done``; wake a caller that holds the socket, whose own
        future may be among them. One that takes it later finds its future done before it polls."""
        if done:
            self.awaited.complete(done)
            role = self.dealer.role
            if role.holder is not None and not role.held_here():
                role.wake()

    def shut(self) -> None:
        self.dealer.shut()
