"""MultiprocessExecutor: one local replica, i.e. one group of spawned ranks.

The replicas an engine starts share one ``WorkerSupervisor`` (one I/O thread, one
ROUTER socket); a replica rebuilt after a failure (``runtime.execution.restarts``)
has a supervisor of its own, where it is group 0. Each executor is a thin view of
its group:

    dispatcher --submit--> MultiprocessExecutor(index) --supervisor.submit(group, request, future)--> ranks
    dispatcher --healthy/error--> supervisor.group_error(group)    (None while the group serves)

Health is the supervisor's word on the group (plus this executor's own "closed"), so
nothing has to be told when a group fails. ``close`` closes the supervisor
(idempotent there; a shared one stops every replica it holds).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

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

    @property
    def supervisor(self) -> Any:
        """The ``WorkerSupervisor`` that holds this replica's ranks."""
        return self._supervisor

    @property
    def error(self) -> str | None:
        """Why this replica stopped serving (closed, or its group failed); None while healthy."""
        return self._error or self._supervisor.group_error(self._group)

    def _new_future(self) -> Future:
        # waiting on it reads the ranks' answers in the waiting thread when no other thread does
        return self._supervisor.new_future()

    def _submit(self, request: Any, future: Future, stream: Any = None) -> None:
        # ranks start work as soon as it is sent and cannot take it back: from here the
        # future is running, so cancel() answers False (only queued inline work cancels;
        # a stream's cancel reaches the ranks' runners instead)
        future.set_running_or_notify_cancel()
        self._supervisor.submit(self._group, request, future, stream)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._supervisor.empty(self._group, shape, dtype)

    def close(self, timeout: float | None = None) -> None:
        self.mark_failed("the engine is closed")
        self._supervisor.close()
