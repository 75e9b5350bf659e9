"""The iterating end of a streamed request, shared by ``Engine.stream`` and the client's streams.

Torch-free, imports nothing of the project. A stream's chunks arrive through a queue its
owner fills (through ``Arrivals``); the request's future holds the last chunk (or the error),
and its done callback puts the end marker after the chunks. Leaving early (``_leave``:
``close()``, a ``with`` block, or the iterator being collected) runs the owner's cancel once.

``timeout`` bounds the whole stream, from its submission to its end (the deadline):
- what arrived before the deadline is handed out, however late the caller reads it: the
  chunks, then the end (the last chunk) of a stream that ended in time;
- ``next()`` raises the deadline's error (``_expired``) only where it would otherwise wait
  past the deadline, or reach a chunk or end that arrived after it (those are dropped);
- the request is cancelled then, or already when a chunk arrives after the deadline (the
  runner frees what the request holds even while nobody reads the stream).
This is the server's rule for a stream's ``timeout_s`` as well: the chunks it made before its
deadline are sent, and at the deadline a stream that has not ended is cancelled.
"""

from __future__ import annotations

import queue
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

#: put after the last chunk by the future's done callback
END = object()
#: put (once) in place of the first chunk or end that arrives after the deadline; read, it raises
EXPIRED = object()


class Arrivals:
    """What an owner puts into a stream's queue goes through this (from one thread at a time):
    an item that arrives by the deadline goes in; the first one after it is replaced by
    ``EXPIRED`` (and, a chunk, the request is cancelled at once); later ones are dropped.
    Holds no reference to the stream: ``leave`` is the stream's finalizer (its cancel, once)."""

    __slots__ = ("_put", "_deadline", "_late", "leave")

    def __init__(self, put: Callable[[Any], None], deadline: float | None) -> None:
        self._put = put
        self._deadline = deadline
        self._late = False
        self.leave: Callable[[], Any] | None = None

    def __call__(self, item: Any) -> None:
        if self._deadline is None or time.monotonic() <= self._deadline:
            self._put(item)
        elif not self._late:
            self._late = True
            self._put(EXPIRED)
            if item is not END and self.leave is not None:
                self.leave()  # the request still runs past its deadline: cancel it now


class ChunkStream:
    """Subclasses say what an expired stream raises (``_expired``) and may change what its
    end returns (``_last``)."""

    def __init__(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._future: Future | None = None
        self._finished = False
        self._finalizer: weakref.finalize | None = None
        self._arrive: Arrivals | None = None

    def _arrivals(self, put: Callable[[Any], None]) -> Arrivals:
        """``put`` (into this stream's queue) behind the deadline: what the owner calls per chunk."""
        self._arrive = Arrivals(put, self._deadline)
        return self._arrive

    def _start(self, future: Future, cancel: Callable[[], None]) -> None:
        """Bind the request's future; ``cancel`` runs if the stream is left (or collected) unfinished,
        or once a chunk arrives past the deadline."""
        self._future = future
        self._finalizer = weakref.finalize(self, cancel)
        arrive = self._arrive
        arrive.leave = self._finalizer
        future.add_done_callback(lambda _f: arrive(END))

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _next_from(self, chunks: queue.SimpleQueue) -> Any:
        """``__next__`` of a stream whose chunks come through ``chunks``: an item already there is
        taken even past the deadline (``get`` with a timeout of 0 still takes it)."""
        if self._finished:
            raise StopIteration
        try:
            item = chunks.get(timeout=self._left())
        except queue.Empty:
            raise self._expired() from None
        return self._item(item)

    def _item(self, item: Any) -> Any:
        """A chunk, or at the end the last chunk (or the request's error); past the deadline, its error."""
        if item is END:
            self._finished = True
            self._finalizer.detach()
            self._ended()
            return self._last()
        if item is EXPIRED:
            raise self._expired()
        return item

    def _last(self) -> Any:
        return self._future.result()

    def _expired(self) -> BaseException:
        """Leave the stream and return the error its deadline raises."""
        raise NotImplementedError

    def _ended(self) -> None:
        """The stream is over (its end read, or left): what a subclass lets go of then."""

    def _leave(self) -> None:
        self._finished = True
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()  # the owner's cancel, once
        self._ended()
