"""WorkerSupervisor: spawns the ranks of every local replica and watches them.

    caller threads                     I/O thread                                  rank processes
    submit(replica, request)
      encode (tensors -> shm)
      under _submit_lock: register the pending future, then
      send on each rank's inbox PUSH ------------------------------------------> PULL (every rank)
    step(): the *reader* while it waits
      poll ctl ROUTER, read, complete <-------------------"done"-------------- DEALER "c-R-r"
                                       otherwise the reader: ctl ROUTER <-- (same answers)
                                       always: hb ROUTER <------"hb"--------- DEALER "h-R-r"
                                       inproc PULL (wake/close), sentinels,
                                       heartbeat and request deadlines

Why a reader role. Handing every answer from the I/O thread to the waiting caller
costs a thread switch and a fight for the GIL on each round trip. So, as in
``runtime.client``, a caller blocked in ``Engine.step`` (its submit says so:
``lead=True``) reads the ctl ROUTER itself when no other thread does
(leader/follower), and a lone caller's round trip involves no other thread of this
process. Heartbeats have a socket of their own that only the I/O thread reads, so
they are watched whoever reads the answers. When the machine has a core to spare
(more cores than ranks), the reading caller polls for up to 100 µs (``runtime.transport.spin``;
``PHYRT_SPIN_US``, 0 turns it off) before it sleeps in ``poll``: a
short answer then costs no wake-up of a sleeping thread, and a long one at most
that much of one core. Each rank likewise looks for its next request for up to
300 µs (``runtime.transport.spin``) after an answer (``worker_spin_ns``, sent in its boot).

Invariants:
- The ctl ROUTER is used only by the thread holding the reader role
  (``_reader``, changed under ``_submit_lock``; the lock is the memory barrier ZMQ
  asks for when a socket changes threads). The role goes to a caller waiting on
  its own future (reserved at its submit, or taken at ``result()`` when free), or
  to the I/O thread while answers are awaited and no caller reads. A caller
  leaving the role while answers are still awaited wakes the I/O thread to take
  it. The hb ROUTER and the inproc PULL belong to the I/O thread. The per-rank
  inbox PUSH sockets are used only under ``_submit_lock``, so a request costs no
  thread hand-off on its way out; the inproc socket only wakes the I/O thread (an
  earlier deadline, answers awaited with no reader, close).
- A request is registered as pending before it is sent, so its "done" can never
  arrive first. Its clock starts at submission; deadlines are checked by the I/O
  thread at least every ``heartbeat_interval_s`` / 2 and at each request's own
  deadline, whoever reads.
- A request goes to every rank or to none: a rank's inbox PUSH without a peer
  (its rank died; libzmq dropped the connection) would block, so a submit to
  several ranks first checks that every inbox can take it (POLLOUT), and every
  submit sends with NOBLOCK (one inbox needs no check: its send goes out or
  raises); a rank found unreachable fails the group from the caller, blamed on
  its exit status.
- The reader takes one ROUTER message per poll (the poll is level-triggered;
  after an output rank's answer, also the other ranks' answers already queued)
  and completes the futures of the answers it took after the bookkeeping; any
  failure of a group first completes the answers already taken, as if each had
  been completed on arrival. Failures found by other threads (an exited rank, a
  deadline, close) wake a reading caller through ``_reader_pipe``.
- Any failure of a group (a rank exited, no heartbeat, a malformed message, a
  plugin exception, an execution timeout) fails the whole group exactly once:
  its executor leaves the rotation, its request arena is closed (names unlinked),
  its ranks get SIGTERM then SIGKILL from a reaper thread, which then closes their
  ``Process`` objects and sweeps the names they left in /dev/shm, and every
  pending future gets ``EngineUnavailableError`` naming the rank and the cause.
  A rank's error that reads like a lost peer (gloo's "Connection reset by peer")
  is blamed on a peer that has exited, if one has (or does within a moment): the
  I/O thread may see the survivor's error before the dead rank's sentinel.
- ``Process`` objects are touched under ``_process_lock`` once a reaper may close
  them (a closed one is replaced by a ``ReapedProcess``: pid, name, exit code); the
  I/O thread polls its own duplicates of the sentinels. Every rank is released (its
  ``Process`` closed, its pipes with it) by the one thread that claimed it, a reaper
  or ``close()``, which waits for the ranks' reapers: a rank whose exit code another
  thread's poll is still storing is waited for, not skipped (see ``_release``).
- Shared memory: each replica's requests go through an arena this process owns;
  each rank answers through its own arena. A segment's name is unlinked as soon
  as every process that needs it has mapped it, and stale names of dead runs are
  swept at start, so even ``kill -9`` of the whole tree leaves /dev/shm clean.
- Results that arrived through shared memory are views: the rank's block is
  freed when the last tensor viewing it is garbage-collected.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgpack
import zmq

from runtime.transport import wire
from runtime.core.config import EngineArgs, WorkerSupervisorConfig, dtype_name
from runtime.core.errors import EngineUnavailableError, ProtocolError, RemoteError, WorkerStartupError
from runtime.core.futures import resolve
from runtime.transport.shm import ShmArena, ShmMapper, new_run_id, sweep_creators, sweep_run, sweep_stale
from runtime.transport.spin import budget_ns, usable_cores
from runtime.transport.wake_pipe import WakePipe
from supervisor.groups import (GroupState, LockedArena, PendingRequest, RankState, ReapedProcess, ResultMapper,
                              free_blocks)
from supervisor.processes import (TERM_GRACE_S, SpawnThread, check_port_free, describe_exit, run_module_main, stop_ranks,
                                  sweep_run_dirs)

log = logging.getLogger("phyrt.supervisor")

#: request and result arenas start this large (pre-faulted) and grow on demand
ARENA_BYTES = 8 << 20
#: the rank process's entry point, ``main(boot: bytes)``, by module path: the supervisor does not import it
WORKER_MODULE = "workers.main"
_WORKER_TYPES = frozenset({"ready", "startup_error", "done"})
#: how long a submit waits for a rank's inbox to be connected (it is, from "ready" on,
#: unless the rank died) before the group fails
INBOX_GRACE_S = 2.0
#: how long a rank's error that reads like a lost peer waits for a peer's death to show
PEER_DEATH_GRACE_S = 0.2
#: how long releasing a stopped rank waits for its exit code to show (see _release)
EXIT_CODE_WAIT_S = 1.0
# plain ints: ``getsockopt(EVENTS) & zmq.POLLOUT`` would build an enum member on every call
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_PEER_LOSS = re.compile(r"connection (?:reset|closed|refused|aborted)|by peer|broken pipe|econnreset|epipe"
                        r"|remote process|gloo|nccl|socket|timed? ?out", re.IGNORECASE)


class WorkerSupervisor:
    """Owns the rank processes, the run directory, the sockets and the arenas."""

    def __init__(self, args: EngineArgs, plugin_spec: str, placement: list[tuple[int, ...]],
                 config: WorkerSupervisorConfig, target: str,
                 on_group_failed: Callable[[int, str], None]) -> None:
        self.config = config
        self._args = args
        self._on_group_failed = on_group_failed
        self._ids = itertools.count()
        self._closed = False
        self._submit_lock = threading.Lock()
        # Process objects: a reaper closes them once reaped (RankState.closed); no use of one
        # may overlap that (sentinels are waited on as duplicates)
        self._process_lock = threading.Lock()
        self._reapers: list[threading.Thread] = []
        self._startup = threading.Event()
        self._startup_error: BaseException | None = None
        sweep_stale()  # segments of runs whose processes were all killed
        sweep_run_dirs()
        self.run_id = new_run_id()
        # mode 0700; the pid in the name lets a later start remove it if this process is SIGKILLed
        self.run_dir = tempfile.mkdtemp(prefix=f"phyrt-{self.run_id}-{os.getpid()}-")
        self.address = f"ipc://{self.run_dir}/ctl"
        self._mapper = ShmMapper(self.run_id)
        self._unlinked: set[str] = set()  # result segments whose names are already gone
        self._wake_at = 0.0  # when the I/O thread next wakes by itself (monotonic)
        # I/O thread only: results to hand to their futures once this loop iteration's
        # bookkeeping is done, just before it polls (see _io_loop)
        self._ready: list[tuple[Future, Any]] = []
        self._finished: list[tuple[GroupState, PendingRequest]] = []  # every rank answered
        self._io_ident: int | None = None
        self._others_due = False  # the last message taken was an answer that others' answers follow
        # the thread that reads the ctl ROUTER (a caller's or the I/O thread's ident), under _submit_lock
        self._reader: int | None = None
        self._reader_left = threading.Condition(self._submit_lock)
        self._reading = threading.local()  # .depth: how deeply this thread is inside lead()
        self._reader_pipe = WakePipe()  # wakes a caller that reads (a failure, close)
        self._spin_s = 0.0  # the reading caller's poll before sleeping (runtime.transport.spin); set once the ranks are counted
        # identity -> (group, rank): each rank's ctl DEALER and its heartbeat DEALER
        self._peers: dict[bytes, tuple[GroupState, RankState]] = {}
        self._beats: dict[bytes, RankState] = {}
        self._ctx = zmq.Context(1)
        self._groups: list[GroupState] = []
        # ranks die with the thread that forked them (PR_SET_PDEATHSIG): one that outlives them
        self._spawner = SpawnThread(f"phyrt-spawn-{self.run_id}")
        success = False
        try:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.bind(self.address)
            self._hb = self._ctx.socket(zmq.ROUTER)
            self._hb.setsockopt(zmq.LINGER, 0)
            self._hb.bind(f"ipc://{self.run_dir}/hb")
            # no high-water marks on the inproc pair: a caller holding _submit_lock must
            # never block on a full queue while the I/O thread waits for that lock
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._pull.setsockopt(zmq.RCVHWM, 0)
            self._pull.bind(f"inproc://phyrt-{self.run_id}")
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._push.connect(f"inproc://phyrt-{self.run_id}")
            self._spawn(plugin_spec, placement, target)
            self._thread = threading.Thread(target=self._io_loop, name="phyrt-supervisor", daemon=True)
            self._thread.start()
            self._wait_ready()
            success = True
        finally:
            if not success:
                self.close()

    # -- start ---------------------------------------------------------------------

    def _spawn(self, plugin_spec: str, placement: list[tuple[int, ...]], target: str) -> None:
        # CUDA tensors cross as CUDA-IPC handles; only ranks we spawned are trusted to send them
        self._cuda = target == "cuda"
        ranks_per_replica = len(placement[0])
        if ranks_per_replica > 1:
            for i in range(len(placement)):
                check_port_free(self.config.base_port + i, i)
        total = sum(len(p) for p in placement)
        spare_core = total < usable_cores()
        self._spin_s = budget_ns("caller") / 1e9 if spare_core else 0.0
        # a rank looks for the next request a moment after answering one (see runtime.transport.spin)
        self.worker_spin_ns = budget_ns("worker") if spare_core else 0
        # the engine process needs a core's share too (it encodes and copies tensors)
        threads = max(1, (os.cpu_count() or 1) // (total + 1))
        device_cfg = self._args.config.device
        mp = multiprocessing.get_context("spawn")
        for replica, devices in enumerate(placement):
            arena = ShmArena(self.run_id, ARENA_BYTES)
            group = GroupState(replica, [], arena)
            self._groups.append(group)
            for rank, device in enumerate(devices):
                inbox = self._ctx.socket(zmq.PUSH)
                inbox.setsockopt(zmq.LINGER, 0)
                inbox.setsockopt(zmq.SNDHWM, 0)  # never drop, never block: HWM 0 is unbounded
                inbox_address = f"ipc://{self.run_dir}/in-{replica}-{rank}"
                inbox.bind(inbox_address)
                group.inboxes.append(inbox)
                boot = msgpack.packb({
                    "run_id": self.run_id, "address": self.address, "inbox": inbox_address,
                    "heartbeats": f"ipc://{self.run_dir}/hb",
                    "replica": replica, "rank": rank,
                    "world_size": ranks_per_replica, "device": device, "target": target,
                    "params_dtype": dtype_name(device_cfg.params_dtype),
                    "parallel": self._args.config.parallel.to_dict(), "plugin": plugin_spec,
                    "plugin_args": self._args.plugin_args, "port": self.config.base_port + replica,
                    "threads": threads, "heartbeat_interval_s": self.config.heartbeat_interval_s,
                    "startup_timeout_s": self.config.startup_timeout_s, "arena_bytes": ARENA_BYTES,
                    "premap": arena.segments, "spin_ns": self.worker_spin_ns,
                }, use_bin_type=True)
                process = mp.Process(target=run_module_main, args=(WORKER_MODULE, boot), name=f"phyrt-r{replica}-{rank}",
                                     daemon=True)
                self._spawner.call(process.start)
                decoder = wire.TensorDecoder(mapper=ResultMapper(self._mapper, group, rank),
                                             allow_cuda_ipc=self._cuda)
                state = RankState(replica, rank, device, process, decoder=decoder)
                group.ranks.append(state)
                self._peers[f"c-{replica}-{rank}".encode()] = (group, state)
                self._beats[f"h-{replica}-{rank}".encode()] = state

    def _wait_ready(self) -> None:
        if not self._startup.wait(self.config.startup_timeout_s + 5.0):
            raise WorkerStartupError("the supervisor's I/O thread did not finish the start")
        if self._startup_error is not None:
            raise self._startup_error

    # -- submission (caller threads) -----------------------------------------------

    def new_future(self) -> "LedFuture":
        """A future whose ``result()`` and ``exception()`` read the answers themselves when no
        other thread does (see the module docstring)."""
        return LedFuture(self)

    def submit(self, replica: int, request: Any, future: Future, lead: bool = False) -> None:
        """Send ``request`` to every rank of ``replica``; ``future`` gets the output rank's answer.

        ``lead``: the caller waits on ``future`` next (``Engine.step``): it is given the reader
        role if free, so that no other thread needs waking.
        """
        group = self._groups[replica]
        if group.failed is not None:
            raise EngineUnavailableError(f"replica {replica} is not serving: {group.failed}")
        request_id = next(self._ids)
        try:  # an idle encoder of this group; each concurrent caller makes one the first time
            allocator, encoder = group.encoders.pop()
        except IndexError:
            allocator = LockedArena(group)
            encoder = wire.TensorEncoder(allocator=allocator)
        try:
            payload = wire.pack_message("request", request_id, payload=request, tensor_encoder=encoder)
        except Exception:
            if group.failed is None:
                raise
            # the group failed meanwhile and its arena is closed (pack_message freed what it placed)
            raise EngineUnavailableError(f"replica {replica} is not serving: {group.failed}") from None
        finally:
            placed, allocator.placed = allocator.placed, []
            group.encoders.append((allocator, encoder))
        timeout = self.config.execution_timeout_s
        pending = PendingRequest(future, None if timeout is None else time.monotonic() + timeout, placed)
        inboxes = group.inboxes
        give_up = None
        while True:
            with self._submit_lock:
                if self._closed or group.failed is not None:
                    free_blocks(group, placed)
                    raise EngineUnavailableError(f"replica {replica} is not serving: {group.failed or 'closed'}")
                # all or nothing: a PUSH without a peer blocks (or, NOBLOCK, raises zmq.Again); a
                # single inbox needs no check, as its NOBLOCK send goes out whole or not at all
                if len(inboxes) == 1:
                    unreachable = []
                else:
                    unreachable = [i for i, inbox in enumerate(inboxes)
                                   if not inbox.getsockopt(zmq.EVENTS) & _POLLOUT]
                if not unreachable:
                    group.pending[request_id] = pending
                    for i, inbox in enumerate(inboxes):
                        try:
                            inbox.send(payload, _NOBLOCK, copy=False)
                        except zmq.Again:  # its peer went (since the check): the rank just died
                            unreachable = [i]
                            break
                    else:
                        wake = pending.deadline is not None and pending.deadline < self._wake_at
                        if self._reader is None:
                            if lead:
                                self._reader = threading.get_ident()  # reserved: result() reads next
                            else:
                                wake = True  # the I/O thread reads the answers
                        if wake:  # (or it plans to sleep past this deadline)
                            self._push.send(b"wake")
                        return
                    if len(inboxes) == 1:
                        # nothing went out: as if the check had found the inbox unreachable
                        del group.pending[request_id]
                        sent = False
                    else:
                        # sent to some ranks only: the group fails below, and with it this request
                        # (still pending, so that a surviving rank's answer is not "unknown")
                        sent = True
                else:
                    sent = False
            # outside the lock: the I/O thread may need it to fail this group meanwhile
            if give_up is None:
                give_up = time.monotonic() + INBOX_GRACE_S
            wait_s = max(0.0, give_up - time.monotonic())
            # sent to some: a peer was dropped, its rank is dying; else it may still be connecting
            reason = self._dead_rank([group.ranks[i] for i in unreachable], wait_s if sent else min(wait_s, 0.05))
            if reason is None and not sent and wait_s > 0:
                continue
            if reason is None:
                reason = f"rank {unreachable[0]} stopped taking requests (its inbox has no connection)"
            # futures are failed off this thread: the caller may hold locks their callbacks take
            self._fail_group(group, reason, defer=True)
            if sent:
                return  # the future is pending in the failed group: the reaper fails it
            free_blocks(group, placed)
            raise EngineUnavailableError(f"replica {replica} is not serving: {group.failed or reason}")

    # -- reading the answers (the reader: a waiting caller, or the I/O thread) -------

    def lead(self, future: Future, timeout: float | None) -> None:
        """Read answers until ``future`` is done or ``timeout`` passed, if this thread gets the
        reader role (free, or reserved by its submit); return at once otherwise (the reader
        completes the future; the caller waits on it)."""
        me = threading.get_ident()
        depth = getattr(self._reading, "depth", 0)
        with self._submit_lock:
            if self._reader is None and not self._closed and not future.done():
                self._reader = me
            if self._reader != me:  # (or reserved by our submit: taken, and given up, below)
                return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._reading.depth = depth + 1
        try:
            self._read_until(future, deadline)
        finally:
            self._reading.depth = depth
            if depth == 0:  # a callback that waited on another future inside our reading keeps it
                self._leave_reader()

    def _read_until(self, future: Future, deadline: float | None) -> None:
        router = self._router
        items = [(router, _POLLIN), (self._reader_pipe.fd, _POLLIN)]
        wait_ms = int(self.config.heartbeat_interval_s * 1000) + 1
        while not future.done() and not self._closed:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait_ms = min(wait_ms, int(left * 1000) + 1)
            if self._spin_s:  # a core to spare: look for the answer a moment before sleeping
                spin_until = time.perf_counter() + self._spin_s
                while not zmq.zmq_poll(items, 0) and time.perf_counter() < spin_until:
                    pass  # (zmq_poll releases the GIL each time)
            for item, _ in zmq.zmq_poll(items, wait_ms):
                if item is router:
                    self._recv_router()
                    while self._others_due and router.getsockopt(zmq.EVENTS) & _POLLIN:
                        self._recv_router()
                else:
                    self._reader_pipe.drain()
            if self._frees_waiting():
                self._send_frees()
            if self._ready or self._finished:
                self._resolve_ready()

    def _leave_reader(self) -> None:
        with self._submit_lock:
            if self._reader != threading.get_ident():
                return
            self._reader = None
            self._reader_left.notify_all()
            if self._awaiting() and not self._closed:
                # answers still due (another caller's, or a rank's after the output rank's)
                self._push.send(b"wake")

    def _awaiting(self) -> bool:
        """Under ``_submit_lock``: whether answers are due on the ctl ROUTER."""
        if not self._startup.is_set():
            return True
        return any(g.pending for g in self._groups if g.failed is None)

    def _frees_waiting(self) -> bool:
        return any(g.frees for g in self._groups)

    # -- the I/O thread ------------------------------------------------------------

    def _io_loop(self) -> None:
        # One iteration: take the reader role if answers are due and no caller reads; poll;
        # heartbeats, wake-ups, exited ranks and, as the reader, one ROUTER message (the poll
        # is level-triggered: the next one returns at once while more are queued); then the
        # bookkeeping; the futures of the results that came in are completed last, so that a
        # caller woken by one finds this thread about to release the GIL in the next poll.
        self._io_ident = me = threading.get_ident()
        router, hb, pull = self._router, self._hb, self._pull
        sentinel_items: list[tuple[Any, int]] = []
        sentinels: dict[int, RankState] = {}
        started = time.monotonic()
        next_check = started
        reading = False
        try:
            # duplicates: a reaper closes a rank's Process (its sentinel) on its own schedule
            for group in self._groups:
                for r in group.ranks:
                    fd = os.dup(r.process.sentinel)
                    sentinels[fd] = r
                    sentinel_items.append((fd, _POLLIN))
            while True:
                now = time.monotonic()
                if now >= next_check:
                    self._check_deadlines(started)
                    next_check = now + self.config.heartbeat_interval_s / 2
                    self._wake_at = min(next_check, self._next_deadline())
                with self._submit_lock:
                    if self._reader is None and self._awaiting() and not self._closed:
                        self._reader = me
                    reading = self._reader == me
                items = [(hb, _POLLIN), (pull, _POLLIN), *sentinel_items]
                if reading:
                    items.append((router, _POLLIN))
                for item, _ in zmq.zmq_poll(items, max(0, int((self._wake_at - now) * 1000) + 1)):
                    if item is router:
                        self._recv_router()
                        # the output rank answered before the others: take their answers that are
                        # in already first, rather than while the woken caller waits for the GIL
                        while self._others_due and router.getsockopt(zmq.EVENTS) & _POLLIN:
                            self._recv_router()
                    elif item is hb:
                        self._recv_beats()
                    elif item is pull:
                        if not self._drain_inbox():
                            return
                        next_check = 0.0  # woken for an earlier deadline: plan again
                    else:
                        r = sentinels.pop(item)
                        sentinel_items.remove((item, _POLLIN))
                        os.close(item)
                        self._rank_exited(r)
                if time.monotonic() >= self._wake_at:
                    next_check = 0.0  # a request deadline is due: check now
                if self._frees_waiting():
                    self._send_frees_as_reader(reading)
                if reading and (self._ready or self._finished):
                    self._resolve_ready()
                if reading:
                    with self._submit_lock:
                        if not self._awaiting():
                            self._reader = None
                            self._reader_left.notify_all()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("supervisor I/O thread failed")
            for group in self._groups:
                self._fail_group(group, f"the supervisor's I/O thread failed: {exc!r}")
            self._finish_startup(WorkerStartupError(f"the supervisor's I/O thread failed: {exc!r}"))
        finally:
            self._resolve_ready()  # answers that came in before a close
            with self._submit_lock:
                if self._reader == me:
                    self._reader = None
                    self._reader_left.notify_all()
            for fd in sentinels:
                os.close(fd)

    def _send_frees_as_reader(self, reading: bool) -> None:
        """Give result blocks back to their ranks, taking the reader role for it if it is free
        (a caller reading sends them itself)."""
        if not reading:
            with self._submit_lock:
                if self._reader is not None or self._closed:
                    return
                self._reader = self._io_ident
        try:
            self._send_frees()
        finally:
            if not reading:
                with self._submit_lock:
                    self._reader = None
                    self._reader_left.notify_all()

    def _resolve_ready(self) -> None:
        """Complete the futures of the answers taken, then free the blocks of the requests
        that every rank answered."""
        ready, self._ready = self._ready, []
        for future, result in ready:
            resolve(future, result=result)
        finished, self._finished = self._finished, []
        for group, pending in finished:
            # taken even when the request placed nothing: uncontended it costs next to nothing
            # (and test_kill_matrix stalls this thread through it, to open a race on purpose)
            with group.arena_lock:
                if pending.blocks:
                    for segment, offset in pending.blocks:
                        group.arena.free(segment, offset)
                    for segment in {s for s, _ in pending.blocks} & set(group.arena.segments):
                        group.arena.unlink(segment)  # every rank has mapped it by now

    def _next_deadline(self) -> float:
        deadlines = [p.deadline for g in self._groups if g.failed is None
                     for p in list(g.pending.values()) if p.deadline is not None]
        return min(deadlines, default=float("inf"))

    def _recv_router(self) -> None:
        """Take one message off the ROUTER (there is one: the poll said so)."""
        router = self._router
        self._others_due = False
        identity = router.recv()  # a ROUTER puts the sender's identity first, always
        payload = last = router.recv(copy=False)  # a Frame knows whether more follow
        count = 1
        while last.more:  # the rest of a malformed message
            last = router.recv(copy=False)
            count += 1
        peer = self._peers.get(identity)
        if peer is None:
            log.warning("message from an unknown peer %r dropped", identity)
            return
        group, r = peer
        r.last_beat = time.monotonic()
        if group.failed is not None:
            return
        if count != 1:
            self._fail_group(group, f"rank {r.rank} sent a malformed message: {count} frames, not 1")
            return
        try:
            msg = wire.unpack_message(payload.buffer, expected_types=_WORKER_TYPES, tensor_decoder=r.decoder)
            if msg["type"] == "done":  # the common case, a call less
                self._request_done(group, r, msg)
            else:
                self._handle(group, r, msg)
        except (ProtocolError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # well-formed msgpack with fields of the wrong shape is just as malformed
            self._fail_group(group, f"rank {r.rank} sent a malformed message: {type(exc).__name__}: {exc}", exc)
        if len(self._mapper.segments) != len(self._unlinked):
            self._unlink_mapped()

    def _recv_beats(self) -> None:
        """Take every heartbeat queued on the hb ROUTER (I/O thread)."""
        hb = self._hb
        while hb.getsockopt(zmq.EVENTS) & _POLLIN:
            identity = hb.recv()
            count = 0
            more = True
            while more:
                more = hb.recv(copy=False).more
                count += 1
            r = self._beats.get(identity)
            if r is None:
                log.warning("heartbeat from an unknown peer %r dropped", identity)
                continue
            r.last_beat = time.monotonic()
            group = self._groups[r.replica]
            if count != 1 and group.failed is None:
                self._fail_group(group, f"rank {r.rank} sent a malformed heartbeat: {count} frames, not 1")

    def _handle(self, group: GroupState, r: RankState, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "ready":
            segments = msg.get("segments")
            if not isinstance(segments, list) or not all(isinstance(x, str) for x in segments):
                raise ProtocolError(f"'ready' needs a list of segment names, got {segments!r}")
            for segment in segments:
                self._mapper.view(segment, 0, 0)  # map now, so that the name can go at once
            self._unlink_mapped()
            r.ready = True
            r.last_beat = time.monotonic()  # heartbeats are enforced from here on
            if all(x.ready for g in self._groups for x in g.ranks):
                for g in self._groups:
                    with g.arena_lock:
                        g.arena.unlink_all()  # every rank mapped the first segment at start
                self._finish_startup(None)
        elif kind == "startup_error":
            cause = RemoteError(str(msg.get("error_type")), str(msg.get("message")), str(msg.get("traceback", "")))
            reason = f"rank {r.rank} failed to start: {cause.remote_type}: {cause.remote_message}"
            self._fail_group(group, reason, cause)
        elif kind == "done":
            self._request_done(group, r, msg)

    def _request_done(self, group: GroupState, r: RankState, msg: dict[str, Any]) -> None:
        pending = group.pending.get(msg["id"])
        if pending is None:
            raise ProtocolError(f"answer to unknown request {msg['id']!r}")
        if not msg.get("ok"):
            cause = RemoteError(str(msg.get("error_type")), str(msg.get("message")), str(msg.get("traceback", "")))
            raised = f"rank {r.rank} raised {cause.remote_type}: {cause.remote_message} (request {msg['id']})"
            # a peer that died (inside a collective, say) is to blame, not the rank that lost it;
            # this thread may see the survivor's error before the dead rank's sentinel
            grace = PEER_DEATH_GRACE_S if _PEER_LOSS.search(f"{cause.remote_type}: {cause.remote_message}") else 0.0
            dead = self._dead_rank([x for x in group.ranks if x is not r], grace)
            if dead is not None:
                log.info("replica %d: %s, after its peer's death", group.index, raised)
                self._fail_group(group, dead)
            else:
                self._fail_group(group, raised, cause)
            return
        if r.rank == 0:
            # completed at the end of this loop iteration, before anything fails this group
            self._ready.append((pending.future, msg.get("result")))
        pending.ranks_done.add(r.rank)
        if len(pending.ranks_done) == len(group.ranks):
            del group.pending[msg["id"]]
            self._finished.append((group, pending))  # its blocks go back right after that
        else:
            self._others_due = 0 in pending.ranks_done  # its caller is about to be woken

    def _drain_inbox(self) -> bool:
        """Consume wake-ups; False when asked to close."""
        while self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if self._pull.recv() == b"close":
                return False
        return True

    def _rank_exited(self, r: RankState) -> None:
        group = self._groups[r.replica]
        if group.failed is None:
            self._fail_group(group, self._dead_rank([r]) or f"rank {r.rank} exited")

    def _dead_rank(self, ranks: list[RankState], wait_s: float = 0.0) -> str | None:
        """"rank K <how it exited>" for one of ``ranks`` whose process has exited (one killed
        by a signal first, then the lowest), waiting up to ``wait_s`` for one to; else None."""
        live: dict[int, RankState] = {}
        try:
            with self._process_lock:  # a reaped rank's process is a ReapedProcess, described all the same
                exits = [(r.rank, describe_exit(r.process)) for r in ranks if r.closed]
                # waited on without the lock: duplicates, as a reaper may close a Process meanwhile
                for r in ranks:
                    if not r.closed:
                        live[os.dup(r.process.sentinel)] = r
            ready = multiprocessing.connection.wait(list(live), 0.0 if exits else wait_s) if live else []
        finally:
            for fd in live:
                os.close(fd)
        if ready:
            with self._process_lock:
                exits += [(live[fd].rank, describe_exit(live[fd].process)) for fd in ready]
        if not exits:
            return None
        rank, how = min(exits, key=lambda e: ("signal" not in e[1], e[0]))
        return f"rank {rank} {how}"

    def _check_deadlines(self, started: float) -> None:
        now = time.monotonic()
        hb_timeout = self.config.heartbeat_timeout_s
        for group in self._groups:
            if group.failed is not None:
                continue
            for r in group.ranks:
                # a starting rank may hold the GIL in its build: startup_timeout_s covers it
                if r.ready and now - r.last_beat > hb_timeout:
                    self._fail_group(group, f"rank {r.rank} sent no heartbeat for {now - r.last_beat:.1f} s "
                                            f"(heartbeat_timeout_s={hb_timeout})")
                    break
            if group.failed is not None:
                continue
            for request_id, p in list(group.pending.items()):
                if p.deadline is not None and now > p.deadline:
                    self._fail_group(group, f"execution timeout {self.config.execution_timeout_s} s after "
                                            f"submission (request {request_id})")
                    break
        if not self._startup.is_set() and now - started > self.config.startup_timeout_s:
            slow = [f"replica {g.index} rank {r.rank}" for g in self._groups for r in g.ranks if not r.ready]
            self._finish_startup(WorkerStartupError(
                f"not ready within startup_timeout_s={self.config.startup_timeout_s}: {', '.join(slow)}"))

    def _send_frees(self) -> None:
        for group in self._groups:
            if not group.frees:
                continue
            blocks: dict[int, list] = collections.defaultdict(list)
            while group.frees:
                rank, segment, offset = group.frees.popleft()
                blocks[rank].append([segment, offset])
            if group.failed is not None:
                continue
            for rank, items in blocks.items():
                try:
                    self._router.send_multipart([f"c-{group.index}-{rank}".encode(),
                                                 wire.pack_message("free", 0, blocks=items)])
                except zmq.ZMQError:
                    pass  # the rank is gone; its arena went with it

    def _unlink_mapped(self) -> None:
        for segment in self._mapper.segments:
            if segment not in self._unlinked:
                self._unlinked.add(segment)
                try:
                    os.unlink(os.path.join("/dev/shm", segment))
                except FileNotFoundError:
                    pass

    # -- failure -------------------------------------------------------------------

    def _fail_group(self, group: GroupState, reason: str, cause: BaseException | None = None, *,
                    defer: bool = False) -> None:
        """Fail ``group`` (once). ``defer``: its futures are failed by the reaper thread, not here."""
        if (self._ready or self._finished) and threading.get_ident() == self._reader:
            self._resolve_ready()  # answers that came in first win, as they would have unbatched
        with self._submit_lock:  # so that no submit slips in between the flag and the swap
            if group.failed is not None:
                return
            group.failed = reason
            pending, group.pending = group.pending, {}
        message = f"replica {group.index} failed: {reason}"
        log.error(message)
        self._on_group_failed(group.index, reason)
        with group.arena_lock:
            # no rank will read a request of this group again: its names (a growth segment
            # of a request in flight included) go now, and unused mappings with them
            group.arena.close()
        if not defer:
            _fail_futures(pending, message, cause)
            pending = {}
            self._reader_pipe.wake()  # a caller reading finds its future failed
        with self._process_lock:
            ranks = [r for r in group.ranks if not r.claimed]
            for r in ranks:
                r.claimed = True
            reaper = threading.Thread(target=self._reap, args=(ranks, pending, message, cause),
                                      name=f"phyrt-reaper-{group.index}", daemon=True)
            reaper.start()
            self._reapers.append(reaper)
        if not self._startup.is_set():
            error = WorkerStartupError(f"replica {group.index} failed to start: {reason}")
            error.__cause__ = cause
            self._finish_startup(error)

    def _reap(self, ranks: list[RankState], pending: dict[int, PendingRequest], message: str,
              cause: BaseException | None) -> None:
        try:
            _fail_futures(pending, message, cause)
            self._reader_pipe.wake()
        finally:  # whatever happens above, the ranks are stopped and their Process objects closed
            try:
                stop_ranks([r.process for r in ranks])
            finally:
                self._release(ranks)

    def _release(self, ranks: list[RankState]) -> None:
        """Close the Process objects of stopped ranks (their pipes) and sweep the /dev/shm names
        they left (a result arena grown and not yet unlinked, say).

        A rank's exit code may not show at once even though ``stop_ranks`` saw it die: when two
        threads poll the same ``Process`` (``Process.start`` in any thread polls every child of
        this process first; ``_dead_rank`` joins ranks too), the one whose ``waitpid`` reaps it
        stores the code a moment later, and the other's ``waitpid`` meanwhile fails (ECHILD),
        which multiprocessing reads as "still running". So wait for it (bounded: the reaping
        thread needs only the GIL); a rank reaped by a wait outside multiprocessing (its exit
        status is lost) has its pipes released all the same; only one that still runs after
        SIGKILL keeps them.
        """
        dead: list[int] = []
        waiting = list(ranks)
        deadline = time.monotonic() + EXIT_CODE_WAIT_S
        while True:
            with self._process_lock:
                for r in waiting:
                    if not r.closed and r.process.exitcode is not None:
                        dead.append(_close_rank_process(r, r.process.exitcode))
                waiting = [r for r in waiting if not r.closed]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # (without the GIL: the thread that reaped one stores its code meanwhile)
        with self._process_lock:
            for r in waiting:
                if r.closed:
                    continue
                if _reaped_elsewhere(r.process.pid):
                    log.warning("replica %d rank %d (pid %d) was reaped by a wait outside multiprocessing: "
                                "its exit status is lost; its pipes are released", r.replica, r.rank, r.process.pid)
                    dead.append(_close_rank_process(r, None))
                else:
                    log.error("replica %d rank %d (pid %d) still runs after SIGKILL: its Process keeps its pipes",
                              r.replica, r.rank, r.process.pid)
        if dead:
            sweep_creators(self.run_id, dead)

    def _finish_startup(self, error: BaseException | None) -> None:
        if not self._startup.is_set():
            self._startup_error = error
            self._startup.set()

    # -- shutdown ------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending requests, stop every rank, remove the run directory and segments."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            thread = getattr(self, "_thread", None)
            if thread is not None and thread.is_alive():
                self._push.send(b"close")
        self._reader_pipe.wake()
        if thread is not None:
            thread.join(10)
        me = threading.get_ident()
        with self._submit_lock:  # a caller reading stops at once (woken above): the ROUTER is ours then
            if not self._reader_left.wait_for(lambda: self._reader is None or self._reader == me, 10.0):
                log.error("a thread still reads the supervisor's socket at close")
        for group in self._groups:
            with self._submit_lock:  # a caller that found an inbox unreachable may fail a group meanwhile
                pending, group.pending = group.pending, {}
                serving = group.failed is None
                if serving:
                    group.failed = "the engine is closed"
            for p in pending.values():
                resolve(p.future, error=EngineUnavailableError("the engine is closed"))
            if serving:
                for r in group.ranks:
                    try:
                        self._router.send_multipart([f"c-{group.index}-{r.rank}".encode(),
                                                     wire.pack_message("shutdown", 0)])
                    except zmq.ZMQError:
                        pass
        with self._process_lock:  # the ranks of failed groups are their reapers'
            ranks = [r for g in self._groups for r in g.ranks if not r.claimed]
            for r in ranks:
                r.claimed = True
            reapers = list(self._reapers)
        stop_ranks([r.process for r in ranks], polite=True)
        self._release(ranks)
        for reaper in reapers:  # a failed group's ranks are released when its reaper ends
            reaper.join(TERM_GRACE_S + 10.0 + EXIT_CODE_WAIT_S)
            if reaper.is_alive():
                log.error("%s has not finished stopping its ranks at close", reaper.name)
        self._spawner.stop()  # only now: its end SIGKILLs any rank it started
        for group in self._groups:
            group.arena.close()
        self._mapper.close()
        for group in self._groups:
            for inbox in group.inboxes:
                inbox.close(0)
        self._reader_pipe.close()
        for sock in ("_router", "_hb", "_pull", "_push"):
            if hasattr(self, sock):
                getattr(self, sock).close(0)
        self._ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        sweep_run(self.run_id)


def _close_rank_process(r: RankState, exitcode: int | None) -> int:
    """Under ``_process_lock``: close the exited ``r.process`` (its sentinel and its other pipe)
    and put a ``ReapedProcess`` in its place; its pid. ``exitcode`` None: reaped by a wait
    outside multiprocessing, which then never learns the exit code (``Process.close()``
    refuses such a process): its pipes are closed directly, and multiprocessing forgets it,
    lest it wait on the pid once the kernel gives it to another child."""
    process = r.process
    r.process = reaped = ReapedProcess(process.pid, process.name, exitcode)
    if exitcode is not None:
        process.close()
    else:
        popen = process._popen
        if popen is not None:
            popen.close()  # runs its finalizer: closes the sentinel and the other pipe
        multiprocessing.process._children.discard(process)
    r.closed = True
    return reaped.pid


def _reaped_elsewhere(pid: int) -> bool:
    """Whether ``pid`` is no longer a child of this process (it exited and was reaped); a
    zombie stays one (WNOWAIT: nothing is reaped here)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _fail_futures(pending: dict[int, PendingRequest], message: str, cause: BaseException | None) -> None:
    for p in pending.values():
        error = EngineUnavailableError(message)
        error.__cause__ = cause
        resolve(p.future, error=error)


class LedFuture(Future):
    """The future of a local request: waiting on it (``result``, ``exception``) reads the
    answers in the waiting thread when no other thread does (``WorkerSupervisor.lead``)."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        super().__init__()
        self._supervisor = supervisor

    # lead() even when done: the role may be reserved for this thread (its submit said it
    # would wait), and a future failed meanwhile must give the reservation up
    def result(self, timeout: float | None = None) -> Any:
        return super().result(self._lead(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._lead(timeout))

    def _lead(self, timeout: float | None) -> float | None:
        """Read as long as allowed; the time left of ``timeout`` for the plain wait after it."""
        if timeout is None:
            self._supervisor.lead(self, None)
            return None
        deadline = time.monotonic() + timeout
        self._supervisor.lead(self, timeout)
        return max(0.0, deadline - time.monotonic())
