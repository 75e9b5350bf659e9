"""WorkerSupervisor: spawns the ranks of every local replica and watches them.

    caller threads                       link thread "phyrt-supervisor"      rank processes
    submit(replica, request, future) --- Replica.submit: broadcast ring ---> every rank reads it
    finish_call(slot): the reader ------ answer lane <----------- DONE ----- rank 0 (runtime.link.lane)
                                         ctl ROUTER <---- PARTIAL, big DONE -- DEALER "c-R-0"
                                         otherwise the reader: the same two
                                         always: hb ROUTER <------- HB ------ DEALER "h-R-r"
                                         sentinels, deadlines, the rings' flushes
    a failure anywhere --> _fail(replica), once --> its futures fail, its reaper stops its ranks

    boot.py  spawn and the ready handshake       replica.py   one replica: requests, answers, blocks
    processes.py  the OS side: start_rank (on the link thread), reapers, blame
    runtime.link.rank_answers  reading what the ranks send (the ctl ROUTER, answer lanes, hb ROUTER)

The watch is an end of a ``runtime.link.link_thread.LinkThread`` (this class: ``tick``,
``poll_items``, ``after_poll``, ``broken``, ``shut``): heartbeats are watched whoever reads the
answers; deadlines are checked every ``heartbeat_interval_s`` / 2 and at each request's own
(``execution_timeout_s`` from submission); a failure of the thread fails every replica.

Reader role (``runtime.link.reader.ReaderRole``, the client's rule too): one thread reads the ctl
ROUTER, a caller of ``start_call`` waiting on its own slot when the role is free (no thread switch per
round trip), else the link thread; the reader polls the ctl ROUTER and each replica's answer lane. Its lock
guards only who reads (and ``_closed``); each replica's requests and ``failed`` flag are under its
table's lock. A submit registers its request, then looks whether
anyone reads; a reader gives the role up, then looks whether answers are due: one of them sees
the other, so no answer waits unread.

Every rank has one owner, its replica's reaper (``processes.Reaping``), started once when the
replica stops serving; ``close()`` joins them all. Each replica's requests go through an arena this
process owns, each rank answers through its own; a segment's name is unlinked as soon as every
process that needs it mapped it, and stale names of dead runs are swept at start, so even
``kill -9`` of the whole tree leaves /dev/shm clean.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from runtime.core.config import EngineArgs, WorkerSupervisorConfig
from runtime.core.errors import WorkerStartupError
from runtime.core.futures import Slot
from runtime.link.link_thread import LinkThread
from runtime.link.rank_answers import Answers
from runtime.link.reader import ReaderRole
from runtime.transport.arena import ShmMapper, new_run_id, sweep_run, sweep_stale
from runtime.transport.owners import sweep_run_dirs
from runtime.transport.spin import Spinner, budget_ns, usable_cores
from supervisor.boot import Launcher, Startup
from supervisor.processes import RankState, Reaping
from supervisor.replica import Replica, fail_futures

log = logging.getLogger("phyrt.supervisor")

#: why every replica still serving stopped at close()
CLOSED = "the engine is closed"
_POLLIN = int(zmq.POLLIN)


class WorkerSupervisor:
    """Owns the rank processes, the run directory, the sockets and the arenas."""

    def __init__(self, args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]],
                 config: WorkerSupervisorConfig, target: str, *, first_replica: int = 0,
                 cancel: threading.Event | None = None) -> None:
        """Start the ranks of ``placement`` (one device tuple per replica) and wait until all are
        ready. Group i serves the engine's replica ``first_replica + i`` (a rebuilt replica is a
        supervisor of its own); setting ``cancel`` abandons the start (WorkerStartupError)."""
        self.config = config
        self._closed = False
        sweep_stale()  # segments of runs whose processes were all killed
        sweep_run_dirs()
        self.run_id = new_run_id()
        # mode 0700; the pid in the name lets a later start remove it if this process is SIGKILLed
        self.run_dir = tempfile.mkdtemp(prefix=f"phyrt-{self.run_id}-{os.getpid()}-")
        self.address = f"ipc://{self.run_dir}/ctl"
        # only the output ranks (one per replica) spin: the others send nothing per request, and a
        # spinning rank beside them would take the core their compute needs
        spare_core = len(placement) < usable_cores()
        # an output rank looks for the next request a moment after answering one (runtime.transport.spin)
        self.worker_spin_ns = budget_ns("worker") if spare_core else 0
        self._spinner = Spinner(budget_ns("caller") if spare_core else 0)
        self._ctx = zmq.Context(1)
        self._sockets: list[zmq.Socket] = []
        self._replicas: list[Replica] = []  # filled by the spawn, then never changed
        self._mapper = ShmMapper(self.run_id)
        self._link = LinkThread("phyrt-supervisor")
        self._role = ReaderRole(self._answers_due, self._left)
        self._reaping = Reaping(self.run_id)
        self._startup = Startup((), self._mapper, config.startup_timeout_s, cancel)
        self._answers: Answers | None = None
        self._sentinels: dict[int, RankState] = {}  # the link thread's duplicates of the ranks' sentinels
        self._next_check = 0.0
        self.wake_at = 0.0  # when the link thread next wakes by itself (monotonic)
        self._reading = False
        success = False
        try:
            self._start(args, plugin_spec, placement, target, first_replica, cancel)
            success = True
        finally:
            if not success:
                self.close()

    def _start(self, args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]], target: str,
               first_replica: int, cancel: threading.Event | None) -> None:
        self._router = self._socket(zmq.ROUTER, self.address)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._hb = self._socket(zmq.ROUTER, f"ipc://{self.run_dir}/hb")
        self._link.start()  # the ranks are forked from it, and die with it (PDEATHSIG): it outlives them
        Launcher(self.run_id, self.run_dir, self._mapper, self._link.call, self._queued).spawn(
            self._replicas, args, plugin_spec, placement, self.config, target, self.worker_spin_ns, first_replica)
        replicas = tuple(self._replicas)
        self._startup = Startup(replicas, self._mapper, self.config.startup_timeout_s, cancel)
        self._answers = Answers(self._router, replicas, self._startup, self._fail)
        poll_ms = int(self.config.heartbeat_interval_s * 1000) + 1
        self._read = functools.partial(self._answers.read, self._role, self._spinner, poll_ms)
        self._sentinels = {os.dup(r.process.sentinel): r for g in replicas for r in g.ranks}
        self._started = time.monotonic()
        self._link.add(self)
        self._startup.wait()

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    # -- the engine's side ---------------------------------------------------------

    def replica(self, index: int) -> Replica:
        """Group ``index``: its ``failed`` ("the engine is closed" after close), ``info``, queue, arena."""
        return self._replicas[index]

    def on_group_failure(self, replica: int, callback: Callable[[], None]) -> bool:
        """``callback()`` once ``replica``'s group fails (not at close), on its reaper thread after its
        futures failed and its ranks were stopped and released, holding no lock of ours (it may take
        long: the restart controller rebuilds the replica there, and may close this supervisor).
        False, and never called, when the group's failure was told already."""
        return self._reaping.listen(replica, callback)

    def start_call(self, replica: int, request: Any, then: Callable[[], None] | None = None,
                   priority: int = 0) -> tuple[Slot, int]:
        """``Engine.step``'s send: ``submit`` with a ``Slot`` for ``finish_call`` (``then()`` once
        answered or failed), the calling thread made the reader first when nobody reads."""
        slot = Slot(then)
        owned = self._role.take_free()
        try:
            self._replicas[replica].submit(request, slot, None, priority)
        except BaseException:
            if owned:
                self._role.leave()
            raise
        return slot, owned

    def finish_call(self, call: tuple[Slot, int], timeout: float | None) -> Any:
        """``start_call``'s answer: read here while this thread is (or can become) the reader, else
        slept for; a role taken by ``start_call`` is given up at the end."""
        slot, owned = call
        if not self._role.wait(slot, timeout, self._read, owned):
            raise TimeoutError(f"no result within {timeout} s (the request was still running; its result is dropped)")
        return slot.result()

    def _queued(self, group: Replica, entry: Any) -> None:
        """Each replica's, after a submit (``Replica.submit``): the answer is read by whichever thread
        reads; the link thread when nobody else does, or when it would sleep past this request's
        deadline or a batch's delay."""
        due = group.window.due
        if self._role.holder is None or (entry.deadline is not None and entry.deadline < self.wake_at) \
                or (due is not None and due < self.wake_at):
            self._link.wake()

    def _left(self, hand_on: bool) -> None:
        """The reader role was given up: answers still due wake the link thread to read them."""
        if hand_on:
            self._link.wake()

    def _answers_due(self) -> bool:
        """Under the role's lock (``ReaderRole.awaiting``): whether answers are due (none once closed)."""
        if self._closed:
            return False
        return not self._startup.done or any(len(g.pending.table) for g in self._replicas if g.failed is None)

    # -- failing -------------------------------------------------------------------------

    def _fail(self, replica: Replica, reason: str, cause: BaseException | None = None,
              suspects: tuple[RankState, ...] = (), grace_s: float = 0.0) -> None:
        """Fail ``replica`` (once), blaming the first of ``suspects`` that exited (within ``grace_s``)
        rather than ``reason``: its futures fail, its reaper stops its ranks, a start fails."""
        if suspects:
            dead = self._reaping.dead_rank(list(suspects), grace_s)
            if dead is not None:
                log.info("replica %d: %s, after its peer's death", replica.engine_replica, reason)
                reason, cause = dead, None
        if self._answers is not None and self._role.held_here():
            self._answers.complete()  # answers that came in first win, as they would have unbatched
        taken = replica.fail(reason)
        if taken is None:
            return
        message = f"replica {replica.engine_replica} failed: {reason}"
        log.error(message)
        fail_futures(taken, message, cause)
        self._role.wake()  # a caller reading finds its future failed
        self._reaping.stop(replica.index, replica.ranks, False, functools.partial(_close_ring, replica))
        if not self._startup.done:
            error = WorkerStartupError(f"replica {replica.engine_replica} failed to start: {reason}")
            error.__cause__ = cause
            self._startup.finish(error)

    # -- the link thread's end ---------------------------------------------------------

    def tick(self, now: float) -> float:
        """Heartbeats and the start every heartbeat_interval_s / 2, and at the moment the quietest rank
        would pass heartbeat_timeout_s; request deadlines when due; the rings flushed. When to tick next."""
        if now >= self._next_check:
            quiet_until = self._check_deadlines(now)
            self._next_check = min(now + self.config.heartbeat_interval_s / 2, quiet_until)
        due, waiting = self._next_check, False
        for group in self._replicas:
            deadline = group.pending.peek_deadline()
            if deadline is not None:
                if deadline <= now:
                    self._expire(group, now)
                    deadline = group.pending.next_deadline()
                due = min(due, deadline or due)
            if group.window.due is not None:  # a batch waiting out its delay
                due = min(due, group.pump() or due)
            waiting = group.flush() or waiting
        self.wake_at = due
        return now + 0.002 if waiting else due

    def _check_deadlines(self, now: float) -> float:
        """Fail the replicas with a rank silent past heartbeat_timeout_s, and a start past its timeout;
        when the quietest serving rank would pass it (so that a silence is found when it happens)."""
        hb_timeout = self.config.heartbeat_timeout_s
        quiet_until = float("inf")
        for group in self._replicas:
            # a starting rank may hold the GIL in its build: startup_timeout_s covers it
            late = [r for r in group.ranks if r.ready and now - r.last_beat > hb_timeout]
            if late and group.failed is None:
                self._fail(group, f"rank {late[0].rank} sent no heartbeat for {now - late[0].last_beat:.1f} s "
                                  f"(heartbeat_timeout_s={hb_timeout})")
            elif group.failed is None:
                quiet_until = min([quiet_until, *(r.last_beat + hb_timeout + 0.001 for r in group.ranks if r.ready)])
        self._startup.check_timeout(self._started, now)
        return quiet_until

    def _expire(self, group: Replica, now: float) -> None:
        entry = group.pending.earliest()
        if entry is not None and entry.deadline is not None and entry.deadline <= now:
            self._fail(group, f"execution timeout {self.config.execution_timeout_s} s after submission "
                              f"(request {entry.key})")

    def poll_items(self) -> list[tuple[Any, Callable[[], None]]]:
        role, answers = self._role, self._answers
        self._reading = role.take_if_due()
        items = [(self._hb, functools.partial(answers.take_beats, self._hb))]
        items += [(fd, functools.partial(self._rank_exited, fd)) for fd in self._sentinels]
        if self._reading:
            items += answers.items
        return items

    def _rank_exited(self, fd: int) -> None:
        r = self._sentinels.pop(fd)
        os.close(fd)
        group = self._replicas[r.replica]
        if group.failed is None:
            self._fail(group, f"rank {r.rank} exited", suspects=(r,))

    def after_poll(self) -> None:
        role, answers = self._role, self._answers
        if not self._reading and any(g.frees for g in self._replicas) and role.take():
            self._reading = True  # give result blocks back to their ranks (a caller reading sends them itself)
        if not self._reading:
            return
        answers.after_poll()
        with role.lock:
            idle = not self._answers_due()
        if idle:
            role.leave()  # hands on (wakes this thread) if a submit came in since

    def broken(self, exc: BaseException) -> None:
        for group in self._replicas:  # no caller may wait forever
            self._fail(group, f"the supervisor's I/O thread failed: {exc!r}")
        self._startup.finish(WorkerStartupError(f"the supervisor's I/O thread failed: {exc!r}"))

    def shut(self) -> None:
        if self._role.held_here():
            self._answers.complete()  # answers that came in before a close
        self._role.leave(hand_on=False)
        self._close_sentinels()

    def _close_sentinels(self) -> None:
        while self._sentinels:
            os.close(self._sentinels.popitem()[0])

    # -- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending requests, stop every rank, remove the run directory and segments."""
        with self._role.lock:
            if self._closed:
                return
            self._closed = True
        self._role.close()  # nobody takes the reader role from now on; a reading caller is woken
        serving = []
        for group in self._replicas:  # pending futures fail first: a caller reading gives the role up
            was_serving, taken = group.close(CLOSED)
            fail_futures(taken, CLOSED, None)
            if was_serving:
                serving.append(group)
        self._link.wake()  # the link thread, if it reads, sees nothing due now and gives the role up
        if not self._role.wait_released(10.0):
            log.error("a thread still reads the supervisor's socket at close")
        for group in serving:  # its ranks are told to shut down (nobody reads: the ROUTER is ours)
            group.send_shutdown()
            self._reaping.stop(group.index, group.ranks, True, functools.partial(_close_ring, group))
        self._reaping.join_all()
        # only now: the ranks were forked from the link thread, so its end SIGKILLs any still alive
        if not self._link.stop():
            log.error("the supervisor's link thread did not stop")
        self._reaping.join_all()  # a reaper the link thread started meanwhile (a failure it saw first)
        self._close_sentinels()  # (the thread's, when it never ran)
        self._release_resources()

    def _release_resources(self) -> None:
        for group in self._replicas:
            group.arena.close()
            _close_ring(group)
            if group.answers is not None:
                group.answers.close()
        self._mapper.close()
        for sock in self._sockets:
            sock.close(0)
        self._link.dispose()
        self._role.dispose()
        self._ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        sweep_run(self.run_id)


def _close_ring(replica: Replica) -> None:
    if replica.ring is not None:
        replica.ring.close()  # nobody reads it any more
