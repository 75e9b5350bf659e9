"""Failures: a replica's group stops serving exactly once, and the rank to blame is named.

    any thread: fail(group, reason)       an exited rank, no heartbeat, a malformed message,
                                          a plugin exception, an execution timeout
      under the channel's lock: group.failed = reason; pending = swap(group.pending)
      -> the request arena closed (its names unlinked)
      -> pending futures fail with EngineUnavailableError("replica R failed: <reason>")
         (here, or by the reaper when the caller may hold locks their callbacks take)
      -> Reaping.stop(group): the group's one reaper stops and releases its ranks
      -> a start still in progress fails with WorkerStartupError
    close(): close_group(group) makes the same transition with "the engine is closed"

Invariants:
- ``group.failed`` goes from None to a reason once, under the channel's lock, together
  with taking the pending requests: a submit either registered its request before (it is
  failed here) or finds the group failed; ``WorkerSupervisor.group_error`` reads it.
- Blame reads exit codes without reaping (``processes.exit_code``); a rank that exited
  is named with how (a signal first, then the lowest rank).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
from typing import Callable

from runtime.core.errors import WorkerStartupError
from supervisor.boot import Startup
from supervisor.groups import GroupState, RankState
from supervisor.processes import describe_exit, exit_code
from supervisor.reaping import Reaping, fail_futures

log = logging.getLogger("phyrt.supervisor")

#: why every group that was still serving stopped at close()
CLOSED = "the engine is closed"


class Failures:
    def __init__(self, lock: threading.Lock, reaping: Reaping, startup: Startup,
                 wake_readers: Callable[[], None]) -> None:
        self._lock = lock  # the channel's (ReaderRole.lock): submits check group.failed under it
        self._reaping = reaping
        self._startup = startup
        self._wake_readers = wake_readers

    def fail(self, group: GroupState, reason: str, cause: BaseException | None = None, *,
             defer: bool = False) -> None:
        """Fail ``group`` (once). ``defer``: its futures are failed by the reaper, not here."""
        with self._lock:  # so that no submit slips in between the flag and the swap
            if group.failed is not None:
                return
            group.failed = reason
            pending, group.pending = group.pending, {}
        message = f"replica {group.engine_replica} failed: {reason}"
        log.error(message)
        with group.arena_lock:
            # no rank will read a request of this group again: its names (a growth segment
            # of a request in flight included) go now, and unused mappings with them
            group.arena.close()
        if not defer:
            fail_futures(pending, message, cause)
            pending = {}
            self._wake_readers()  # a caller reading finds its future failed
        self._reaping.stop(group, pending, message, cause, polite=False)
        if not self._startup.done:
            error = WorkerStartupError(f"replica {group.engine_replica} failed to start: {reason}")
            error.__cause__ = cause
            self._startup.finish(error)

    def close_group(self, group: GroupState) -> bool:
        """close(): fail ``group``'s pending futures with ``CLOSED``; True if it was serving
        until now (the caller then tells its ranks to shut down and starts its reaper)."""
        with self._lock:
            pending, group.pending = group.pending, {}
            serving = group.failed is None
            if serving:
                group.failed = CLOSED
        fail_futures(pending, CLOSED, None)
        return serving

    def dead_rank(self, ranks: list[RankState], wait_s: float = 0.0) -> str | None:
        """"rank K <how it exited>" for one of ``ranks`` whose process has exited (one killed
        by a signal first, then the lowest), waiting up to ``wait_s`` for one to; else None."""
        live: dict[int, RankState] = {}
        try:
            with self._reaping.lock:  # a released rank's process is a ReapedProcess, described all the same
                exits = [(r.rank, r.process.exitcode) for r in ranks if r.closed]
                # waited on without the lock: duplicates, as a reaper may close a Process meanwhile
                for r in ranks:
                    if not r.closed:
                        live[os.dup(r.process.sentinel)] = r
            ready = multiprocessing.connection.wait(list(live), 0.0 if exits else wait_s) if live else []
        finally:
            for fd in live:
                os.close(fd)
        if ready:
            with self._reaping.lock:
                exits += [(live[fd].rank, _exit_of(live[fd])) for fd in ready]
        if not exits:
            return None
        rank, how = min(((k, describe_exit(code)) for k, code in exits), key=lambda e: ("signal" not in e[1], e[0]))
        return f"rank {rank} {how}"


def _exit_of(r: RankState) -> int | None:
    """Under ``Reaping.lock``: the exit code of a rank whose sentinel fired."""
    if r.closed:
        return r.process.exitcode
    return exit_code(r.process, wait_s=0.1)
