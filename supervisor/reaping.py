"""Reaping: every rank has one owner, its group's reaper thread, which stops it and releases it.

    a group ends, once (Failures.fail: an error; Failures.close_group: close())
      -> Reaping.stop(group)            starts the group's one reaper thread
    reaper: fail the deferred futures -> stop_ranks (SIGTERM, a grace, SIGKILL; it reaps them)
            -> release(ranks): wait (bounded) for each exit code, close each Process's pipes
               whatever showed, a ReapedProcess in its place; sweep the dead ranks' /dev/shm names
    close(): ends every group still serving the same way, then join_all()

Why no rank's pipes outlive ``close()`` (by construction):
- One owner per rank. A group's ranks go to exactly one reaper, started at the group's one
  transition from serving to ended (``group.failed`` set under the channel's lock); close()
  makes that transition for every group still serving, then joins every reaper, each
  bounded by ``stop_bound_s`` + ``EXIT_CODE_WAIT_S``; a started process is in its group
  before anything can fail (``supervisor.boot``).
- One place. ``release`` is the only code that closes a rank's ``Process``, and it closes
  the pipes whether or not the exit code showed: a rank reads "still running" for a moment
  when another thread's ``waitpid`` reaped it and has not stored the code yet
  (``Process.start`` polls every child of this process, in any thread).
- Only the owner reaps. Everything else in the supervisor reads exit codes with ``WNOWAIT``
  (``processes.exit_code``), so the one race left is with waits outside the supervisor;
  the bounded wait covers it for the exit code, the unconditional close for the pipes.
  What is left to chance: a reaper that gets no CPU for its whole bound (logged by name).

``lock`` guards the ``Process`` objects from the moment a reaper may close them: a
thread that looks at a rank (``Failures.dead_rank``) takes it and skips closed ranks.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from typing import Callable

from runtime.core.errors import EngineUnavailableError
from runtime.core.futures import resolve
from runtime.transport.arena import sweep_creators
from supervisor.groups import GroupState, PendingRequest, RankState, ReapedProcess
from supervisor.processes import exit_code, stop_bound_s, stop_ranks

log = logging.getLogger("phyrt.supervisor")

#: how long releasing a stopped rank waits for its exit code to show (see the module docstring)
EXIT_CODE_WAIT_S = 1.0


class Reaping:
    """The reaper threads of the groups that ended, and the release of their ranks."""

    def __init__(self, run_id: str, wake_readers: Callable[[], None], failed: Callable[[int], None]) -> None:
        """``failed(group index)``: told on the reaper thread, once the futures of a group that
        failed (not one closed) have failed."""
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._run_id = run_id
        self._wake_readers = wake_readers
        self._failed = failed
        self._bound_s = 0.0  # the longest a reaper started so far may take

    def stop(self, group: GroupState, pending: dict[int, PendingRequest], message: str,
             cause: BaseException | None, polite: bool) -> None:
        """Start ``group``'s reaper: called once per group, at the end of its serving (the
        caller made that transition); ``pending``: futures it fails first (off the caller's thread).
        ``polite``: the group is closed (its ranks asked to shut down), not failed."""
        reaper = threading.Thread(target=self._reap, args=(group, pending, message, cause, polite),
                                  name=f"phyrt-reaper-{group.index}", daemon=True)
        with self.lock:
            self._bound_s = max(self._bound_s, stop_bound_s(len(group.ranks), polite) + EXIT_CODE_WAIT_S)
            self.threads.append(reaper)
        reaper.start()

    def join_all(self) -> None:
        """Wait for every reaper (close()); each is bounded, so this is too."""
        with self.lock:
            reapers, bound = list(self.threads), self._bound_s + 5.0
        deadline = time.monotonic() + bound
        for reaper in reapers:
            reaper.join(max(0.0, deadline - time.monotonic()))
            if reaper.is_alive():
                log.error("%s has not finished stopping its ranks within %.0f s", reaper.name, bound)

    def _reap(self, group: GroupState, pending: dict[int, PendingRequest], message: str,
              cause: BaseException | None, polite: bool) -> None:
        try:
            fail_futures(pending, message, cause)
            self._wake_readers()
            if not polite:
                self._failed(group.index)
        finally:  # whatever happens above, the ranks are stopped and released
            try:
                stop_ranks([r.process for r in group.ranks], polite=polite)
            finally:
                self.release(group.ranks)
                if group.ring is not None:
                    group.ring.close()  # nobody reads it any more

    def release(self, ranks: list[RankState]) -> None:
        """Close the ``Process`` of each stopped rank (its sentinel and its other pipe), waiting
        up to ``EXIT_CODE_WAIT_S`` for its exit code; sweep the /dev/shm names the dead left."""
        waiting = list(ranks)
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while True:
            with self.lock:
                for r in waiting:
                    code = exit_code(r.process)
                    if code is not None:
                        _close(r, code)
                waiting = [r for r in waiting if not r.closed]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # (the thread that reaped one stores its code meanwhile)
        running = []
        with self.lock:
            for r in waiting:
                if _still_a_child(r.process.pid):
                    running.append(r.process.pid)
                    log.error("replica %d rank %d (pid %d) still runs after SIGKILL; its pipes are closed",
                              r.replica, r.rank, r.process.pid)
                _close(r, None)
        dead = [r.process.pid for r in ranks if r.process.pid not in running]
        if dead:
            sweep_creators(self._run_id, dead)


def _close(r: RankState, code: int | None) -> None:
    """Under ``Reaping.lock``: close ``r.process``'s pipes and put a ``ReapedProcess`` in its
    place. With ``code`` None the exit code never showed: multiprocessing refuses to close
    such a process, so its pipes are closed directly; it stays in multiprocessing's
    children (whose next poll reaps it) unless another wait reaped it already (lest that
    pid, given to another child, be waited on)."""
    process = r.process
    r.process = ReapedProcess(process.pid, process.name, code)
    r.closed = True
    if code is not None and process.exitcode is not None:  # reaped (by stop_ranks, normally)
        process.close()
        return
    popen = process._popen
    if popen is not None:
        popen.close()  # runs its finalizer: closes the sentinel and the other pipe
    if not _still_a_child(process.pid):
        multiprocessing.process._children.discard(process)


def _still_a_child(pid: int) -> bool:
    """Whether ``pid`` is still a child of this process (running, or a zombie: WNOWAIT reaps nothing)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def fail_futures(pending: dict[int, PendingRequest], message: str, cause: BaseException | None) -> None:
    for p in pending.values():
        error = EngineUnavailableError(message)
        error.__cause__ = cause
        resolve(p.future, error=error)
