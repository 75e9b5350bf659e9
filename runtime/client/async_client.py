"""``AsyncClient``: ``Client`` for asyncio, a thin adapter over its ``concurrent.futures`` futures;
``AsyncClientStream``, the iterator of ``AsyncClient.stream``.

Torch-free, like ``Client``.

    event loop: await submit(p) / call(p) / ping() / info()
        -> Client.submit / Client._control_async (sent from the loop's thread, never blocking)
        <- asyncio.wrap_future: the Client's reader (a caller or its I/O thread) completes the
           concurrent future, which sets the asyncio one through the loop (call_soon_threadsafe)
    cancel(future), close(): the blocking Client verbs in a worker thread (asyncio.to_thread)

Invariants: the event loop never waits on the network; an asyncio future from ``submit``
maps back to its Client future (weakly) for ``cancel``; cancelling an awaited ``submit``
cancels the Client future, which asks the server to drop the request if still queued.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable

from runtime.client.client import Client, StreamState, _Base
from runtime.client.routing import RoutingClient
from runtime.client.server_errors import DeadlineExceededError
from runtime.core.chunk_stream import EXPIRED
from runtime.core.priority import check_priority

__all__ = ["AsyncClient", "AsyncClientStream"]


class AsyncClient:
    """``Client`` for asyncio: the same verbs, awaitable. Takes ``Client``'s keyword arguments.

    Cancelling an awaited ``submit`` also asks the server to drop the request if it
    is still queued. ``AsyncClient([address, ...])`` routes over several servers, as
    ``Client([address, ...])`` does (``runtime.client.routing``).
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._client = Client(address, **kwargs)
        self.address = address
        self._sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def submit(self, payload: Any, *, timeout: float | None = None, priority: int = 0) -> asyncio.Future:
        """Send one request from the running loop; await the returned future for the result.
        ``priority``: as ``Client.submit``'s (TypeError or ValueError here, before sending)."""
        source = self._client.submit(payload, timeout=timeout, priority=priority)
        future = asyncio.wrap_future(source)
        self._sources[future] = source
        return future

    async def call(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> Any:
        future = self._client.submit(payload, timeout=timeout, priority=priority)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except DeadlineExceededError:
            raise
        except asyncio.TimeoutError:
            raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                    future.request_id) from None  # type: ignore[attr-defined]

    def stream(self, payload: Any, timeout: float | None = None, *, priority: int = 0) -> AsyncClientStream:
        """Send one request as a stream from the running loop: ``async for chunk in
        client.stream(p)``; leaving early (``aclose()``) cancels it on the server."""
        client = self._client
        if isinstance(client, RoutingClient):  # several servers: the whole stream to the chosen one
            loop = asyncio.get_running_loop()
            return client._start_stream(payload, timeout, lambda address: AsyncClientStream(address, timeout, loop),
                                        priority)
        check_priority(priority)  # before the stream's timer starts
        stream = AsyncClientStream(self.address, timeout, asyncio.get_running_loop())
        future = client._submit(payload, timeout, stream.state, priority)
        return stream.start(future, client._canceller(future.request_id))  # type: ignore[attr-defined]

    async def cancel(self, future: asyncio.Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a request from ``submit``; True if it was still queued."""
        source = self._sources.get(future)
        if source is None:
            raise ValueError("cancel() takes a future returned by this AsyncClient's submit()")
        return await asyncio.to_thread(self._client.cancel, source, timeout)

    async def ping(self, timeout: float = 5.0) -> float:
        started = time.monotonic()
        await asyncio.wait_for(asyncio.wrap_future(self._client._control_async("ping")), timeout)
        return time.monotonic() - started

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.wrap_future(self._client._control_async("info")), timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


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
