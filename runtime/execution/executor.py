"""ReplicaExecutor: the one interface the dispatcher routes to.

An executor is always one complete model replica, however many ranks it spans.
It owns its in-flight count (raised on submit, lowered when the future is done)
and its health, which only ever goes from healthy to failed: phyrt never restarts
a replica.
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


class ReplicaExecutor(abc.ABC):
    mode: str = ""

    def __init__(self, index: int, devices: tuple[int, ...] = ()) -> None:
        self.index = index
        self.devices = tuple(devices)
        self._state_lock = threading.Lock()
        self._inflight = 0
        self._error: str | None = None

    # -- what subclasses implement -------------------------------------------------

    @abc.abstractmethod
    def _submit(self, request: Any, future: Future, lead: bool) -> None:
        """Start ``request``; complete ``future`` later (from any thread). ``lead``: the
        caller waits on ``future`` right away (``Engine.step``), a hint an executor may use."""

    def _new_future(self) -> Future:
        return Future()

    def run_if_idle(self, request: Any, before: Any = None) -> tuple[bool, Any, BaseException | None]:
        """Run ``request`` in the calling thread if this replica can and holds nothing else:
        ``(True, result, error)``; ``(False, None, None)`` otherwise (here: never; the inline
        executor can)."""
        return False, None, None

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Stop serving and release everything; idempotent."""

    # -- shared --------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._error is None

    @property
    def error(self) -> str | None:
        """Why this replica stopped serving, or None while it is healthy."""
        return self._error

    @property
    def inflight(self) -> int:
        return self._inflight

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(self.index, self.mode, self.healthy, self._inflight, self.devices, self._error)

    def mark_failed(self, reason: str) -> bool:
        """Take the replica out of service for good; True the first time only."""
        with self._state_lock:
            if self._error is not None:
                return False
            self._error = reason
            return True

    def submit(self, request: Any, lead: bool = False) -> Future:
        if self._error is not None:
            raise EngineUnavailableError(f"replica {self.index} is not serving: {self._error}")
        future = self._new_future()
        with self._state_lock:
            self._inflight += 1
        future.add_done_callback(self._done)
        try:
            self._submit(request, future, lead)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            raise
        return future

    def _done(self, _future: Future) -> None:
        with self._state_lock:
            self._inflight -= 1
