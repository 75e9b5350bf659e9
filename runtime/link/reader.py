"""ReaderRole: at most one thread reads a link's socket, and a thread waiting for its answer reads it itself.

Torch-free: imports only ``runtime.transport.wake_pipe`` and ``runtime.core.futures`` of the project.

The one implementation of the reader rule, for both links that read answers for many futures on
one socket: the client's DEALER (``runtime.link.dealer``, where the role's holder also sends) and
the supervisor's ctl ROUTER and answer lanes (``supervisor.supervisor``). Handing every answer
from an I/O thread to the waiting caller costs a thread switch per round trip, so the socket has
one *reader* at a time (leader/follower):

    caller A: wait(fa)  --take-->  reader: read(fa, deadline) ... completes fa, fb, ...
    caller B: wait(fb)             not the reader: sleeps on fb (A completes it)
    A's fa done        --leave-->  role free; answers still due: on_leave(True) wakes the link thread
    link thread        --take_if_due-->  reader for one turn, then leave()

Invariants:
- The role is held by one thread (``holder``) or none; only the holder touches the
  socket's receiving side. It changes under ``lock``, which owners share to keep their
  own bookkeeping (what is due) consistent with it: the lock is also the memory barrier
  ZMQ asks for when a socket changes threads.
- A take says how it got the role: 1 taken now, 2 held by this thread already (a completion
  callback, run by the reader, that waits on another future reads there), 0 not (another
  thread holds it, or the role is closed). Only the take that answered 1 gives the role up,
  so a nested wait never takes the role from the reader up its stack.
- Every give-up calls ``on_leave(hand_on)`` outside the lock; ``hand_on`` says answers are
  still due and nobody reads: the owner wakes its link thread to take the role (the link
  thread itself leaves with ``hand_on=False``). A caller that is not the reader sleeps on its
  future, which the reader completes.
- A caller that will wait for its answer may take the role before it sends (``take_free``),
  so that nobody else is woken to read; its ``wait(..., owned=1)`` then reads, and gives the
  role up even when the future was completed by someone else meanwhile.
- ``wake()`` interrupts the reader: it polls ``fd`` beside its socket and calls
  ``drain()`` when it fires (a failure completed futures elsewhere, ``close()``, work
  to send). After ``close()`` nothing can take the role; ``wait_released`` lets the
  closer wait until the reader is gone. ``dispose()`` closes the pipe, once no thread
  polls it.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Callable

from runtime.core.futures import Slot
from runtime.transport.wake_pipe import WakePipe

_get_ident = threading.get_ident


class ReaderRole:
    """Who reads one socket. ``awaiting()`` (called under ``lock``) tells whether answers are
    still due; ``on_leave(hand_on)`` (called without it) follows every give-up."""

    def __init__(self, awaiting: Callable[[], bool], on_leave: Callable[[bool], None],
                 lock: threading.Lock | None = None) -> None:
        self.lock = lock if lock is not None else threading.Lock()
        self._awaiting = awaiting
        self._on_leave = on_leave
        self._left = threading.Condition(self.lock)
        self._holder: int | None = None
        self._pipe = WakePipe()
        self.closed = False

    # -- who holds it -----------------------------------------------------------------

    @property
    def holder(self) -> int | None:
        """The ident of the thread holding the role, or None."""
        return self._holder

    def held_here(self) -> bool:
        return self._holder == _get_ident()

    def take_locked(self) -> int:
        """Under ``lock``: 1 if the calling thread takes the free role now, 2 if it holds it already,
        0 if another thread does or the role is closed."""
        holder = self._holder
        if holder is None:
            if self.closed:
                return 0
            self._holder = _get_ident()
            return 1
        return 2 if holder == _get_ident() else 0

    def take(self) -> int:
        """``take_locked`` under ``lock``."""
        with self.lock:
            return self.take_locked()

    def take_free(self) -> int:
        """1 if the calling thread takes the role because nobody holds it; 0 if a thread does (this
        one included: its ``wait`` re-enters) or the role is closed."""
        if self._holder is not None:
            return 0
        with self.lock:
            if self._holder is not None or self.closed:
                return 0
            self._holder = _get_ident()
            return 1

    def take_if_due(self) -> bool:
        """The link thread's take: the role, if it is free and answers are due (or it holds it already)."""
        with self.lock:
            if self._holder is None and not self.closed and self._awaiting():
                self._holder = _get_ident()
            return self._holder == _get_ident()

    def release_locked(self, hand_on: bool = True) -> bool | None:
        """Under ``lock``: give the role up if this thread holds it; then whether to hand the reading
        on (``hand_on`` and answers still due), or None when it did not hold it. Its caller then does
        what ``on_leave`` does, outside the lock (the client gives its socket back with a reply's
        claim, in one hold)."""
        if self._holder != _get_ident():
            return None  # not ours (close() may have taken it away)
        self._holder = None
        if self.closed:  # only wait_released waits on it, and only after close()
            self._left.notify_all()
            return False
        return hand_on and self._awaiting()  # (the link thread, leaving each turn, asks nothing)

    def leave(self, hand_on: bool = True) -> bool:
        """Give the role up (if this thread holds it; False if not), then ``on_leave(hand_on and
        answers are still due)``."""
        with self.lock:
            due = self.release_locked(hand_on)
        if due is None:
            return False
        self._on_leave(due)
        return True

    # -- waiting for an answer ---------------------------------------------------------

    def wait(self, future: Future | Slot, timeout: float | None,
             read: Callable[[Future, float | None], None], owned: int = 0) -> bool:
        """Until ``future`` is done (True) or ``timeout`` passed (False): as the reader when the
        role is free or this thread's, calling ``read(future, deadline)`` (read until the future
        is done, the deadline passes or ``wake()``); otherwise sleeping on the future, which
        the reader completes. ``owned``: what the caller's own take before sending answered (1:
        the role is given up here at the end, whatever happens)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not future.done():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                took = self.take()
                if took and not self.closed:
                    owned = owned or took  # 2: a reader's callback waiting, up its stack: the reader leaves
                    read(future, deadline)
                    continue
                if owned == 1:  # closed: nobody reads from now on (close fails what is due)
                    owned = 0
                    self.leave()
                if isinstance(future, Slot):
                    future.wait(remaining)
                else:
                    futures.wait([future], remaining)  # (not future.result: subclasses may read there)
            return True
        finally:
            if owned == 1:
                self.leave()

    # -- interrupting the reader, closing ------------------------------------------------

    @property
    def fd(self) -> int:
        """Poll it beside the socket; ``drain()`` when it fires."""
        return self._pipe.fd

    def wake(self) -> None:
        self._pipe.wake()

    def drain(self) -> None:
        self._pipe.drain()

    def close(self) -> None:
        """Nobody takes the role from now on; the reader is woken (it sees ``closed``)."""
        with self.lock:
            self.closed = True
        self._pipe.wake()

    def wait_released(self, timeout: float) -> bool:
        """After ``close()``: wait until no other thread holds the role; False on time-out."""
        me = _get_ident()
        with self.lock:
            return self._left.wait_for(lambda: self._holder is None or self._holder == me, timeout)

    def dispose(self) -> None:
        """Close the wake-up pipe (once no thread polls it; ``wake`` is a no-op after)."""
        self._pipe.close()
