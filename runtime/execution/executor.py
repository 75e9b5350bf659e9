"""ReplicaExecutor: the one interface the dispatcher routes to.

An executor is always one complete model replica, however many ranks it spans.
It owns its in-flight count (raised on submit, lowered when the future is done)
and its health, which only ever goes from healthy to failed: an executor is never
revived. A local replica may be rebuilt (``runtime.execution.restarts``): a new
executor with the same index then takes the failed one's place in the dispatcher.
The dispatcher takes a replica's in-flight count with ``reserve()`` under its lock (so that
concurrent choices see the load), then, outside it, one of two ways in:
``submit_reserved(request) -> Future`` (``Engine.submit``; the future is a plain
``concurrent.futures.Future``, completed by whichever thread reads the answer, and its
``result()`` only waits), or, for ``Engine.step``, ``start_call(request)`` and
``finish_call(waitable, timeout)`` on the calling thread: a local replica lets that thread
read its own answer. ``submit_reserved`` and ``start_call`` raise ``EngineUnavailableError``
only when nothing was sent (the dispatcher then tries another replica); either gives the count
back itself: when it raises, else once the request is done.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from runtime.core.errors import EngineUnavailableError


@dataclass(frozen=True)
class ReplicaStatus:
    """A snapshot of one replica, as ``Engine.replicas`` reports it."""

    index: int
    mode: str
    healthy: bool
    inflight: int
    devices: tuple[int, ...]
    error: str | None = None
    #: rebuilds of this replica begun so far (``DeploymentConfig.replica_restarts``)
    restarts: int = 0
    #: a rebuild is waiting its backoff or starting; ``healthy`` is False meanwhile
    restarting: bool = False
    #: the plugin runner's ``info()`` on the replica's output rank, as of its last refresh (at most
    #: ``runtime.execution.engine_core.INFO_REFRESH_S`` old while it works; a local replica's comes
    #: with rank 0's heartbeats, up to ``heartbeat_interval_s`` later); None if the runner has none
    plugin_info: dict | None = None
    #: the replica's queue: waits by priority and batch sizes (``runtime.core.queue_stats``
    #: ``QueueStats.snapshot``); None where requests do not queue in this process (external)
    queue: dict | None = None


class ReplicaExecutor(abc.ABC):
    mode: str = ""

    def __init__(self, index: int, devices: tuple[int, ...] = ()) -> None:
        self.index = index
        self.devices = tuple(devices)
        self._state_lock = threading.Lock()
        self._inflight = 0
        self._error: str | None = None

    # -- what subclasses implement -------------------------------------------------

    #: whether ``_submit`` takes a ``stream`` (a ``StreamCall``) and sends it partial chunks;
    #: otherwise a streamed request is submitted as any other and its one chunk is the result
    streams: bool = False

    @abc.abstractmethod
    def _submit(self, request: Any, future: Future, stream: Any = None, priority: int = 0) -> None:
        """Start ``request``; complete ``future`` later (from any thread). ``stream`` (executors
        with ``streams``): a ``StreamCall`` for its partial chunks, whose cancel hook it binds.
        ``priority``: larger is sooner among this replica's queued requests (FIFO within a level)."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """``Engine.empty`` on this replica: an ordinary tensor (this replica reads the caller's
        memory as it is); a local replica lends a block of its shared memory instead."""
        import torch

        return torch.empty(shape, dtype=dtype)

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Stop serving and release everything; idempotent."""

    # -- shared --------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def error(self) -> str | None:
        """Why this replica stopped serving, or None while it is healthy."""
        return self._error

    @property
    def inflight(self) -> int:
        return self._inflight

    def status(self) -> ReplicaStatus:
        error = self.error
        return ReplicaStatus(self.index, self.mode, error is None, self._inflight, self.devices, error,
                             plugin_info=self.plugin_info(), queue=self.queue_stats())

    def plugin_info(self) -> dict | None:
        """The plugin runner's info snapshot (``ReplicaStatus.plugin_info``); None by default."""
        return None

    def queue_stats(self) -> dict | None:
        """The replica's queue counters (``ReplicaStatus.queue``); None by default."""
        return None

    def mark_failed(self, reason: str) -> bool:
        """Take the replica out of service for good; True the first time only."""
        with self._state_lock:
            if self._error is not None:
                return False
            self._error = reason
            return True

    def submit(self, request: Any, stream: Any = None, priority: int = 0) -> Future:
        """Hand ``request`` to this replica; its future completes later (from any thread).
        ``stream``: a ``StreamCall`` for a request submitted as a stream."""
        self.reserve()
        return self.submit_reserved(request, stream, priority)

    def submit_reserved(self, request: Any, stream: Any = None, priority: int = 0) -> Future:
        """``submit`` after ``reserve()`` (the dispatcher's choice): the count goes back when the
        future is done, or here when this raises (``EngineUnavailableError``: nothing was sent)."""
        error = self.error
        if error is not None:
            self.release()
            raise EngineUnavailableError(f"replica {self.index} is not serving: {error}")
        future = Future()
        future.add_done_callback(self._done)
        try:
            self._submit(request, future, stream if self.streams else None, priority)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)  # its done callback gives the count back
            raise
        return future

    def _done(self, _future: Future) -> None:
        self.release()

    # -- a call whose caller waits here (Engine.step) ---------------------------------

    def reserve(self) -> None:
        """One more request in flight (the dispatcher's choice, under its lock)."""
        with self._state_lock:
            self._inflight += 1

    def release(self) -> None:
        with self._state_lock:
            self._inflight -= 1

    def start_call(self, request: Any, priority: int = 0) -> Any:
        """After ``reserve()``: send ``request``; a waitable for ``finish_call``. As ``submit_reserved``:
        ``EngineUnavailableError`` only when nothing was sent, and the count goes back here when
        this raises, else when the request is done."""
        return self.submit_reserved(request, None, priority)

    def finish_call(self, waitable: Any, timeout: float | None) -> Any:
        """The result of ``start_call``'s request (its error raised), waited for here.
        ``TimeoutError`` after ``timeout`` seconds: a request still queued is cancelled, one
        running goes on and its result is dropped."""
        return wait_for_result(waitable, timeout)


def wait_for_result(future: Future, timeout: float | None) -> Any:
    """``future.result(timeout)``, with ``Engine.step``'s ``TimeoutError`` (which says what became of it)."""
    try:
        return future.result(timeout)
    except TimeoutError:
        if future.done() and not future.cancelled():
            return future.result()
        state = "cancelled while queued" if future.cancel() else "still running; its result is dropped"
        raise TimeoutError(f"no result within {timeout} s (the request was {state})") from None
