"""MultiprocessExecutor: one local replica, i.e. one group of spawned ranks.

All replicas of an engine share one ``WorkerSupervisor`` (one I/O thread, one
ROUTER socket); each executor is a thin view of its group: submit hands the
request to the supervisor, health flips to failed when the supervisor fails the
group, and close closes the shared supervisor (idempotent).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from runtime.execution.executor import ReplicaExecutor


class MultiprocessExecutor(ReplicaExecutor):
    mode = "local"

    def __init__(self, index: int, devices: tuple[int, ...]) -> None:
        super().__init__(index, devices)
        self._supervisor: Any = None

    def attach(self, supervisor: Any) -> None:
        self._supervisor = supervisor

    def _new_future(self) -> Future:
        # waiting on it reads the ranks' answers in the waiting thread when no other thread does
        return self._supervisor.new_future()

    def _submit(self, request: Any, future: Future, lead: bool = False) -> None:
        # ranks start work as soon as it is sent and cannot take it back: from here the
        # future is running, so cancel() answers False (only queued inline work cancels)
        future.set_running_or_notify_cancel()
        self._supervisor.submit(self.index, request, future, lead)

    def close(self, timeout: float | None = None) -> None:
        self.mark_failed("the engine is closed")
        if self._supervisor is not None:
            self._supervisor.close()
