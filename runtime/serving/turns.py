"""Turns: two threads take turns running one loop, so that the looping thread may run a long call itself.

Imports nothing of the project.

An idle inline server answers a request in the thread that read it: no hop to the
engine's thread and back (a hop that cost about as much as the rest of the round trip
on our machines). While that thread runs the request, someone must still read the
socket, answer pings and deadlines: the standby thread.

    thread A: serve(run)   looper = A, run() ...  hand_over()      looper = None, runs the request
    thread B: serve(run)   standby: every TICK_S, is the loop free?  yes -> looper = B, run()
    thread A:              request done: take_back()  -> False (B loops): A is the standby now
                                      or, before B's tick:  -> True (A loops on, nobody was woken)

Invariants:
- At most one thread is the ``looper`` at a time; it changes under ``_lock`` only, and
  only the looper hands the loop over (``hand_over``). ``run()`` returns as soon as its
  thread is no longer the looper (``held_here()`` is False) or ``stopped``.
- Nobody is woken for a request that ends before the standby's next tick: its thread
  takes the loop back. Waking the standby at once cost more than the rest of a small
  request's round trip, and a timer armed per request (timerfd) slowed every request
  more than it saved; so the socket, pings and deadlines wait at most ``TICK_S`` for a
  long request (give or take a GIL switch).
- After ``stop()`` nobody takes the loop; the standby wakes at once.
"""

from __future__ import annotations

import threading
from typing import Callable

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

    def serve(self, run: Callable[[], None]) -> None:
        """The body of each thread: run the loop whenever it is free, else stand by."""
        me = threading.get_ident()
        while not self.stopped:
            with self._lock:
                take = self._looper is None and not self.stopped
                if take:
                    self._looper = me
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
        """After that call: True if this thread loops on; False if the standby took the loop
        meanwhile (or ``stop()`` came)."""
        me = threading.get_ident()
        with self._lock:
            if self._looper is not None or self.stopped:
                return False
            self._looper = me
            return True

    def stop(self) -> None:
        """Nobody takes the loop from now on; the standby returns at once."""
        self.stopped = True
        self._stopping.set()
