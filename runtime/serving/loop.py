"""IoLoop: the server's I/O loop, run by whichever thread holds the turn (``runtime.serving.turns``).

Imports ``runtime.serving`` (router, handlers, turns) and ``runtime.transport.spin`` of the project.

    while not stopped:
        poll(ROUTER fd, wake fd) until a message, a wake-up, the next deadline or housekeeping
        messages.settle()           replies the I/O thread owes, deadlines due
        messages.housekeeping()     once a second
        drained? (not accepting, nothing in flight) -> idle, drained
        backlog += messages read (when it is empty)
        for each message of the backlog, in order:  messages.handle(identity, frames, turn)
            turn = this loop, when the engine may run a submit here: it hands the loop over,
            runs, takes it back (or the standby has taken it, backlog and all: this thread
            returns and stands by)

Invariants:
- Only the thread holding the turn runs this loop, reads the socket, takes messages from
  the backlog and answers deadlines; engine threads send their replies themselves
  (``ServerSocket.send``).
- Messages are handled in the order they arrived. The one a submit runs here for is taken
  off the backlog first, so the rest never waits behind a long request: the standby takes
  the loop, backlog and all, within ``TICK_S``. Under load, then, every submit that finds
  the engine idle runs in the reading thread (no hop to the engine's thread and back), not
  only the last of a batch.
- Bookkeeping comes before the messages: the last thing before sleeping again is handing
  requests to the engine, whose woken thread then waits for the GIL the least.
- Before sleeping, the looping thread polls for a short while (``runtime.transport.spin``)
  while the engine holds nothing, when requests run here: a thread woken from sleep ran
  this path about twice as slowly on our machines.
- A server bug in one message is logged and answered with InvalidRequest; a bug in the
  loop itself stops it (the standby does not take over a broken loop) and sets
  ``idle``/``drained`` so that ``close()`` does not wait for it.
"""

from __future__ import annotations

import collections
import functools
import logging
import select
import threading
import time
from typing import Any

from runtime.serving.handlers import MessageHandler
from runtime.serving.router import ServerSocket
from runtime.serving.turns import Turns
from runtime.transport.spin import Spinner, budget_ns

log = logging.getLogger("phyrt.server")

_HOUSEKEEPING_S = 1.0


class IoLoop:
    """Reads ``socket`` and hands each message to ``messages``; ``run`` is the body of a turn."""

    def __init__(self, socket: ServerSocket, messages: MessageHandler, turns: Turns) -> None:
        self._socket = socket
        self._messages = messages
        self._turns = turns
        self._runs_here = messages.runs_here
        self.idle = threading.Event()  # not accepting, and the engine holds nothing of ours
        self.drained = threading.Event()  # idle, or told not to wait (skip_drain)
        self._spinner = Spinner(budget_ns("server") if self._runs_here else 0)
        self._next_housekeeping = time.monotonic() + _HOUSEKEEPING_S
        self._backlog: collections.deque[tuple[bytes, list[Any]]] = collections.deque()  # read, not handled
        self.hand_over = turns.hand_over  # (handlers.Turn) the standby takes the loop at its next tick

    # -- the turn a submit run here gives up (handlers.Turn) ------------------------------

    def take_back(self) -> None:
        if self._turns.take_back():
            self._socket.recheck = True  # messages that came meanwhile: read them before sleeping

    def stop(self) -> None:
        """End the loop in every thread (``close()``)."""
        self._turns.stop()
        self._socket.wake()

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """The loop, until stopped or until this thread handed it over."""
        socket = self._socket
        poller = select.poll()
        poller.register(socket.fd, select.POLLIN)  # edge-triggered: see runtime.serving.router
        poller.register(socket.wake_fd, select.POLLIN)
        wake_fd = socket.wake_fd
        spinner = self._spinner
        poll_now = functools.partial(poller.poll, 0)
        requests = self._messages.requests.table
        backlog = self._backlog
        more = True  # messages may be waiting: read before sleeping
        try:
            while not self._turns.stopped:
                if more or socket.recheck or backlog:  # work at hand: no poll (a wake-up waits in its pipe)
                    events = ()
                else:
                    wait_ms = self._wait_ms()
                    if not requests:  # (an engine thread at work needs the GIL)
                        events = spinner.wait(poll_now, poller.poll, wait_ms,
                                              budget=min(spinner.budget, int(wait_ms * 1e6)))
                    else:
                        events = poller.poll(wait_ms)
                if events and (len(events) > 1 or events[0][0] == wake_fd):
                    socket.drain_wake()
                socket.recheck = False
                self._bookkeeping()
                if not backlog:
                    batch, more = socket.read_batch()
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
        deadline = self._messages.requests.next_deadline()
        if deadline is not None:
            wait = min(wait, deadline - now)
        return max(0.0, wait) * 1000 + 1

    def _bookkeeping(self) -> None:
        messages = self._messages
        next_housekeeping = self._next_housekeeping
        now = messages.settle()
        if now >= next_housekeeping:
            messages.housekeeping(now)
            self._next_housekeeping = now + _HOUSEKEEPING_S
        if not messages.accepting and not messages.requests:
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
