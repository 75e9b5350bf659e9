"""Spawn and boot: start every rank of every replica, and the handshake that ends the start.

    supervisor                                         rank process (workers.main.main(boot))
    create the replica's broadcast ring (runtime.link.broadcast), its name in the boot message
    SpawnThread: Process(spawn).start(boot msgpack) -> prctl(PDEATHSIG), SIGINT ignored, name;
                                                       connect ctl DEALER
                                                       "c-R-r", hb DEALER "h-R-r";
                                                       process group, plugin build, map the ring
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

import multiprocessing
import os
import threading
import time
from typing import Any, Callable

import msgpack

from runtime.core.config import EngineArgs, WorkerSupervisorConfig, dtype_name
from runtime.core.errors import ProtocolError, WorkerStartupError
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import BroadcastWriter
from runtime.transport import wire
from runtime.transport.arena import ShmArena, ShmMapper
from runtime.transport.spin import usable_cores
from supervisor.groups import GroupState, RankState, ResultMapper
from supervisor.processes import SpawnThread, check_port_free, run_module_main

#: request and result arenas start this large (pre-faulted) and grow on demand
ARENA_BYTES = 8 << 20
#: how often a waiting start looks at its cancel event
CANCEL_POLL_S = 0.05
#: the rank process's entry point, ``main(boot: bytes)``, by module path: the supervisor does not import it
WORKER_MODULE = "workers.main"


class Startup:
    """Whether every rank reported ready, or why the start failed."""

    def __init__(self, groups: list[GroupState], mapper: ShmMapper, timeout_s: float,
                 cancel: threading.Event | None = None) -> None:
        self._groups = groups
        self._mapper = mapper
        self._timeout_s = timeout_s
        self._cancel = cancel
        self._event = threading.Event()
        self._error: BaseException | None = None

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

    def rank_ready(self, r: RankState, segments: Any, unlink_mapped: Callable[[], None]) -> None:
        """A rank's "ready": map its result segments now, so that their names can go at once
        (``unlink_mapped``: before the start can end, so that the reader is done with
        system calls, which let the waiting caller run, by then)."""
        if not isinstance(segments, list) or not all(isinstance(x, str) for x in segments):
            raise ProtocolError(f"{rp.READY!r} needs a list of segment names, got {segments!r}")
        for segment in segments:
            self._mapper.view(segment, 0, 0)
        unlink_mapped()
        r.ready = True
        r.last_beat = time.monotonic()  # heartbeats are enforced from here on
        if all(x.ready for g in self._groups for x in g.ranks):
            for g in self._groups:
                with g.arena_lock:
                    g.arena.unlink_all()  # every rank mapped the first segment at start
                g.ring.unlink()  # and the ring
            self.finish(None)

    def check_timeout(self, started: float, now: float) -> None:
        if not self.done and now - started > self._timeout_s:
            slow = [f"replica {g.engine_replica} rank {r.rank}" for g in self._groups for r in g.ranks if not r.ready]
            self.finish(WorkerStartupError(f"not ready within startup_timeout_s={self._timeout_s}: {', '.join(slow)}"))


class Launcher:
    """Starts the ranks of every replica into ``groups`` (from the ``SpawnThread``)."""

    def __init__(self, run_id: str, run_dir: str, mapper: ShmMapper, spawner: SpawnThread) -> None:
        self._run_id, self._run_dir = run_id, run_dir
        self._mapper, self._spawner = mapper, spawner

    def spawn(self, groups: list[GroupState], args: EngineArgs, plugin_spec: str,
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
        }
        # CUDA tensors cross as CUDA-IPC handles; only ranks we spawned are trusted to send them
        cuda = target == "cuda"
        for replica, devices in enumerate(placement):
            group = GroupState(replica, [], ShmArena(self._run_id, ARENA_BYTES), engine_replica=first_replica + replica)
            groups.append(group)  # closed with the supervisor from here on, as its ring
            group.ring = BroadcastWriter(self._run_id, len(devices))
            where = {**common, **self._rendezvous(config, replica, first_replica + replica),
                     "replica_index": first_replica + replica, "ring": group.ring.name,
                     "ring_nonce": group.ring.nonce}
            for rank, device in enumerate(devices):
                self._spawn_rank(group, rank, device, where, cuda)

    def _rendezvous(self, config: WorkerSupervisorConfig, replica: int, engine_replica: int) -> dict[str, Any]:
        """Where ``replica``'s ranks meet: "port" (pinned base_port) or "store" (a file path)."""
        if config.base_port is not None:
            return {"port": config.base_port + engine_replica, "store": None}
        return {"port": None, "store": os.path.join(self._run_dir, f"store-{replica}")}

    def _spawn_rank(self, group: GroupState, rank: int, device: int, common: dict[str, Any], cuda: bool) -> None:
        replica = group.index
        boot = msgpack.packb({**common, "replica": replica, "rank": rank, "device": device,
                              "premap": group.arena.segments}, use_bin_type=True)
        decoder = wire.TensorDecoder(mapper=ResultMapper(self._mapper, group, rank), allow_cuda_ipc=cuda)
        process = multiprocessing.get_context("spawn").Process(
            target=run_module_main, args=(WORKER_MODULE, boot), name=f"phyrt-r{common['replica_index']}-{rank}",
            daemon=True)
        self._spawner.call(process.start)
        group.ranks.append(RankState(replica, rank, device, process, decoder=decoder))  # its reaper's from here
