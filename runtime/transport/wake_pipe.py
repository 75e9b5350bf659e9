"""A self-pipe that wakes a thread blocked in ``poll`` (``zmq.Poller`` or ``select.poll``) from any other thread.

Leaf module: standard library only.

    any thread: wake()  -- one byte -->  pipe  -->  I/O thread: poll() returns; drain()

Register ``fd`` with the poller. ``wake()`` never blocks (a full pipe means a
wake-up is pending anyway) and is a no-op after ``close()``: both run under one
lock, so a late wake-up never writes to a descriptor number the process has
already handed out again. The owner of the I/O thread closes it once, after the
thread stopped polling.
"""

from __future__ import annotations

import os
import threading


class WakePipe:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        """The read end, for ``poller.register``; -1 once closed."""
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._w >= 0:
                try:
                    os.write(self._w, b"\0")
                except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                    pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both ends. Idempotent."""
        with self._lock:
            for fd in (self._r, self._w):
                if fd >= 0:
                    os.close(fd)
            self._r = self._w = -1
