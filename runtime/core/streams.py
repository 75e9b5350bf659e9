"""The iterating end of a streamed request, shared by ``Engine.stream`` and the client's streams.

Torch-free, imports nothing of the project. A stream's chunks arrive through a queue its
owner fills (``put``); the request's future holds the last chunk (or the error), and its
done callback puts the end marker after the chunks. ``timeout`` bounds the whole stream.
Leaving early (``_leave``: ``close()``, a ``with`` block, or the iterator being collected)
runs the owner's cancel once.
"""

from __future__ import annotations

import queue
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

#: put after the last chunk by the future's done callback
END = object()


class ChunkStream:
    """Subclasses say what an expired stream raises (``_expired``) and may change what its
    end returns (``_last``)."""

    def __init__(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._future: Future | None = None
        self._finished = False
        self._finalizer: weakref.finalize | None = None

    def _start(self, future: Future, cancel: Callable[[], None], put: Callable[[Any], None]) -> None:
        """Bind the request's future; ``cancel`` runs if the stream is left (or collected) unfinished."""
        self._future = future
        self._finalizer = weakref.finalize(self, cancel)
        future.add_done_callback(lambda _f: put(END))

    def _left(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _next_from(self, chunks: queue.SimpleQueue) -> Any:
        """``__next__`` of a stream whose chunks come through ``chunks``."""
        if self._finished:
            raise StopIteration
        try:
            item = chunks.get(timeout=self._left())
        except queue.Empty:
            raise self._expired() from None
        return self._item(item)

    def _item(self, item: Any) -> Any:
        """A chunk, or at the end the last chunk (or the request's error)."""
        if item is not END:
            return item
        self._finished = True
        self._finalizer.detach()
        return self._last()

    def _last(self) -> Any:
        return self._future.result()

    def _expired(self) -> BaseException:
        """Leave the stream and return the error its deadline raises."""
        raise NotImplementedError

    def _leave(self) -> None:
        self._finished = True
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer()  # the owner's cancel, once
