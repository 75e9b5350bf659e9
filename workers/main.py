"""The rank process of a local replica: ``main(bootstrap)`` is its entry point.

    supervisor (engine process)                       this rank
    BroadcastWriter /dev/shm/phyrt-RUN-PID-SEQ ---->  BroadcastReader  main thread: the serve loop
      (requests, batches, cancels, frees, shutdown)     (runtime.link.broadcast; workers.serve_loop)
    ROUTER ipc://RUN_DIR/ctl  <------ DEALER "c-R-r" ---  main thread: ready; done, partial (output rank)
    ROUTER ipc://RUN_DIR/hb   <------ DEALER "h-R-r" ---  heartbeat thread: "hb" every interval
    engine's spawn thread     ------- exits/dies ------>  kernel: SIGKILL (PR_SET_PDEATHSIG)

Start (two-phase): pin the device (cuda: ``torch.cuda.set_device(entry)``, which
composes with CUDA_VISIBLE_DEVICES; cpu: a fair share of threads), join the
replica's process group (NCCL on cuda, gloo on cpu), build the named groups of
``runtime.parallel`` from the ParallelConfig, build the plugin, then send "ready".
Any failure on the way is sent as "startup_error" (type, message, traceback text)
and the process exits.

Rendezvous, on this host only. By default (``base_port`` None) the replica's ranks
share a torch FileStore on a fresh file in the supervisor's private run directory
(boot "store"): nothing listens on a port we chose. With a pinned ``base_port``
(boot "port"), rank 0 binds ``127.0.0.1:base_port + replica`` itself and hands the
listening socket to torch's TCPStore (``master_listen_fd``; given only a port,
TCPStore binds the wildcard address ``::``, whatever host it is told), the other
ranks connect to it. Either way ``GLOO_SOCKET_IFNAME=lo`` keeps gloo's own listeners (its
pairs; on cuda the ``cpu_group``) on loopback too, whatever the host name resolves
to. NCCL keeps its defaults (on one host its data goes through shm/p2p; its
bootstrap sockets follow ``NCCL_SOCKET_IFNAME``).

The heartbeat thread has its own socket (ZMQ sockets are not thread-safe) and
keeps beating while the main thread is inside a forward pass (torch releases the
GIL).

Death of the engine: the rank is started through ``supervisor.processes.run_module_main``,
which arms the kernel's parent-death signal before this module (and torch) is imported;
the mechanism and its fallback are described there. It also sets SIGINT to ignored (the
engine, not the terminal's Ctrl-C, decides when a rank stops) and names the process
``phyrt-r{replica}-{rank}``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import msgpack
import zmq

from runtime.link import rank_protocol as rp
from runtime.link.broadcast import BroadcastReader
from runtime.link.lane import answer_writer
from runtime.transport import wire
from runtime.transport.arena import ShmArena, ShmMapper
from workers.serve_loop import serve


class _Heartbeat:
    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, interval: float) -> None:
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, identity)
        self._socket.connect(address)
        self._interval = interval
        self._parent = os.getppid()  # a change means the engine is gone (see _run)
        #: the output rank's EngineCore once built: its ``info_snapshot`` rides on the beats
        self.core: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phyrt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat, sent = 0, None
        try:
            while not self._stop.is_set():
                if os.getppid() != self._parent:  # where PDEATHSIG is missing: the engine died
                    os._exit(rp.ORPHAN_EXIT)
                info = self.core.info_snapshot if self.core is not None else None
                if info is not None and info is not sent:  # a new snapshot rides on this beat
                    message, sent = wire.pack_message(rp.HB, beat, info=info), info
                else:
                    message = wire.pack_message(rp.HB, beat)
                self._socket.send(message, copy=False)
                beat += 1
                self._stop.wait(self._interval)
        finally:
            self._socket.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def main(bootstrap: bytes) -> None:
    """Entry point of a spawned rank (through ``supervisor.processes.run_module_main``, which has
    armed its death with the engine); ``bootstrap`` is a msgpack map (see supervisor)."""
    boot = msgpack.unpackb(bootstrap, raw=False)
    replica, rank = boot["replica"], boot["rank"]
    ctx = zmq.Context(1)
    ctl = ctx.socket(zmq.DEALER)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.setsockopt(zmq.IDENTITY, f"c-{replica}-{rank}".encode())
    ctl.connect(boot["address"])
    heartbeat = _Heartbeat(ctx, boot["heartbeats"], f"h-{replica}-{rank}".encode(), boot["heartbeat_interval_s"])
    arena = mapper = core = ring = None
    code = 0
    try:
        try:
            core, arena, mapper, ring = _start(boot)
        except BaseException as exc:
            ctl.send(wire.pack_message(rp.STARTUP_ERROR, rank, **rp.error_fields(exc)))
            code = 1
            return
        ctl.send(wire.pack_message(rp.READY, rank, segments=arena.segments if arena is not None else [],
                                   stepped=core.stepped))
        if arena is not None:  # the output rank
            heartbeat.core = core
        serve(ctl, ring, core, arena, decoder=wire.TensorDecoder(mapper=mapper, allow_cuda_ipc=boot["target"] == "cuda"),
              lane=_answer_lane(boot, ring))
    except BaseException:
        traceback.print_exc()  # the supervisor sees the exit; the text goes to the log
        code = 1
    finally:
        heartbeat.stop()
        _shutdown(core, arena, mapper, ring)
        ctl.close(0)
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(boot: dict[str, Any]):
    import torch
    import torch.distributed as dist

    from runtime import parallel as P
    from runtime.core.config import DeviceConfig, EngineConfig, ParallelConfig
    from runtime.core.plugins import resolve_plugin
    from runtime.execution.engine_core import EngineCore, make_context

    parallel = ParallelConfig.from_dict(boot["parallel"])
    config = EngineConfig(device=DeviceConfig(target=boot["target"], params_dtype=boot["params_dtype"]),
                          parallel=parallel)
    rank, world = boot["rank"], boot["world_size"]
    if boot["target"] == "cuda":
        torch.cuda.set_device(boot["device"])
        backend = "nccl"
    else:
        torch.set_num_threads(boot["threads"])
        backend = "gloo"
    if world > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's listeners on loopback (read when a group is made)
        timeout = _timedelta(boot["startup_timeout_s"])
        try:
            store = _rendezvous_store(boot, rank, world, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        except Exception as exc:
            raise RuntimeError(f"rendezvous of replica {boot['replica_index']} {_rendezvous_place(boot)} failed: "
                               f"{exc}") from exc
        P.initialize(parallel, rank, backend=backend, run_id=boot["run_id"])  # shm names the sweeps know
    entry = resolve_plugin(boot["plugin"])()
    entry.configure(boot["plugin_args"])
    ctx = make_context(config, rank=rank, world_size=world, replica_index=boot["replica_index"],
                       device_index=boot["device"])
    core = EngineCore(entry, boot["plugin_args"], ctx, boot["max_batch_size"])
    # only the output rank answers with results: only it needs a result arena
    arena = ShmArena(boot["run_id"], boot["arena_bytes"]) if rank == 0 else None
    mapper = ShmMapper(boot["run_id"])
    for segment in boot["premap"]:  # map the supervisor's first segment now, so its name can go
        mapper.view(segment, 0, 0)
    # mapped before "ready": the supervisor unlinks its name once every rank is ready
    ring = BroadcastReader(boot["run_id"], boot["ring"], rank, boot["ring_nonce"], spin_ns=boot["spin_ns"],
                           mapper=mapper)
    return core, arena, mapper, ring


def _answer_lane(boot: dict[str, Any], ring: BroadcastReader) -> Any:
    """The output rank's end of its replica's answer lane (``runtime.link.lane``), or None: its
    answers then all go by the ctl socket."""
    if not boot["answers"] or ring.answers is None:
        return None
    try:
        return answer_writer(ring.answers, *boot["answers"])
    except OSError as exc:
        print(f"phyrt rank: no answer lane, answers go by ZeroMQ: {exc}", file=sys.stderr)
        return None


def _rendezvous_place(boot: dict[str, Any]) -> str:
    if boot["port"] is None:
        return f"through the file store {boot['store']}"
    return (f"on 127.0.0.1:{boot['port']} (is the port taken? pass base_port=None (the default) "
            "for a free rendezvous, or another WorkerSupervisorConfig.base_port)")


def _rendezvous_store(boot: dict[str, Any], rank: int, world: int, timeout):
    """The replica's store: a FileStore on the supervisor's fresh file, or (a pinned port) a
    TCPStore listening on 127.0.0.1 only (rank 0 serves it)."""
    import torch.distributed as dist

    port = boot["port"]
    if port is None:
        store = dist.FileStore(boot["store"], world)  # the last rank to let go of it removes the file
        store.set_timeout(timeout)
        return store
    if rank != 0:
        _wait_for_listener(port, timeout.total_seconds())
        return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: TIME_WAIT is no obstacle
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    # the store owns the socket from here (it closes the descriptor when it goes)
    return dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, master_listen_fd=listener.detach())


def _wait_for_listener(port: int, timeout_s: float) -> None:
    """Return once rank 0's store listens on ``port`` (or after ``timeout_s``; the store's own
    connect then reports the failure). A TCPStore client that finds no listener backs off for
    up to a second before it tries again; probing every 5 ms starts a replica that much sooner."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.005)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _shutdown(core: Any, arena: ShmArena | None, mapper: ShmMapper | None, ring: BroadcastReader | None) -> None:
    if core is not None:
        try:
            core.close()
        except Exception:
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    if mapper is not None:
        mapper.close()
    if arena is not None:
        arena.close()
    if ring is not None:
        ring.close()
