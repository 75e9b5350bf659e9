"""SIGINT and SIGTERM acted on in a thread of their own, never inside the signal handler.

A Python signal handler runs in the main thread between two bytecodes, whatever that thread
was doing: it may hold a lock at that moment (the one inside ``threading.Event.wait`` every
time its time-out ends), and a handler that takes the same lock (``Event.set``) never
returns. The server hung exactly so, once in many runs, on SIGTERM. Here the handler only
writes the signal's number to a pipe (one system call, no lock); a daemon thread reads the
pipe and calls ``on_signal(signum)`` there, where taking locks is safe.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = logging.getLogger("phyrt.signals")


class SignalRelay:
    """Installs a handler for SIGTERM and SIGINT that hands each arrival to ``on_signal`` in
    the thread ``phyrt-signals``. Signals arrive in order; one that finds the pipe full (64 KiB
    of signals not yet handled) is dropped, which loses nothing a stop needs."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._relay, name="phyrt-signals", daemon=True)
        self._thread.start()
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        try:
            os.write(self._write_fd, bytes([signum]))
        except (BlockingIOError, OSError):
            pass

    def _relay(self) -> None:
        while True:
            try:
                arrived = os.read(self._read_fd, 64)
            except OSError:
                return
            if not arrived:
                return
            for signum in arrived:
                try:
                    self._on_signal(signum)
                except Exception:  # the next signal must still be acted on
                    log.exception("acting on %s failed", signal.Signals(signum).name)
