"""RequestDispatcher: sends each whole request to one healthy replica.

Choice: the healthy replica with the fewest requests in flight; ties rotate
round-robin, starting after the replica chosen last. A replica that has failed
is out of the rotation until ``replace`` puts a rebuilt executor in its place
(``runtime.execution.restarts``; without restarts, for good). With no healthy
replica left, ``submit`` raises ``EngineUnavailableError`` at once, naming each
replica's cause.

The choice and the executor's in-flight increment happen under one lock, so
concurrent submits see each other's load; the lock covers nothing else: the request is
encoded, sent (and, for ``call``, ``Engine.step``, waited for) outside it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Sequence

from runtime.core.errors import EngineUnavailableError
from runtime.execution.executor import ReplicaExecutor, ReplicaStatus


class RequestDispatcher:
    def __init__(self, executors: Sequence[ReplicaExecutor]) -> None:
        if not executors:
            raise ValueError("RequestDispatcher needs at least one replica executor")
        self._executors = list(executors)
        self._lock = threading.Lock()
        self._cursor = 0
        self._closed = False

    @property
    def executors(self) -> list[ReplicaExecutor]:
        return list(self._executors)

    def statuses(self) -> list[ReplicaStatus]:
        return [executor.status() for executor in self._executors]

    def submit(self, request: Any, stream: Any = None, priority: int = 0) -> Future:
        """Hand ``request`` to a replica; ``EngineUnavailableError`` when none is healthy.
        ``stream``: its ``StreamCall`` when it was submitted as a stream. The lock covers the
        choice (and the chosen replica's in-flight count), not the encoding or the send."""
        tried: set[int] = set()
        while True:
            executor = self._reserve(tried)
            try:
                return executor.submit_reserved(request, stream, priority)
            except EngineUnavailableError:  # it failed between the choice and the send (its count is back)
                tried.add(executor.index)

    def _reserve(self, tried: set[int]) -> ReplicaExecutor:
        """Under the lock: the replica to send to next, its in-flight count raised; else
        ``EngineUnavailableError``, naming each replica's cause."""
        with self._lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            if len(self._executors) == 1:  # the common inline case, without the choice's bookkeeping
                executor = self._executors[0]
                executor = executor if executor.healthy and not tried else None
            else:
                executor = self._choose(tried)
            if executor is None:
                raise EngineUnavailableError(self._none_healthy())
            executor.reserve()
            return executor

    def call(self, request: Any, timeout: float | None, priority: int = 0) -> Any:
        """``Engine.step``: run ``request`` on a replica and wait for its result in this thread.
        The lock covers the choice (and the chosen replica's in-flight count), not the encoding,
        the send or the wait; a replica that turns out not to serve before anything was sent
        makes way for the next one."""
        tried: set[int] = set()
        while True:
            executor = self._reserve(tried)
            try:
                waitable = executor.start_call(request, priority)
            except EngineUnavailableError:  # it failed between the choice and the send (its count is back)
                tried.add(executor.index)
                continue
            return executor.finish_call(waitable, timeout)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """``Engine.empty``: a tensor from the replica the next request would go to (the one with
        the fewest in flight; a request that lands on another replica copies it)."""
        with self._lock:
            if self._closed:
                raise EngineUnavailableError("the engine is closed")
            turn = self._cursor
            executor = self._choose(set())
            self._cursor = turn  # a tensor is not a request: the next request keeps its turn
            if executor is None:
                raise EngineUnavailableError(self._none_healthy())
        return executor.empty(shape, dtype)

    def replace(self, index: int, executor: ReplicaExecutor) -> ReplicaExecutor | None:
        """Put ``executor`` in the place of replica ``index``; returns the executor it
        replaced, or None when the dispatcher is closed (the caller then closes ``executor``)."""
        if executor.index != index:
            raise ValueError(f"replica {index} cannot be replaced by the executor of replica {executor.index}")
        with self._lock:
            if self._closed:
                return None
            for position, current in enumerate(self._executors):
                if current.index == index:
                    self._executors[position] = executor
                    return current
        raise ValueError(f"no replica {index} to replace")

    def _choose(self, tried: set[int]) -> ReplicaExecutor | None:
        count = len(self._executors)
        best = None
        for step in range(count):
            executor = self._executors[(self._cursor + step) % count]
            if executor.index in tried or not executor.healthy:
                continue
            if best is None or executor.inflight < best.inflight:
                best = executor
        if best is not None:
            self._cursor = (self._executors.index(best) + 1) % count
        return best

    def _none_healthy(self) -> str:
        causes = "; ".join(f"replica {e.index}: {e.error or 'unavailable'}" for e in self._executors)
        return f"no healthy replica is left ({causes})"

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        errors = []
        for executor in self._executors:
            try:
                executor.close(timeout)
            except Exception as exc:  # close the rest regardless
                errors.append(exc)
        if errors:
            raise errors[0]
