"""A request submitted as a stream: ``StreamCall`` (push, any thread) and ``Stream`` (the iterator).

    Engine.submit_stream(request, on_chunk) -> StreamCall
      executor: call.put(chunk) per Partial        (the thread that steps the runner, or
      executor: call.future <- the last chunk       the supervisor's reader)
      call.cancel() -> the executor's cancel hook   (bound once the request is queued)
    Engine.stream(request, timeout) -> Stream: an iterator over a StreamCall whose chunks go
      into a queue; leaving it early (break, close(), garbage collection) cancels the call,
      and so does its deadline (``runtime.core.chunk_stream`` states the rule)

Invariants:
- A chunk put after ``cancel()`` is dropped, and ``on_chunk`` is never called after it.
- The cancel hook runs at most once, whichever comes first of ``cancel()`` and the bind.
- ``Stream`` frees nothing itself: cancelling tells the replica, which frees what the
  request holds (its KV blocks, say) and still completes the future (dropped here).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from runtime.core.chunk_stream import ChunkStream

__all__ = ["StreamCall", "Stream"]


class StreamCall:
    """One streamed request: ``on_chunk`` gets each partial chunk (in order, from one thread at
    a time), ``future`` the last chunk (or the error), ``cancel()`` leaves it."""

    __slots__ = ("future", "_on_chunk", "_lock", "_cancel", "_cancelled", "__weakref__")

    def __init__(self, on_chunk: Callable[[Any], None]) -> None:
        self.future: Future | None = None
        self._on_chunk = on_chunk
        self._lock = threading.Lock()
        self._cancel: Callable[[], None] | None = None
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def put(self, chunk: Any) -> None:
        """A partial chunk (the executor's thread); dropped once cancelled."""
        if not self._cancelled:
            self._on_chunk(chunk)

    def bind_cancel(self, cancel: Callable[[], None]) -> None:
        """The executor's way to drop the request; run at once if ``cancel()`` came first."""
        with self._lock:
            if not self._cancelled:
                self._cancel = cancel
                return
        cancel()

    def cancel(self) -> None:
        """Leave the stream: later chunks are dropped and the replica is told (idempotent)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()


class Stream(ChunkStream):
    """Iterates the chunks of one streamed request (``Engine.stream``).

    ``timeout`` bounds the whole stream, from ``Engine.stream`` to its end: the chunks (and the
    end) that arrived before the deadline are handed out even when read after it; ``next()``
    raises ``TimeoutError`` where it would wait past the deadline (or reach what came after
    it), and the request is cancelled (at the latest then; already when a chunk arrives
    late, even while nobody reads). A failure of the replica raises its error
    (``EngineUnavailableError``); a plugin's error for the request, the plugin's own.
    ``close()`` (also on ``break`` out of a ``with`` block, or when the iterator is
    collected) cancels a request still running.
    """

    def __init__(self, timeout: float | None = None) -> None:
        super().__init__(timeout)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.call = StreamCall(self._arrivals(self._queue.put))

    def start(self, future: Future) -> "Stream":
        """Bind the request's future (its last chunk); the caller owns the stream from here."""
        self.call.future = future
        self._start(future, self.call.cancel)
        return self

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        return self._next_from(self._queue)

    def _last(self) -> Any:
        if self._future.cancelled():
            raise StopIteration
        return self._future.result()  # the last chunk, or the request's error

    def _expired(self) -> BaseException:
        self._leave()
        return TimeoutError(f"the stream did not end within {self._timeout} s (it was cancelled)")

    def close(self) -> None:
        """Leave the stream; a request still running is cancelled. Idempotent."""
        self._leave()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
