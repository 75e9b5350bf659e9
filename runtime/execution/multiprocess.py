"""MultiprocessExecutor: one local replica, i.e. one group of spawned ranks.

The replicas an engine starts share one ``WorkerSupervisor`` (one I/O thread, one
ROUTER socket); a replica rebuilt after a failure (``runtime.execution.restarts``)
has a supervisor of its own, where it is group 0. Each executor is a thin view of
its group:

    dispatcher --submit--> MultiprocessExecutor(index) --replica.submit(request, future)--> ranks
    dispatcher --healthy/error, info, queue, empty--> the group's Replica (supervisor.replica(group))
    start_call/finish_call (Engine.step) --> the supervisor: the caller reads its answer when nobody reads

Health is the replica's own word (``failed``, plus this executor's own "closed"), so
nothing has to be told when a group fails; ``on_failure`` tells a listener (the restart
controller) on the group's reaper thread, once its ranks are gone. ``close`` closes the supervisor
(idempotent there; a shared one stops every replica it holds).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from runtime.core.errors import EngineUnavailableError
from runtime.execution.executor import ReplicaExecutor


class MultiprocessExecutor(ReplicaExecutor):
    mode = "local"
    streams = True

    def __init__(self, supervisor: Any, index: int, devices: tuple[int, ...], group: int | None = None) -> None:
        """``index``: the replica's index in the engine; ``group``: its group in ``supervisor``
        (``index`` when None, as in the supervisor the engine starts with)."""
        super().__init__(index, devices)
        self._supervisor = supervisor
        self._group = index if group is None else group
        self._replica = supervisor.replica(self._group)  # its state: failed, info, queue, arena

    @property
    def supervisor(self) -> Any:
        """The ``WorkerSupervisor`` that holds this replica's ranks."""
        return self._supervisor

    @property
    def error(self) -> str | None:
        """Why this replica stopped serving (closed, or its group failed); None while healthy."""
        return self._error or self._replica.failed

    def plugin_info(self) -> dict | None:
        """Rank 0's runner info, as its last heartbeat carried it."""
        return self._replica.info

    def queue_stats(self) -> dict | None:
        return self._replica.queue_stats()

    def on_failure(self, callback: Any) -> bool:
        """``callback()`` once this replica's group fails, on the supervisor's reaper thread once its
        ranks are gone (never at close); False, and never called, when it was too late (the
        failure was told already)."""
        return self._supervisor.on_group_failure(self._group, callback)

    def start_call(self, request: Any, priority: int = 0) -> Any:
        """``Engine.step``: the calling thread reads its own answer when nobody else reads."""
        try:
            error = self.error
            if error is not None:
                raise EngineUnavailableError(f"replica {self.index} is not serving: {error}")
            return self._supervisor.start_call(self._group, request, self.release, priority)  # counted until answered
        except BaseException:  # nothing went out: the count goes back now
            self.release()
            raise

    def finish_call(self, waitable: Any, timeout: float | None) -> Any:
        """The answer, read here (a request whose wait timed out runs on, counted, its result dropped)."""
        return self._supervisor.finish_call(waitable, timeout)

    def _submit(self, request: Any, future: Future, stream: Any = None, priority: int = 0) -> None:
        # ranks start work as soon as it is sent and cannot take it back: from here the
        # future is running, so cancel() answers False (only queued inline work cancels;
        # a stream's cancel reaches the ranks' runners instead)
        future.set_running_or_notify_cancel()
        self._replica.submit(request, future, stream, priority)  # its answer: see WorkerSupervisor._queued

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._replica.lend(shape, dtype)  # sent without a copy

    def close(self, timeout: float | None = None) -> None:
        self.mark_failed("the engine is closed")
        self._supervisor.close()
