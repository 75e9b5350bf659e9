"""MultiprocessExecutor: one local replica, i.e. one group of spawned ranks.

All replicas of an engine share one ``WorkerSupervisor`` (one I/O thread, one
ROUTER socket); each executor is a thin view of its group:

    dispatcher --submit--> MultiprocessExecutor(index) --supervisor.submit(index, request, future)--> ranks
    dispatcher --healthy/error--> supervisor.group_error(index)    (None while the group serves)

Health is the supervisor's word on the group (plus this executor's own "closed"), so
nothing has to be told when a group fails. ``close`` closes the shared supervisor
(idempotent there).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from runtime.execution.executor import ReplicaExecutor


class MultiprocessExecutor(ReplicaExecutor):
    mode = "local"

    def __init__(self, supervisor: Any, index: int, devices: tuple[int, ...]) -> None:
        super().__init__(index, devices)
        self._supervisor = supervisor

    @property
    def error(self) -> str | None:
        """Why this replica stopped serving (closed, or its group failed); None while healthy."""
        return self._error or self._supervisor.group_error(self.index)

    def _new_future(self) -> Future:
        # waiting on it reads the ranks' answers in the waiting thread when no other thread does
        return self._supervisor.new_future()

    def _submit(self, request: Any, future: Future) -> None:
        # ranks start work as soon as it is sent and cannot take it back: from here the
        # future is running, so cancel() answers False (only queued inline work cancels)
        future.set_running_or_notify_cancel()
        self._supervisor.submit(self.index, request, future)

    def close(self, timeout: float | None = None) -> None:
        self.mark_failed("the engine is closed")
        self._supervisor.close()
