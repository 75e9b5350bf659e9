"""RestartController: rebuilds the local replicas whose worker group failed
(``DeploymentConfig.replica_restarts``).

    every status read, and the failed group's reaper thread (the executor's ``on_failure``
    callback, once the group's ranks are stopped and released): noticed
      a replica's executor turned unhealthy (its group failed: a rank exited, a heartbeat
      or an execution timeout, a malformed message, a plugin error)
        attempts left -> restarting; WARNING with the cause
        none left     -> given up; ERROR
    the reaper thread then handles it (renamed phyrt-rebuild-N meanwhile; no thread of its own)
      close the failed supervisor when no other replica uses it (joining every reaper but this one)
      wait restart_backoff_s * 2**(k-1) (at most 60 s; close() cuts the wait short)
      start(index): a new WorkerSupervisor for this replica alone, as group 0 of it
        failed start -> the next attempt (it counted), or given up
        started      -> dispatcher.replace(index, executor): from now on it takes requests

A rebuild never retries a request: the failed group's requests failed at once, as without
restarts. While a replica is rebuilt its status says ``healthy=False, restarting=True`` and
``error`` is the last failure's cause; the dispatcher never chooses it, since the failed
executor stays in its place until the new one is up.

Invariants:
- A replica's record (``restarts``, ``restarting``, ``cause``) and the swap of
  its executor change under ``_lock``; ``statuses()`` reads the executors under it too, so
  no reader sees a replica between "restarting" and "serving".
- Each failed executor is noticed once (``_Replica.failed``) and handled once (``_Replica.handled``),
  by the first thread to reach it; a rebuilt one that fails later is a new failure of the same
  replica, counted against the same budget.
- Each executor is listened to before it serves (at the start, or before it is swapped in). One that
  failed too early for its callback (``on_failure`` says so) is handled by the listening thread:
  the engine's at the start (its constructor waits for the rebuild), the rebuilding one at a swap.
  So the ranks of a failed group are gone before its replacement starts.
- ``stop()`` (the engine's close, before the dispatcher closes) ends every
  backoff and makes later callbacks no-ops; ``join()`` (after it) waits for the threads handling a
  failure: a start under way sees the
  stop event within ``supervisor.boot.CANCEL_POLL_S`` and closes what it started; a
  supervisor whose start ends after ``stop()`` anyway is closed by its thread at once and
  never swapped in. The dispatcher closes the executors
  in place; a supervisor that no executor uses any more is closed here when its last
  replica is swapped out, or at once when it held the failed replica only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

from runtime.core.config import EngineArgs, WorkerSupervisorConfig
from runtime.execution.dispatcher import RequestDispatcher
from runtime.execution.executor import ReplicaExecutor, ReplicaStatus
from runtime.execution.multiprocess import MultiprocessExecutor

log = logging.getLogger("phyrt.engine")

#: the longest wait before a rebuild
MAX_BACKOFF_S = 60.0
#: how long close() waits for a rebuild thread beyond a supervisor's start
_JOIN_SLACK_S = 15.0

#: ``start(index, cancel)``: replica ``index`` anew, its start abandoned once ``cancel`` is set
Starter = Callable[[int, threading.Event], MultiprocessExecutor]


def backoff_s(base_s: float, attempt: int) -> float:
    """The wait before rebuild ``attempt`` (1, 2, ...) of a replica."""
    return min(MAX_BACKOFF_S, base_s * 2.0 ** (attempt - 1))


def local_starter(args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]],
                  config: WorkerSupervisorConfig, target: str) -> Starter:
    """``start(index, cancel)``: a new supervisor whose only group is replica ``index`` on its
    devices (its ranks know their replica index; a pinned ``base_port`` keeps ``base_port + index``)."""

    def start(index: int, cancel: threading.Event) -> MultiprocessExecutor:
        from supervisor import WorkerSupervisor

        supervisor = WorkerSupervisor(args, plugin_spec, [placement[index]], config, target,
                                      first_replica=index, cancel=cancel)
        return MultiprocessExecutor(supervisor, index, placement[index], group=0)

    return start


@dataclasses.dataclass
class _Replica:
    restarts: int = 0  # rebuilds begun
    restarting: bool = False
    cause: str | None = None  # the last failure's cause while the replica does not serve
    failed: ReplicaExecutor | None = None  # the last failed executor noticed
    rebuild: bool = False  # whether it is to be rebuilt (decided when noticed)
    handled: ReplicaExecutor | None = None  # the last failed executor whose handling began


class RestartController:
    """Watches the dispatcher's local replicas and rebuilds those that fail."""

    def __init__(self, dispatcher: RequestDispatcher, start: Starter, max_restarts: int, backoff_base_s: float,
                 startup_timeout_s: float) -> None:
        self._dispatcher = dispatcher
        self._start = start
        self._max_restarts = max_restarts
        self._backoff_base_s = backoff_base_s
        self._join_s = startup_timeout_s + _JOIN_SLACK_S
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replicas = {e.index: _Replica() for e in dispatcher.executors}
        self._handlers: list[threading.Thread] = []  # threads handling a failure now
        late = [e.index for e in dispatcher.executors if not self._listen(e)]
        for index in late:  # failed before its callback was in place: rebuilt here, now
            self._failed(index)

    # -- reading ---------------------------------------------------------------------

    def statuses(self) -> list[ReplicaStatus]:
        """Each replica's status, with its rebuilds begun, whether one is under way and the
        last failure's cause while it does not serve."""
        with self._lock:
            statuses = self._dispatcher.statuses()
            for status in statuses:
                if not status.healthy:
                    self._notice(status.index)
            return [self._annotate(status) for status in statuses]

    def _annotate(self, status: ReplicaStatus) -> ReplicaStatus:
        state = self._replicas[status.index]
        if status.healthy:
            return dataclasses.replace(status, restarts=state.restarts)
        return dataclasses.replace(status, restarts=state.restarts, restarting=state.restarting,
                                   error=state.cause or status.error)

    # -- noticing a failure ------------------------------------------------------------

    def _listen(self, executor: ReplicaExecutor) -> bool:
        """Hear of ``executor``'s failure once its group's ranks are gone (its reaper thread calls
        ``_failed``); False when it failed too early for that (the caller handles it)."""
        if isinstance(executor, MultiprocessExecutor):
            return executor.on_failure(lambda index=executor.index: self._failed(index))
        return True

    def _failed(self, index: int) -> None:
        """Handle replica ``index``'s failure on this thread (the failed group's reaper, or a thread
        that listened too late), and a replacement's that failed before it could be listened to."""
        me = threading.current_thread()
        name = me.name
        try:
            while True:
                with self._lock:
                    self._notice(index)
                    state = self._replicas[index]
                    failed = state.failed
                    if self._stop.is_set() or failed is None or state.handled is failed:
                        return
                    state.handled = failed
                    if me not in self._handlers:
                        self._handlers.append(me)
                me.name = f"phyrt-rebuild-{index}"
                if not self._handle(index, failed, state.rebuild):
                    return
        finally:
            me.name = name
            with self._lock:
                if me in self._handlers:
                    self._handlers.remove(me)

    def _notice(self, index: int) -> None:
        """Under ``_lock``: count replica ``index``'s failure if its executor failed and is new to us
        (a status read, or the thread that will handle it)."""
        executor = self._executor(index)
        state = self._replicas[index]
        if self._stop.is_set() or executor is None or state.failed is executor or executor.healthy:
            return
        state.failed = executor
        state.cause = executor.error
        state.rebuild = state.restarts < self._max_restarts
        if state.rebuild:
            state.restarts += 1
            state.restarting = True
        else:
            self._give_up(index, state)

    def _executor(self, index: int) -> ReplicaExecutor | None:
        for executor in self._dispatcher.executors:
            if executor.index == index:
                return executor
        return None

    def _give_up(self, index: int, state: _Replica) -> None:
        state.restarting = False
        log.error("replica %d is given up after %d rebuild(s) (replica_restarts=%d): %s",
                  index, state.restarts, self._max_restarts, state.cause)

    # -- rebuilding --------------------------------------------------------------------

    def _handle(self, index: int, failed: ReplicaExecutor, rebuild: bool) -> bool:
        """One failed executor: release its supervisor when unshared, then rebuild the replica; True
        when the replacement failed before it could be listened to (the caller handles it next)."""
        self._release_if_unused(failed)
        return rebuild and self._rebuild(index)

    def _rebuild(self, index: int) -> bool:
        """Attempts until one starts, the budget is spent, or close(); True as ``_handle``."""
        state = self._replicas[index]
        while True:
            with self._lock:
                attempt, cause = state.restarts, state.cause
            delay = backoff_s(self._backoff_base_s, attempt)
            log.warning("replica %d failed (%s); rebuilding it in %.3g s (attempt %d of %d)",
                        index, cause, delay, attempt, self._max_restarts)
            if self._stop.wait(delay):
                break
            try:
                executor = self._start(index, self._stop)
            except Exception as exc:  # a failed start is an attempt; the next one may succeed
                with self._lock:
                    state.cause = f"rebuild {attempt} failed to start: {exc}"
                    if state.restarts >= self._max_restarts:
                        self._give_up(index, state)
                        return False
                    state.restarts += 1
                continue
            failed = self._swap_in(index, state, executor, attempt)
            if failed is not None:
                return failed
            break
        with self._lock:  # closed
            state.restarting = False
        return False

    def _swap_in(self, index: int, state: _Replica, executor: MultiprocessExecutor, attempt: int) -> bool | None:
        """Put the started ``executor`` in service; None (and closed) when the engine closes, else
        whether it failed already (before its callback was in place, or while it was not yet in
        service: its callback found the old executor, so the caller handles this failure)."""
        self._listen(executor)
        with self._lock:
            old = None if self._stop.is_set() else self._dispatcher.replace(index, executor)
            if old is not None:
                state.restarting = False
                state.cause = None
                self._notice(index)  # it failed between its start and now
                failed = state.failed is executor
        if old is None:  # closed meanwhile: this supervisor never serves
            executor.close()
            return None
        log.warning("replica %d serves again (rebuild %d)", index, attempt)
        self._release_if_unused(old)
        return failed

    def _release_if_unused(self, failed: ReplicaExecutor) -> None:
        """Close ``failed``'s supervisor when no executor in the dispatcher uses it (a shared
        one keeps serving the other replicas). Its group's error stays the failure's cause."""
        if not isinstance(failed, MultiprocessExecutor):
            return
        supervisor = failed.supervisor
        for executor in self._dispatcher.executors:
            if executor is not failed and isinstance(executor, MultiprocessExecutor) \
                    and executor.supervisor is supervisor:
                return
        try:
            supervisor.close()
        except Exception:  # the rebuild goes on regardless; close() logs its own trouble
            log.exception("closing the failed supervisor of replica %d", failed.index)

    # -- closing -----------------------------------------------------------------------

    def stop(self) -> None:
        """No failure is handled and no rebuild swapped in from now on; backoffs end at once."""
        with self._lock:
            self._stop.set()

    def join(self) -> None:
        """After ``stop()``: wait for the threads handling a failure (reapers); a start under way sees
        the stop event and abandons itself, closing what it started."""
        with self._lock:
            threads = [t for t in self._handlers if t is not threading.current_thread()]
        for thread in threads:
            thread.join(self._join_s)
            if thread.is_alive():
                log.error("a rebuild of a replica did not stop within %.0f s of close()", self._join_s)

    def close(self) -> None:
        self.stop()
        self.join()
