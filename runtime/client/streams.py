"""Streams on the client: ``Client.stream`` and ``AsyncClient.stream`` iterate a request's chunks.

Torch-free. The wire is ``runtime.link.client_protocol``'s "stream" op:

    Client.stream(p): _submit(p, stream=StreamState) -- stream {payload, timeout_s} -->  server
    reader (a caller or the I/O thread): each chunk   <-- {result, seq} --------------
      -> StreamState.deliver(chunk): the stream's queue (asyncio: through the loop)
    the final reply (last chunk, or an error)         <-- {result, seq, final} --------
      -> the request's future; its done callback ends the queue
    close(), break + collection, a deadline           -- cancel {target} ------------->

Invariants:
- Chunks come in ``seq`` order (``runtime.client.replies`` checks it); a gap fails the stream.
- Leaving a stream early cancels it on the server (its runner frees what it holds); the
  request stays in flight here until the server's final reply, which is dropped.
- ``timeout`` follows ``runtime.core.chunk_stream``' rule, on this client's clock from the
  submit: what the reader handed over before the deadline is handed out, however late the
  caller reads; then ``DeadlineExceededError``, and the request is cancelled on the server.
  The server holds the same ``timeout_s`` from when its engine takes the request (a little
  later), so its own ``DeadlineExceeded`` comes after this client's deadline.
- What a stream holds waiting is what the server sent and the caller did not take yet: at
  most the request's own chunks (the server keeps none; see the protocol's flow control).
"""

from __future__ import annotations

import asyncio
import queue
from concurrent.futures import Future
from typing import Any, Callable

from runtime.client.errors import DeadlineExceededError
from runtime.core.chunk_stream import EXPIRED, ChunkStream

__all__ = ["StreamState", "ClientStream", "AsyncClientStream"]


class StreamState:
    """What the reader hands a stream's chunks to: ``deliver(chunk)``, and the next ``seq`` due."""

    __slots__ = ("deliver", "seq")

    def __init__(self, deliver: Callable[[Any], None]) -> None:
        self.deliver = deliver
        self.seq = 0


class _Base(ChunkStream):
    """What the sync and async iterators share: ``runtime.core.chunk_stream.ChunkStream``, and the
    server's address for the deadline's error."""

    def __init__(self, address: str, timeout: float | None) -> None:
        super().__init__(timeout)
        self._address = address

    def _expired(self) -> DeadlineExceededError:
        self._leave()
        return DeadlineExceededError.for_request(f"the stream did not end within {self._timeout} s from "
                                                 f"{self._address} (it was cancelled)",
                                                 getattr(self._future, "request_id", None))


class ClientStream(_Base):
    """The chunks of one request as they come (``Client.stream``): iterate, or ``close()``.

    ``timeout`` bounds the whole stream, from ``stream()`` to its end: the chunks (and the end)
    received before the deadline are handed out even when read after it; ``next()`` raises
    ``DeadlineExceededError`` where it would wait past the deadline (or reach a chunk that came
    after it), and the request is cancelled on the server. A server error ends it with its
    ``ServerError`` subclass; a lost connection or the client's ``close()`` with
    ``ConnectionLostError``. Leaving early (``close()``, leaving a ``with`` block, or dropping
    the iterator) cancels the request on the server.
    """

    def __init__(self, address: str, timeout: float | None) -> None:
        super().__init__(address, timeout)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.state = StreamState(self._arrivals(self._queue.put))

    def start(self, future: Future, cancel: Callable[[], None]) -> "ClientStream":
        self._start(future, cancel)
        return self

    def __iter__(self) -> "ClientStream":
        return self

    def __next__(self) -> Any:
        return self._next_from(self._queue)

    def close(self) -> None:
        """Leave the stream (cancelled on the server if still running). Idempotent."""
        self._leave()

    def __enter__(self) -> "ClientStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClientStream(_Base):
    """``ClientStream`` for asyncio (``AsyncClient.stream``): ``async for``, ``aclose()``; the same
    ``timeout``. Its deadline is a timer of the loop that puts ``EXPIRED`` into the queue, so
    chunks the reader handed over before it (through the loop) come out first."""

    def __init__(self, address: str, timeout: float | None, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(address, timeout)
        self._queue: asyncio.Queue = asyncio.Queue()
        items = self._queue

        def put(item: Any) -> None:  # the client's reader thread; holds no reference to the stream
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody iterates any more
                pass

        self.state = StreamState(self._arrivals(put))
        self._timer = None if timeout is None else loop.call_later(self._left(), items.put_nowait, EXPIRED)

    def start(self, future: Future, cancel: Callable[[], None]) -> "AsyncClientStream":
        self._start(future, cancel)
        return self

    def __aiter__(self) -> "AsyncClientStream":
        return self

    async def __anext__(self) -> Any:
        if self._finished:
            raise StopAsyncIteration
        return self._item(await self._queue.get())

    def _ended(self) -> None:
        if self._timer is not None:  # (the loop's thread: the end read, aclose() or the deadline)
            self._timer.cancel()

    async def aclose(self) -> None:
        """Leave the stream (cancelled on the server if still running). Idempotent."""
        self._leave()

    async def __aenter__(self) -> "AsyncClientStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._leave()
