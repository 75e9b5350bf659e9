"""WorkerSupervisor: spawns the ranks of every local replica and watches them; a facade
over one module per concern.

    caller threads                      watch thread (I/O)                 rank processes
    submit(replica, request, future) -- channel: broadcast ring -------> every rank reads it
    future.result(): the reader ------- channel: ctl ROUTER <--"done"---- DEALER "c-R-0" (output rank)
                                        otherwise the reader: ctl ROUTER <-- (same answers)
                                        always: hb ROUTER <------"hb"---- DEALER "h-R-r"
                                        sentinels, wake-ups, deadlines
    a failure anywhere --> Failures.fail(group), once --> the group's reaper stops its ranks

    boot.py      spawn and the ready handshake     channel.py  submit; the reader role; the future
    answers.py   what the reader does with answers watch.py    the I/O thread, fallback reader
    failure.py   a group fails once; blame         reaping.py  one reaper per group; release
    groups.py    per-group state and arena adapters processes.py the OS side of the ranks

Invariants (each module states its own):
- One lock for submission and reading (``ReaderRole.lock``): pending requests, the group's
  ``failed`` flag and the reader's identity change together; ``Reaping.lock`` guards the
  rank ``Process`` objects; each group's ``arena_lock`` its request arena; none is taken
  while another of them is held, except an arena's under the channel's.
- Every rank has one owner, its group's reaper, started once when the group stops serving
  (a failure, or ``close()``); ``close()`` joins them all (see ``supervisor.reaping``).
- Shared memory: each replica's requests go through an arena this process owns; each rank
  answers through its own arena. A segment's name is unlinked as soon as every process that
  needs it has mapped it, and stale names of dead runs are swept at start, so even
  ``kill -9`` of the whole tree leaves /dev/shm clean. Results that arrived through shared
  memory are views: the rank's block is freed when the last tensor viewing it is collected.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from runtime.core.config import EngineArgs, WorkerSupervisorConfig
from runtime.transport.owners import sweep_run_dirs
from runtime.transport.reader import ReaderRole
from runtime.transport.arena import ShmMapper, new_run_id, sweep_run, sweep_stale
from runtime.transport.spin import budget_ns, usable_cores
from runtime.transport.wake_pipe import WakePipe
from supervisor.answers import AnswerReader, answers_due
from supervisor.boot import Launcher, Startup
from supervisor.channel import RequestChannel
from supervisor.failure import CLOSED, Failures
from supervisor.groups import GroupState, lend_tensor
from supervisor.processes import SpawnThread
from supervisor.reaping import Reaping
from supervisor.watch import Watch

log = logging.getLogger("phyrt.supervisor")


class WorkerSupervisor:
    """Owns the rank processes, the run directory, the sockets and the arenas."""

    def __init__(self, args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]],
                 config: WorkerSupervisorConfig, target: str, *, first_replica: int = 0,
                 cancel: threading.Event | None = None) -> None:
        """Start the ranks of ``placement`` (one device tuple per replica) and wait until all are
        ready. Group i serves the engine's replica ``first_replica + i`` (a rebuilt replica is a
        supervisor of its own); setting ``cancel`` abandons the start (WorkerStartupError)."""
        self.config = config
        self._first_replica = first_replica
        self._closed = False
        sweep_stale()  # segments of runs whose processes were all killed
        sweep_run_dirs()
        self.run_id = new_run_id()
        # mode 0700; the pid in the name lets a later start remove it if this process is SIGKILLed
        self.run_dir = tempfile.mkdtemp(prefix=f"phyrt-{self.run_id}-{os.getpid()}-")
        self.address = f"ipc://{self.run_dir}/ctl"
        spare_core = sum(len(p) for p in placement) < usable_cores()
        # a rank looks for the next request a moment after answering one (runtime.transport.spin)
        self.worker_spin_ns = budget_ns("worker") if spare_core else 0
        self._ctx = zmq.Context(1)
        self._sockets: list[zmq.Socket] = []
        self._groups: list[GroupState] = []
        self._mapper = ShmMapper(self.run_id)
        self._wakeup = WakePipe()  # wakes the watch thread
        self._startup = Startup(self._groups, self._mapper, config.startup_timeout_s, cancel)
        self._role = ReaderRole(lambda: answers_due(self._groups, self._startup), self._wakeup.wake)
        self._listeners: dict[int, list[Callable[[], None]]] = {}  # group -> told once it failed
        self._listeners_lock = threading.Lock()
        self._reaping = Reaping(self.run_id, self._role.wake, self._tell_failed)
        self._failures = Failures(self._role.lock, self._reaping, self._startup, self._role.wake)
        self._answers: AnswerReader | None = None  # once the ranks are spawned
        self._watch: Watch | None = None
        # ranks die with the thread that forked them (PR_SET_PDEATHSIG): one that outlives them
        self._spawner = SpawnThread(f"phyrt-spawn-{self.run_id}")
        success = False
        try:
            self._start(args, plugin_spec, placement, target, budget_ns("caller") if spare_core else 0)
            success = True
        finally:
            if not success:
                self.close()

    def _start(self, args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]], target: str,
               caller_spin_ns: int) -> None:
        router = self._socket(zmq.ROUTER, self.address)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        hb = self._socket(zmq.ROUTER, f"ipc://{self.run_dir}/hb")
        Launcher(self.run_id, self.run_dir, self._mapper, self._spawner).spawn(
            self._groups, args, plugin_spec, placement, self.config, target, self.worker_spin_ns,
            self._first_replica)
        self._answers = AnswerReader(router, self._groups, self._role, self._failures, self._startup, self._mapper)
        self._channel = RequestChannel(self._groups, self._role, self._answers, router,
                                       self.config, caller_spin_ns, self._wakeup.wake)
        self._watch = Watch(self._groups, hb, router, self._wakeup, self._channel, self._answers, self._failures,
                            self._startup, self.config)
        self._watch.start()
        self._startup.wait()

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        self._sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    # -- the engine's side ---------------------------------------------------------

    def group_error(self, replica: int) -> str | None:
        """Why ``replica``'s group stopped serving ("the engine is closed" after close); None while healthy."""
        return self._groups[replica].failed

    def on_group_failure(self, replica: int, callback: Callable[[], None]) -> None:
        """``callback()`` once ``replica``'s group fails (not at close), on its reaper thread after its
        futures failed, holding no lock of ours. One registered after its group failed is not
        called: look at ``group_error`` after registering."""
        with self._listeners_lock:
            self._listeners.setdefault(replica, []).append(callback)

    def _tell_failed(self, replica: int) -> None:
        with self._listeners_lock:
            callbacks = self._listeners.pop(replica, [])
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one listener's trouble must not stop the reaper
                log.exception("a listener of replica group %d's failure raised", replica)

    def start_call(self, replica: int, request: Any, then: Callable[[], None] | None = None) -> Any:
        """``Engine.step``'s send: ``submit`` with a waitable for ``finish_call`` (``then()`` once the
        request is answered or failed), the calling thread made the reader of the answers first
        when nobody reads (``supervisor.channel``)."""
        return self._channel.start_call(replica, request, then)

    def finish_call(self, waitable: Any, timeout: float | None) -> Any:
        """The answer to ``start_call``'s request, read (or waited for) in the calling thread."""
        return self._channel.finish_call(waitable, timeout)

    def submit(self, replica: int, request: Any, future: Future, stream: Any = None) -> None:
        """Send ``request`` to every rank of ``replica``; ``future`` gets the output rank's answer,
        ``stream`` (a ``StreamCall``) the chunks a streamed request sends before it. The future is
        completed by whichever thread reads the answers (the watch thread when no caller does)."""
        self._channel.submit(replica, request, future, stream)

    def empty(self, replica: int, shape: tuple[int, ...], dtype: Any) -> Any:
        """A tensor in ``replica``'s request arena, sent without a copy (``supervisor.groups.lend_tensor``)."""
        return lend_tensor(self._groups[replica], shape, dtype)

    def close(self) -> None:
        """Fail pending requests, stop every rank, remove the run directory and segments."""
        with self._role.lock:
            if self._closed:
                return
            self._closed = True
        self._role.close()  # nobody takes the reader role from now on; a reading caller is woken
        if self._watch is not None:
            self._watch.stop()
        # pending futures fail first: a caller reading for one then gives the role up
        serving = [group for group in self._groups if self._failures.close_group(group)]
        if not self._role.wait_released(10.0):
            log.error("a thread still reads the supervisor's socket at close")
        for group in serving:  # its ranks are told to shut down (nobody reads: the ROUTER is ours)
            if self._answers is not None:
                self._answers.send_shutdown(group)
            self._reaping.stop(group, {}, CLOSED, None, polite=True)
        self._reaping.join_all()
        self._spawner.stop()  # only now: its end SIGKILLs any rank it started
        self._release_resources()

    def _release_resources(self) -> None:
        for group in self._groups:
            group.arena.close()
            if group.ring is not None:
                group.ring.close()
        self._mapper.close()
        for sock in self._sockets:
            sock.close(0)
        self._wakeup.close()
        self._role.dispose()
        self._ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        sweep_run(self.run_id)
