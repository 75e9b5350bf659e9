"""ReplicaExecutor: the one interface the dispatcher routes to.

An executor is always one complete model replica, however many ranks it spans.
It owns its in-flight count (raised on submit, lowered when the future is done)
and its health, which only ever goes from healthy to failed: an executor is never
revived. A local replica may be rebuilt (``runtime.execution.restarts``): a new
executor with the same index then takes the failed one's place in the dispatcher.
``submit(request) -> Future`` is the whole interface the dispatcher uses; how a
caller will wait for the future is no business of it (a thread about to wait says
so with ``runtime.transport.reader.expect_wait``, which a channel may read).
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
    def _submit(self, request: Any, future: Future, stream: Any = None) -> None:
        """Start ``request``; complete ``future`` later (from any thread). ``stream`` (executors
        with ``streams``): a ``StreamCall`` for its partial chunks, whose cancel hook it binds."""

    def _new_future(self) -> Future:
        return Future()

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
        return ReplicaStatus(self.index, self.mode, error is None, self._inflight, self.devices, error)

    def mark_failed(self, reason: str) -> bool:
        """Take the replica out of service for good; True the first time only."""
        with self._state_lock:
            if self._error is not None:
                return False
            self._error = reason
            return True

    def submit(self, request: Any, stream: Any = None) -> Future:
        """Hand ``request`` to this replica; its future completes later (from any thread).
        ``stream``: a ``StreamCall`` for a request submitted as a stream."""
        error = self.error
        if error is not None:
            raise EngineUnavailableError(f"replica {self.index} is not serving: {error}")
        future = self._new_future()
        with self._state_lock:
            self._inflight += 1
        future.add_done_callback(self._done)
        try:
            if stream is not None and self.streams:
                self._submit(request, future, stream)
            else:
                self._submit(request, future)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            raise
        return future

    def _done(self, _future: Future) -> None:
        with self._state_lock:
            self._inflight -= 1
