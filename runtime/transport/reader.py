"""ReaderRole: at most one thread reads a socket, and a thread waiting for its answer reads it itself.

Torch-free: imports only ``runtime.transport.wake_pipe`` and ``runtime.core.futures`` of the project.

Used by the client (``runtime.client``) and the supervisor's request channel: one
socket carries the answers to many futures, and handing every answer from an I/O
thread to the waiting caller costs a thread switch per round trip. So the socket
has one *reader* at a time (leader/follower):

    caller A: wait(fa)  --take-->  reader: read(fa, deadline) ... completes fa, fb, ...
    caller B: wait(fb)             not the reader: sleeps on fb (A completes it)
    A's fa done        --leave-->  role free; answers still due: wake_fallback()
    I/O thread         --take-->   reader until nothing is due, then leave()

Invariants:
- The role is held by one thread (``holder``) or none; only the holder touches the
  socket's receiving side. It changes under ``lock``, which owners may share to keep
  their own bookkeeping (what is due) consistent with it: the lock is also the memory
  barrier ZMQ asks for when a socket changes threads.
- A thread takes the role when it is free, or re-enters it when it already holds it
  (a completion callback, run by the reader, that waits on another future reads
  there: ``depth``); only its outermost exit gives the role up.
- Giving the role up while ``awaiting()`` says answers are still due hands the
  reading on: ``wake_fallback()`` wakes the I/O thread to take it (the fallback
  itself leaves with ``hand_on=False``). A caller that is not the reader sleeps on its
  future, which the reader completes.
- A caller that will wait for its answer takes the role before it sends (``take_free``),
  so that nobody else is woken to read; its ``wait`` then reads, and gives the role up
  even when the future was completed by someone else meanwhile.
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

class ReaderRole:
    """Who reads one socket. ``awaiting()`` (called under ``lock``) tells whether answers are
    still due; ``wake_fallback()`` (called without it) wakes the thread that reads when no
    caller does."""

    def __init__(self, awaiting: Callable[[], bool], wake_fallback: Callable[[], None],
                 lock: threading.Lock | None = None) -> None:
        self.lock = lock if lock is not None else threading.Lock()
        self._awaiting = awaiting
        self._wake_fallback = wake_fallback
        self._left = threading.Condition(self.lock)
        self._holder: int | None = None
        self._depth = threading.local()
        self._pipe = WakePipe()
        self.closed = False

    # -- who holds it -----------------------------------------------------------------

    @property
    def holder(self) -> int | None:
        """The ident of the thread holding the role, or None."""
        return self._holder

    def held_here(self) -> bool:
        return self._holder == threading.get_ident()

    def take_locked(self) -> bool:
        """Under ``lock``: the calling thread becomes the reader if the role is free (True), or
        already holds it (True); False if another thread does or the role is closed."""
        me = threading.get_ident()
        if self._holder is None and not self.closed:
            self._holder = me
        return self._holder == me

    def take(self) -> bool:
        """``take_locked`` under ``lock``."""
        with self.lock:
            return self.take_locked()

    def take_free(self) -> bool:
        """The role for the calling thread if nobody holds it (True); False if a thread does (this
        one included: ``wait`` re-enters it) or the role is closed."""
        if self._holder is not None:
            return False
        with self.lock:
            if self._holder is not None or self.closed:
                return False
            self._holder = threading.get_ident()
            return True

    def leave(self, hand_on: bool = True) -> None:
        """Give the role up (if this thread holds it); with ``hand_on``, wake the fallback
        reader when answers are still due."""
        with self.lock:
            if self._holder != threading.get_ident():
                return  # not ours (close() may have taken it away)
            self._holder = None
            if self.closed:  # only wait_released waits on it, and only after close()
                self._left.notify_all()
            hand_on = hand_on and not self.closed and self._awaiting()
        if hand_on:
            self._wake_fallback()

    # -- waiting for an answer ---------------------------------------------------------

    def wait(self, future: Future | Slot, timeout: float | None,
             read: Callable[[Future, float | None], None]) -> bool:
        """Until ``future`` is done (True) or ``timeout`` passed (False): as the reader when the
        role is free or this thread's, calling ``read(future, deadline)`` (read until the future
        is done, the deadline passes or ``wake()``); otherwise sleeping on the future, which
        the reader completes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        depth = getattr(self._depth, "n", 0)
        try:
            while not future.done():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if not self.take():
                    if isinstance(future, Slot):
                        future.wait(remaining)
                    else:
                        futures.wait([future], remaining)  # (not future.result: subclasses may read there)
                    continue
                self._depth.n = depth + 1
                try:
                    read(future, deadline)
                finally:
                    self._depth.n = depth
            return True
        finally:
            if depth == 0:  # the outermost wait gives the role up (one taken before the send included)
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
        me = threading.get_ident()
        with self.lock:
            return self._left.wait_for(lambda: self._holder is None or self._holder == me, timeout)

    def dispose(self) -> None:
        """Close the wake-up pipe (once no thread polls it; ``wake`` is a no-op after)."""
        self._pipe.close()
