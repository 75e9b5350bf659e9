"""The watch thread: the supervisor's one I/O thread, and the fallback reader of the answers.

    rank DEALER "h-R-r" --"hb"--> hb ROUTER --+
    rank process sentinels (duplicates) ------+--> one zmq_poll --> heartbeats, an exited rank,
    wake-up pipe (submit, a reader leaving) --+      a wake-up; as the reader, one ctl ROUTER
    ctl ROUTER, when it holds the reader role +      message; then deadlines and bookkeeping
    each turn: the rings' queued messages flushed, released request blocks freed (groups.flush_rings)

Each iteration: check the deadlines when due (heartbeats, requests, the start); take the
reader role if answers are due and no caller reads (``ReaderRole.take_locked``); poll;
then, as the reader, the bookkeeping and the completion of the futures taken, last, so
that a caller woken by one finds this thread about to release the GIL in its next poll;
the role is given up once nothing is due (``leave`` hands it back to this thread if a
submit slipped in).

Invariants:
- The hb ROUTER and the wake-up pipe's read end belong to this thread; so do the
  duplicates of the rank sentinels (a reaper closes the originals on its own schedule).
- Heartbeats are watched whoever reads the answers; deadlines are checked at least every
  ``heartbeat_interval_s`` / 2 and at each request's own deadline.
- A failure of this thread fails every group (no caller waits forever).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from runtime.core.config import WorkerSupervisorConfig
from runtime.core.errors import WorkerStartupError
from runtime.transport.wake_pipe import WakePipe
from supervisor.answers import AnswerReader, answers_due
from supervisor.boot import Startup
from supervisor.channel import RequestChannel
from supervisor.failure import Failures
from supervisor.groups import GroupState, RankState, flush_rings, recv_from_rank

log = logging.getLogger("phyrt.supervisor")

_POLLIN = int(zmq.POLLIN)


class Watch:
    def __init__(self, groups: list[GroupState], hb: zmq.Socket, router: zmq.Socket, wakeup: WakePipe,
                 channel: RequestChannel, answers: AnswerReader, failures: Failures, startup: Startup,
                 config: WorkerSupervisorConfig) -> None:
        self._groups, self._hb, self._router, self._wakeup = groups, hb, router, wakeup
        self._channel, self._answers, self._failures, self._startup = channel, answers, failures, startup
        self._config = config
        self._beats = {f"h-{g.index}-{r.rank}".encode(): (g, r) for g in groups for r in g.ranks}
        self._stopping = False
        self.ident: int | None = None
        self._thread = threading.Thread(target=self._run, name="phyrt-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (close()); the reader role is closed first, so it leaves it."""
        self._stopping = True
        self._wakeup.wake()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        self.ident = threading.get_ident()
        sentinels: dict[int, RankState] = {}
        try:
            for group in self._groups:
                for r in group.ranks:
                    sentinels[os.dup(r.process.sentinel)] = r
            self._loop(sentinels)
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("supervisor I/O thread failed")
            for group in self._groups:
                self._answers.fail(group, f"the supervisor's I/O thread failed: {exc!r}")
            self._startup.finish(WorkerStartupError(f"the supervisor's I/O thread failed: {exc!r}"))
        finally:
            if self._channel.role.held_here():
                self._answers.complete()  # answers that came in before a close
            self._channel.role.leave(hand_on=False)
            for fd in sentinels:
                os.close(fd)

    def _loop(self, sentinels: dict[int, RankState]) -> None:
        role, router, hb, wake_fd = self._channel.role, self._router, self._hb, self._wakeup.fd
        started = next_check = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now >= next_check:
                self.check_deadlines(started)
                next_check = now + self._config.heartbeat_interval_s / 2
                self._channel.wake_at = min(next_check, self._next_deadline())
            with role.lock:
                reading = role.held_here() or (answers_due(self._groups, self._startup) and role.take_locked())
            items: list[tuple[Any, int]] = [(hb, _POLLIN), (wake_fd, _POLLIN), *((fd, _POLLIN) for fd in sentinels)]
            if reading:
                items.append((router, _POLLIN))
            # a ring waiting for a rank's credit: flushed each turn, so look again soon
            wait_ms = 2 if flush_rings(self._groups) else max(0, int((self._channel.wake_at - now) * 1000) + 1)
            for item, _ in zmq.zmq_poll(items, wait_ms):
                if item is router:
                    self._answers.take()
                elif item is hb:
                    self._recv_beats()
                elif item == wake_fd:
                    self._wakeup.drain()
                    next_check = 0.0  # woken for an earlier deadline, maybe: plan again
                else:
                    r = sentinels.pop(item)
                    os.close(item)
                    self._rank_exited(r)
            if time.monotonic() >= self._channel.wake_at:
                next_check = 0.0  # a request deadline is due: check now
            self._bookkeeping(reading)

    def _bookkeeping(self, reading: bool) -> None:
        role = self._channel.role
        if not reading and self._answers.frees_waiting() and role.take():
            reading = True  # give result blocks back to their ranks (a caller reading sends them itself)
        if not reading:
            return
        self._answers.after_poll()
        with role.lock:
            idle = not answers_due(self._groups, self._startup)
        if idle:
            role.leave()  # hands on (wakes this thread) if a submit came in since

    def _rank_exited(self, r: RankState) -> None:
        group = self._groups[r.replica]
        if group.failed is None:
            self._answers.fail(group, self._failures.dead_rank([r]) or f"rank {r.rank} exited")

    def check_deadlines(self, started: float) -> None:
        now = time.monotonic()
        hb_timeout = self._config.heartbeat_timeout_s
        for group in self._groups:
            if group.failed is not None:
                continue
            # a starting rank may hold the GIL in its build: startup_timeout_s covers it
            late = [r for r in group.ranks if r.ready and now - r.last_beat > hb_timeout]
            if late:
                self._answers.fail(group, f"rank {late[0].rank} sent no heartbeat for {now - late[0].last_beat:.1f} s "
                                          f"(heartbeat_timeout_s={hb_timeout})")
                continue
            expired = [i for i, p in list(group.pending.items()) if p.deadline is not None and now > p.deadline]
            if expired:
                self._answers.fail(group, f"execution timeout {self._config.execution_timeout_s} s after "
                                          f"submission (request {expired[0]})")
        self._startup.check_timeout(started, now)

    def _next_deadline(self) -> float:
        deadlines = [p.deadline for g in self._groups if g.failed is None
                     for p in list(g.pending.values()) if p.deadline is not None]
        return min(deadlines, default=float("inf"))

    def _recv_beats(self) -> None:
        """Take every heartbeat queued on the hb ROUTER."""
        hb = self._hb
        while hb.getsockopt(zmq.EVENTS) & _POLLIN:
            got = recv_from_rank(hb, self._beats, "heartbeat")
            if got is None:
                continue
            group, r, _, count = got
            if count != 1 and group.failed is None:
                self._answers.fail(group, f"rank {r.rank} sent a malformed heartbeat: {count} frames, not 1")
