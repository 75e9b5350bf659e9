"""``LinkThread``: the one thread of a process that owns file descriptors for its links.

Torch-free; imports ``runtime.transport.wake_pipe`` only. One daemon thread polls, for every end
registered with ``add`` (a ``runtime.link.link.Link``; later the supervisor's sockets), what that
end asks for this turn, beside its own wake pipe, and runs the ends' timers:

    loop until stop():
      for each end: tick(now) -> when it next needs a tick (heartbeats, failure callbacks);
                    poll_items() -> [(socket or fd, on_readable)] for this turn (a link adds its
                    socket only when replies are due and no caller reads it)
      zmq_poll(all of them + the wake pipe, until the earliest tick)
      on_readable() for each that fired; then each end's after_poll() (a link gives the socket back)
    on exit (stop, or a bug: each end's broken(exc) first): each end's shut()

An end provides ``tick(now) -> float``, ``poll_items()``, ``after_poll()``, ``broken(exc)`` and
``shut()``. Invariants: only this thread calls them; ``wake()`` (any thread) makes it look again
at once; ``after_poll`` runs even when a handler raised, so no end keeps what it took for the poll.
``call(fn)`` runs ``fn`` on this thread between two turns (the supervisor forks its ranks here, so
that they die with this thread: ``supervisor.processes``); once the thread ended it raises.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from runtime.transport.wake_pipe import WakePipe

__all__ = ["LinkThread"]

log = logging.getLogger("phyrt.link")

_POLLIN = int(zmq.POLLIN)
#: the longest sleep without a look at the ends' ticks
_MAX_WAIT_S = 1.0


class LinkThread:
    """The thread that polls the registered ends' descriptors and runs their ticks (see the module)."""

    def __init__(self, name: str) -> None:
        self._pipe = WakePipe()
        self._ends: list[Any] = []
        self._stopping = False
        self._calls: collections.deque = collections.deque()  # (fn, Future) to run between turns
        self._calls_lock = threading.Lock()
        self._ended = False  # under _calls_lock: no call runs any more
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def add(self, end: Any) -> None:
        """Poll for ``end`` from the next turn on."""
        self._ends = [*self._ends, end]
        self._pipe.wake()

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """Look again now (a no-op once disposed)."""
        self._pipe.wake()

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on this thread (it must be started); its result, or its exception raised here.
        RuntimeError once the thread ended (or ends before running it)."""
        if threading.current_thread() is self.thread:
            return fn()
        future: Future = Future()
        with self._calls_lock:
            if self._ended:
                raise RuntimeError(f"the link thread {self.thread.name} has ended")
            self._calls.append((fn, future))
        self._pipe.wake()
        return future.result()

    def stop(self, timeout: float = 10.0) -> bool:
        """End the loop (each end is shut on the way out) and wait for it; whether it has ended."""
        self._stopping = True
        self._pipe.wake()
        if self.thread is not threading.current_thread() and self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def dispose(self) -> None:
        """Close the wake pipe, once the thread has ended."""
        self._pipe.close()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                self._turn()
        except BaseException as exc:  # a bug here must not leave the ends' callers waiting forever
            log.exception("the link thread %s failed", self.thread.name)
            for end in self._ends:
                end.broken(exc)
        finally:
            with self._calls_lock:
                self._ended = True
            self._run_calls(RuntimeError(f"the link thread {self.thread.name} has ended"))
            for end in self._ends:
                end.shut()

    def _run_calls(self, ended: BaseException | None = None) -> None:
        """Run the calls queued (or, once ended, fail them with ``ended``)."""
        calls = self._calls
        while calls:
            fn, future = calls.popleft()
            if ended is not None:
                future.set_exception(ended)
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's to raise
                future.set_exception(exc)
            del fn, future  # hold nothing between calls

    def _turn(self) -> None:
        pipe = self._pipe
        now = time.monotonic()
        until = now + _MAX_WAIT_S
        items: list[tuple[Any, int]] = [(pipe.fd, _POLLIN)]
        handlers: dict[Any, Any] = {pipe.fd: pipe.drain}
        ends = self._ends
        try:
            for end in ends:
                until = min(until, end.tick(now))
                for what, on_readable in end.poll_items():
                    items.append((what, _POLLIN))
                    handlers[what] = on_readable
            if self._stopping:
                return
            wait_ms = max(0, int((until - time.monotonic()) * 1000) + 1)
            for what, _ in zmq.zmq_poll(items, wait_ms):
                handlers[what]()
        finally:
            for end in ends:
                end.after_poll()
