"""Spawn and boot: start every rank of every replica, and the handshake that ends the start.

    supervisor                                         rank process (workers.main.main(boot))
    create the replica's broadcast ring (runtime.link.broadcast), its name in the boot message;
    in its segment the answer lane's ring, whose pipe rank 0 opens (runtime.link.lane)
    link thread: Process(spawn).start(boot msgpack) -> prctl(PDEATHSIG), SIGINT ignored, name;
                                                       connect ctl DEALER
                                                       "c-R-r", hb DEALER "h-R-r";
                                                       process group, plugin build, map the ring
                                                       (rank 0: open the answer lane's pipe)
    ctl ROUTER (the reader) <------------------------ READY {segments} | STARTUP_ERROR {error}
                                                       (runtime.link.rank_protocol)
    Startup.rank_ready: map the rank's result segments (so that their names can go at once);
    once every rank is ready, unlink the request arenas' first segments and the rings; wait() returns

Rendezvous of a replica's ranks (more than one): with ``base_port`` None, a torch
FileStore on ``RUN/store-R``, a fresh file in this supervisor's private run directory
(removed with it, whatever happened to the ranks), so engines never compete for a port;
with an int, rank 0 listens on ``127.0.0.1:base_port + R``, checked free before any spawn.

Invariants:
- A started process is in its group's ``ranks`` before anything else can fail (it is
  appended right after ``start``), so the group's reaper owns it whatever happens next.
- The start ends exactly once (``finish``): every rank ready, or the first failure (a
  rank's startup_error, an exited rank, ``startup_timeout_s``), naming replica and rank.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any, Callable

import msgpack

from runtime.core.config import EngineArgs, WorkerSupervisorConfig, dtype_name
from runtime.core.errors import ProtocolError, WorkerStartupError
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import BroadcastWriter
from runtime.link.lane import ANSWERS_BYTES, AnswerReader
from runtime.link.lane import available as lanes_available
from runtime.transport import wire
from runtime.transport.arena import ShmArena, ShmMapper
from runtime.transport.shm_names import unlink_quiet
from runtime.transport.spin import usable_cores
from supervisor.processes import RankState, run_module_main, start_rank
from supervisor.replica import Replica, ResultMapper

log = logging.getLogger("phyrt.supervisor")

#: request and result arenas start this large (pre-faulted) and grow on demand
ARENA_BYTES = 8 << 20
#: how often a waiting start looks at its cancel event
CANCEL_POLL_S = 0.05
#: the rank process's entry point, ``main(boot: bytes)``, by module path: the supervisor does not import it
WORKER_MODULE = "workers.main"


class Startup:
    """Whether every rank reported ready, or why the start failed."""

    def __init__(self, replicas: tuple[Replica, ...], mapper: ShmMapper, timeout_s: float,
                 cancel: threading.Event | None = None) -> None:
        self._groups = replicas
        self._mapper = mapper
        self._timeout_s = timeout_s
        self._cancel = cancel
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._unlinked: set[str] = set()  # result segments whose names are gone already

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def finish(self, error: BaseException | None) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def wait(self) -> None:
        """Until every rank is ready; raise the start's failure (or, once ``cancel`` is set,
        ``WorkerStartupError`` within ``CANCEL_POLL_S``)."""
        end = time.monotonic() + self._timeout_s + 5.0
        while not self._event.wait(min(CANCEL_POLL_S, max(0.0, end - time.monotonic()))):
            if self._cancel is not None and self._cancel.is_set():
                raise WorkerStartupError("the start was cancelled")
            if time.monotonic() >= end:
                raise WorkerStartupError("the supervisor's I/O thread did not finish the start")
        if self._error is not None:
            raise self._error

    def rank_ready(self, r: RankState, segments: Any) -> None:
        """A rank's "ready": map its result segments now, so that their names can go at once
        (before the start can end, so that the reader is done with system calls, which let the
        waiting caller run, by then)."""
        if not isinstance(segments, list) or not all(isinstance(x, str) for x in segments):
            raise ProtocolError(f"{rp.READY!r} needs a list of segment names, got {segments!r}")
        for segment in segments:
            self._mapper.view(segment, 0, 0)
        self.unlink_mapped()
        r.ready = True
        r.last_beat = time.monotonic()  # heartbeats are enforced from here on
        if all(x.ready for g in self._groups for x in g.ranks):
            for g in self._groups:
                with g.arena_lock:
                    g.arena.unlink_all()  # every rank mapped the first segment at start
                g.ring.unlink()  # and the ring
            self.finish(None)

    def unlink_mapped(self) -> None:
        """Unlink the names of the result segments mapped since the last call (the reader's, after
        each message: a rank's result arena grows on demand)."""
        if len(self._mapper.segments) != len(self._unlinked):
            for segment in self._mapper.segments:
                if segment not in self._unlinked:
                    self._unlinked.add(segment)
                    unlink_quiet(segment)

    def check_timeout(self, started: float, now: float) -> None:
        if not self.done and now - started > self._timeout_s:
            slow = [f"replica {g.engine_replica} rank {r.rank}" for g in self._groups for r in g.ranks if not r.ready]
            self.finish(WorkerStartupError(f"not ready within startup_timeout_s={self._timeout_s}: {', '.join(slow)}"))


class Launcher:
    """Starts the ranks of every replica into ``replicas``, each from the thread that outlives them
    (``on_thread``: the supervisor's ``LinkThread.call``; ``processes.start_rank``)."""

    def __init__(self, run_id: str, run_dir: str, mapper: ShmMapper,
                 on_thread: Callable[[Callable[[], Any]], Any], queued: Callable[[Replica, Any], None]) -> None:
        self._run_id, self._run_dir = run_id, run_dir
        self._mapper, self._on_thread, self._queued = mapper, on_thread, queued

    def spawn(self, replicas: list[Replica], args: EngineArgs, plugin_spec: str,
              placement: list[tuple[int, ...]], config: WorkerSupervisorConfig, target: str,
              worker_spin_ns: int, first_replica: int = 0) -> None:
        """Group i serves the engine's replica ``first_replica + i`` (its ranks' replica index,
        name and pinned port); the group keeps the index i inside this supervisor."""
        if len(placement[0]) > 1 and config.base_port is not None:
            for i in range(first_replica, first_replica + len(placement)):
                check_port_free(config.base_port + i, i)
        total = sum(len(p) for p in placement)
        common = {
            "run_id": self._run_id, "address": f"ipc://{self._run_dir}/ctl",
            "heartbeats": f"ipc://{self._run_dir}/hb", "world_size": len(placement[0]), "target": target,
            "params_dtype": dtype_name(args.config.device.params_dtype),
            "parallel": args.config.parallel.to_dict(), "plugin": plugin_spec, "plugin_args": args.plugin_args,
            # the ranks share the cores: the engine process's own work for a request (encoding,
            # copying tensors) comes before and after its ranks compute, so a core kept for it
            # halved a lone rank's compute on 2 cores (bench.compute: 3.25 -> 0.68 memcpys over inline)
            "threads": max(1, usable_cores() // total),
            "heartbeat_interval_s": config.heartbeat_interval_s, "startup_timeout_s": config.startup_timeout_s,
            "arena_bytes": ARENA_BYTES, "spin_ns": worker_spin_ns,
            "max_batch_size": args.config.batching.max_batch_size,
        }
        # CUDA tensors cross as CUDA-IPC handles; only ranks we spawned are trusted to send them
        cuda = target == "cuda"
        for replica, devices in enumerate(placement):
            batching = args.config.batching
            group = Replica(replica, first_replica + replica, ShmArena(self._run_id, ARENA_BYTES),
                            config.execution_timeout_s, (batching.max_batch_size, batching.max_delay_ms / 1000),
                            self._queued)
            replicas.append(group)  # closed with the supervisor from here on, as its ring
            lane = lanes_available()
            group.ring = BroadcastWriter(self._run_id, len(devices), answer_bytes=ANSWERS_BYTES if lane else 0)
            if lane:
                group.answers = AnswerReader(group.ring.answers)
            where = {**common, **self._rendezvous(config, replica, first_replica + replica),
                     "replica_index": first_replica + replica, "ring": group.ring.name,
                     "ring_nonce": group.ring.nonce}
            for rank, device in enumerate(devices):  # the output rank alone spins and answers
                output = {"spin_ns": where["spin_ns"] if rank == 0 else 0,
                          "answers": [os.getpid(), group.answers.writer] if rank == 0 and lane else None}
                self._spawn_rank(group, rank, device, {**where, **output}, cuda)

    def _rendezvous(self, config: WorkerSupervisorConfig, replica: int, engine_replica: int) -> dict[str, Any]:
        """Where ``replica``'s ranks meet: "port" (pinned base_port) or "store" (a file path)."""
        if config.base_port is not None:
            return {"port": config.base_port + engine_replica, "store": None}
        return {"port": None, "store": os.path.join(self._run_dir, f"store-{replica}")}

    def _spawn_rank(self, group: Replica, rank: int, device: int, common: dict[str, Any], cuda: bool) -> None:
        replica = group.index
        boot = msgpack.packb({**common, "replica": replica, "rank": rank, "device": device,
                              "premap": group.arena.segments}, use_bin_type=True)
        decoder = wire.TensorDecoder(mapper=ResultMapper(self._mapper, group, rank), allow_cuda_ipc=cuda)
        process = multiprocessing.get_context("spawn").Process(
            target=run_module_main, args=(WORKER_MODULE, boot), name=f"phyrt-r{common['replica_index']}-{rank}",
            daemon=True)
        self._on_thread(functools.partial(start_rank, process.start))
        group.ranks.append(RankState(replica, rank, device, process, decoder=decoder))  # its reaper's from here


def check_port_free(port: int, replica: int) -> None:
    """Raise ValueError when rank 0 of ``replica`` could not listen on ``port`` (a pinned
    ``base_port``; a free rendezvous needs no port).

    SO_REUSEADDR, as the rank's own listener sets it: connections of a previous engine
    in TIME_WAIT on the port (for a minute after it closed) are no obstacle; a listener is.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ValueError(
                f"rendezvous port {port} of replica {replica} (base_port + {replica}) is taken: {exc}; "
                "pass base_port=None (the default) for a free rendezvous, or set "
                "WorkerSupervisorConfig(base_port=...) to a free range"
            ) from None
