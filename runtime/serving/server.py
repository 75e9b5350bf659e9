"""Server: an Engine behind a ``runtime.link.listener.Listener`` (a ZeroMQ ROUTER; the wire: docs/protocol.md).

    clients (DEALER)                  I/O thread (IoLoop)                                 engine
    [header, *tensor frames] ----->  Listener.read_batch (tensor frames: no copy)
                                     MessageHandler.handle (handlers.py): decode, check,
                                       pending.add, engine.submit ---------------------->  Future
                                       ping, info, cancel, register, release
                                     Replies.settle (outcomes.py): deadlines from the heap
                                                          done callback, on the engine's thread:
    <----- [header, *tensor frames] ------------------    Replies.on_done claims the request,
                                                          encodes and sends the reply
                                                          (Listener.send: never blocks)

With an inline engine, two I/O threads take turns running the loop (``Turns``): an idle
engine runs a submit in the thread that read it (``Engine.inline_runner()``: no hop to the
engine's thread and back, which cost about as much as the rest of the round trip), which
gives the loop to the other thread meanwhile, so the socket, pings and deadlines are still
served. Otherwise one I/O thread runs it.

    Server(engine, address, ...)   binds (Listener), nothing runs yet
    start()                        the I/O thread(s)
    stop_accepting()               new submits refused; ping and info still answer
    wait_drained(timeout)          until the engine holds none of our requests
    close(drain_timeout_s)         stop accepting, drain, close the engine (failing what is
                                   left), let the last replies out, stop the threads, release
                                   the socket, every segment and the ipc socket file

The loop, run by whichever thread holds the turn:

    while not stopped:
        poll(ROUTER fd, wake fd) until a message, a wake-up, the next deadline or housekeeping
        settle (replies owed, deadlines due); housekeeping once a second; drained?
        backlog += messages read (when it is empty)
        for each message of the backlog, in order: handle(identity, frames, turn)
            (a submit run here hands the loop over and takes it back after, unless the
            standby took it, backlog and all: then this thread stands by)

Invariants:
- The server owns the engine it serves, the listener (socket, pending table, the clients'
  shared memory) and the threads; ``close()`` releases them all, once (idempotent).
- Only the thread holding the turn runs the loop, reads the socket, takes messages from the
  backlog and answers deadlines; engine threads send their replies themselves.
- At most one thread is the ``looper`` (changed under ``Turns._lock``), and only it hands
  the loop over. Nobody is woken for a request that ends before the standby's next tick
  (``TICK_S``): its thread takes the loop back. So the socket waits at most ``TICK_S`` for a
  long request run here (a timer per request cost more than it saved).
- A request run here stays out of the pending table (nobody else looks at it) unless the
  standby takes the loop meanwhile: then it adopts the request (``Turns.away``, under
  ``Turns._lock``) into the table, where its deadline, a cancel and the drain see it; the
  running thread's ``take_back`` tells which happened (``Replies.finish``'s ``ours``).
- Messages are handled in the order they arrived; the one a submit runs here for is taken
  off the backlog first, so the rest never waits behind a long request.
- Before sleeping, the looping thread polls for a short while (``runtime.transport.spin``)
  while the engine holds nothing, when requests run here.
- A server bug in one message is logged and answered with InvalidRequest; a bug in the loop
  itself stops it (the standby does not take over a broken loop) and sets ``idle``/``drained``.
- Request tensors are read-only views of the received frames, or of the client's registered
  segments (ipc:// only; mapped, then unlinked at once): plugins must not write into inputs.
- Same-host trust: ipc:// sockets live in an owner-only directory, so a peer is a process
  of the same user; such a process can also signal or ptrace the server, so shared memory
  does not try to defend against it (it could, say, truncate a segment it registered).
"""

from __future__ import annotations

import collections
import functools
import logging
import select
import threading
import time
from typing import Any, Callable

from runtime.link.listener import Listener
from runtime.serving.handlers import (DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES,
                                      MessageHandler, ServerOptions)
from runtime.transport.arena import sweep_stale
from runtime.transport.endpoints import CurveKeys, check_address
from runtime.transport.spin import Spinner, budget_ns

__all__ = ["Server", "ServerOptions", "DEFAULT_MAX_INFLIGHT", "DEFAULT_MAX_MESSAGE_BYTES", "MAX_HEADER_BYTES"]

log = logging.getLogger("phyrt.server")

_HOUSEKEEPING_S = 1.0
#: how often the standby looks whether the loop is free: the longest a request run by the
#: looping thread leaves the socket unread
TICK_S = 0.01


class Turns:
    """Who runs the loop: one of the threads in ``serve``, or none while a request runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._looper: int | None = None
        self._stopping = threading.Event()
        self.stopped = False
        #: what the looper runs itself once it hands the loop over (set by the looper before): the
        #: thread that takes the loop adopts it (``serve``'s ``adopt``, under ``_lock``)
        self.away: Any = None

    def serve(self, run: Callable[[], None], adopt: Callable[[Any], None]) -> None:
        """The body of each thread: run the loop whenever it is free, else stand by. Taking
        the loop, a thread first adopts what the former looper runs (``adopt(away)``)."""
        me = threading.get_ident()
        while not self.stopped:
            with self._lock:
                take = self._looper is None and not self.stopped
                if take:
                    self._looper = me
                    away, self.away = self.away, None
                    if away is not None:
                        adopt(away)
            if take:
                run()
            else:
                self._stopping.wait(TICK_S)

    def held_here(self) -> bool:
        """Whether the calling thread runs the loop now."""
        return self._looper == threading.get_ident()

    def hand_over(self) -> None:
        """The looper is about to run a long call itself: the standby takes the loop at its
        next tick, unless this thread takes it back first."""
        with self._lock:
            self._looper = None

    def take_back(self) -> bool:
        """After that call: True if this thread loops on (nobody adopted ``away``); False if the
        standby took the loop meanwhile (or ``stop()`` came)."""
        me = threading.get_ident()
        with self._lock:
            if self._looper is not None or self.stopped:
                return False
            self._looper = me
            self.away = None
            return True

    def stop(self) -> None:
        """Nobody takes the loop from now on; the standby returns at once."""
        self.stopped = True
        self._stopping.set()


class IoLoop:
    """Reads ``listener`` and hands each message to ``messages``; ``run`` is the body of a turn."""

    def __init__(self, listener: Listener, messages: MessageHandler, turns: Turns) -> None:
        self._listener = listener
        self._messages = messages
        self._turns = turns
        self._runs_here = messages.runs_here
        self.idle = threading.Event()  # not accepting, and the engine holds nothing of ours
        self.drained = threading.Event()  # idle, or told not to wait (skip_drain)
        self._spinner = Spinner(budget_ns("server") if self._runs_here else 0)
        self._next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        self._backlog: collections.deque[tuple[bytes, list[Any]]] = collections.deque()  # read, not handled
        self.hand_over = turns.hand_over  # (handlers.Turn) the standby takes the loop at its next tick

    # -- handlers.Turn: what a submit run here does with the loop ----------------------

    def lend(self, request: Any) -> None:
        """``request`` is about to run here: a thread that takes the loop meanwhile adopts it (into
        the pending table, so that its deadline, a cancel and the drain see it)."""
        self._turns.away = request

    def take_back(self) -> bool:
        """After a request run here: True if this thread loops on and nobody adopted the request."""
        if self._turns.take_back():
            self._listener.recheck = True  # messages that came meanwhile: read them before sleeping
            return True
        return False

    def stop(self) -> None:
        """End the loop in every thread (``close()``)."""
        self._turns.stop()
        self._listener.wake()

    def run(self) -> None:
        """The loop, until stopped or until this thread handed it over."""
        listener = self._listener
        poller = select.poll()
        poller.register(listener.fd, select.POLLIN)  # edge-triggered: see runtime.link.listener
        poller.register(listener.wake_fd, select.POLLIN)
        if listener.doorbell_fd is not None:  # same-host clients' lanes (runtime.link.lane)
            poller.register(listener.doorbell_fd, select.POLLIN)
        wake_fd = listener.wake_fd
        spinner = self._spinner
        poll_now = functools.partial(poller.poll, 0)
        requests = listener.pending.table
        backlog = self._backlog
        more = True  # messages may be waiting: read before sleeping
        try:
            while not self._turns.stopped:
                if more or listener.recheck or backlog:  # work at hand: no poll (a wake-up waits in its pipe)
                    events = ()
                else:
                    wait_ms = self._wait_ms()
                    if not requests:  # (an engine thread at work needs the GIL)
                        events = spinner.wait(poll_now, poller.poll, wait_ms,
                                              budget=min(spinner.budget, int(wait_ms * 1e6)))
                    else:
                        events = poller.poll(wait_ms)
                for fd, _ in events:
                    if fd == wake_fd:
                        listener.drain_wake()
                listener.recheck = False
                self._bookkeeping()
                if not backlog:
                    batch, more = listener.read_batch()
                    backlog.extend(batch)
                if not self._handle_backlog():
                    return
        except BaseException:  # a bug: log it, and let close() release what is left
            log.exception("the server's I/O thread failed")
            self._turns.stop()  # the other I/O thread does not take over a broken loop
            self.idle.set()
            self.drained.set()

    def _wait_ms(self) -> float:
        """How long to sleep in poll: until the next deadline or housekeeping (+1 ms)."""
        now = time.monotonic()
        wait = self._next_housekeeping - now
        deadline = self._listener.pending.peek_deadline()
        if deadline is not None:
            wait = min(wait, deadline - now)
        return max(0.0, wait) * 1000 + 1

    def _bookkeeping(self) -> None:
        messages = self._messages
        now = messages.settle()
        if now >= self._next_housekeeping:
            messages.housekeeping(now)
            self._next_housekeeping = now + _HOUSEKEEPING_S
        if not messages.accepting and not self._listener.pending.table:
            self.idle.set()
            self.drained.set()

    def _handle_backlog(self) -> bool:
        """Handle the backlog in order; False once this thread no longer holds the loop."""
        backlog = self._backlog
        handle = self._messages.handle
        turn = self if self._runs_here else None  # a submit may run in this thread
        while backlog:
            identity, frames = backlog.popleft()
            try:
                handle(identity, frames, turn)
            except Exception:  # a server bug must not take the loop down
                log.exception("failed to handle a message from %r", identity)
                self._messages.replies.error(identity, None, None, "InvalidRequest",
                                             "the server could not process this message (see its log)")
            if turn is not None and not self._turns.held_here():  # it ran here; the other thread loops now
                return False
        return True


class Server:
    """Serves ``engine`` on ``address`` (bound here; ``start()`` runs the I/O thread)."""

    def __init__(self, engine: Any, address: str, *, max_inflight: int = DEFAULT_MAX_INFLIGHT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, curve: CurveKeys | None = None,
                 client_timeout_s: float = 60.0, info: dict[str, Any] | None = None,
                 metrics: Any = None) -> None:
        options = ServerOptions(max_inflight, max_message_bytes, client_timeout_s, dict(info or {}))
        check_address(address, curve is not None)
        self._engine = engine
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._turns = Turns()
        self._listener = Listener(address, max_message_bytes, curve, self._turns.held_here)
        self.address: str = self._listener.address
        try:
            self._messages = MessageHandler(engine, self._listener, options, metrics=metrics)
        except BaseException:
            self._listener.close(0)
            raise
        self._shm = self._listener.peers  # the clients' shared memory (tests look at it)
        self._loop = IoLoop(self._listener, self._messages, self._turns)

    @property
    def server_id(self) -> str:
        return self._messages.server_id

    @property
    def inflight(self) -> int:
        """Requests the engine still holds for this server (what ``max_inflight`` counts)."""
        return self._messages.inflight

    def info(self) -> dict[str, Any]:
        """What ``info`` answers: plugin, topology, replicas, versions, limits."""
        return self._messages.info()

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> "Server":
        sweep_stale()  # names left by phyrt processes that were killed
        # the second I/O thread stands by for a looping thread that runs a request itself
        count = 2 if self._messages.runs_here else 1
        serve = functools.partial(self._turns.serve, self._loop.run, self._listener.pending.add)
        self._threads = [threading.Thread(target=serve, name=f"phyrt-server-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()
        return self

    def stop_accepting(self) -> None:
        """New submits get EngineUnavailable from now on; ping and info still answer."""
        self._messages.stop_accepting()
        self._listener.wake()

    def skip_drain(self) -> None:
        """Make a ``close()`` that waits for in-flight requests stop waiting now."""
        self.stop_accepting()
        self._loop.drained.set()

    def wait_drained(self, timeout: float | None) -> bool:
        """After ``stop_accepting``: wait until the engine holds no request; False on time-out."""
        return self._loop.drained.wait(timeout)

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``drain_timeout_s``,
        then close the engine (failing what is left), send the last replies and release
        every socket, segment and the ipc socket file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        started = bool(self._threads)
        running = started and self._threads[0].is_alive()
        if running:
            self.stop_accepting()
            if not self.wait_drained(drain_timeout_s):
                log.warning("%d request(s) still in flight after %.1f s; failing them", self.inflight,
                            drain_timeout_s)
        try:
            self._engine.close(timeout=2.0)
        finally:
            if running:
                self._loop.idle.wait(2.0)  # the engine failed what it held: let those replies go out
                self._loop.stop()
                for thread in self._threads:
                    thread.join(10)
            # a moment for the last replies to reach their clients; then every client's shared memory
            self._listener.close(linger_ms=500 if started else 0)
            self._messages.close()
            sweep_stale()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
