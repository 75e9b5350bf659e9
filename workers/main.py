"""The rank process of a local replica: ``main(bootstrap)`` is its entry point.

    supervisor (engine process)                       this rank
    BroadcastWriter /dev/shm/phyrt-RUN-PID-SEQ ---->  BroadcastReader  main thread: serve loop
      (requests, cancels, frees, shutdown; once)        (runtime.link.broadcast)
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

Serve: every rank of the replica reads every message of its replica from the one broadcast
ring, in the same order, so all ranks enter the plugin's collectives together. Only the output
rank (rank 0) answers: "done" for each request (with its result, or its error) and "partial" for
each stream chunk. The other ranks send nothing per request but "done" {ok: false} when their
plugin raises; because ranks that share collectives cannot resume mid-request, the supervisor
then takes the group down. Non-output ranks have no result arena.

Release: a rank tells the ring it is done with a message (``BroadcastReader.release``, in
order): an executing runner after ``run``, a stepped one after ``add``, a control message at
once. The engine frees a request's arena blocks once the output rank answered and every rank
released it, so a stepped plugin must not keep request tensors on a non-output rank past the
output rank's answer.

Executing runners stay in lock step by construction (same requests, same order,
one at a time). A stepped runner admits whatever has arrived before each step,
which may differ between ranks by a message, so a stepped plugin that runs
collectives must agree on each step's batch itself (rank 0 decides and
broadcasts it on ``P.cpu_group()``).

Streams: a "request" with ``stream: true`` is admitted as a stream (``EngineCore.add``); a
"cancel" {id} behind it on the ring reaches the runner's ``cancel``. The output rank sends each
``Partial`` chunk as "partial" {id, chunk} before the request's "done"; the other ranks drop
theirs. An executing runner runs one request at a time: a "cancel" it reads is dropped (the
request it names ran already).

Shutdown: "shutdown" is the ring's last message, and the engine closes the ring with it; a
rank sees the ring closed ahead of any request still queued in it, and stops.

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

from runtime.core.plugins import Partial
from runtime.link import rank_protocol as rp
from runtime.link.broadcast import CLOSED, FLAG_CONTROL, BroadcastReader
from runtime.transport import wire
from runtime.transport.arena import ShmArena, ShmMapper

#: inline tensors up to this size; larger CPU tensors go through shared memory
INLINE_LIMIT = 64 * 1024


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
        ctl.send(wire.pack_message(rp.READY, rank, segments=arena.segments if arena is not None else []))
        if arena is not None:  # the output rank
            heartbeat.core = core
        _serve(ctl, ring, core, arena, decoder=wire.TensorDecoder(mapper=mapper, allow_cuda_ipc=boot["target"] == "cuda"))
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
    core = EngineCore(entry, boot["plugin_args"], ctx)
    # only the output rank answers with results: only it needs a result arena
    arena = ShmArena(boot["run_id"], boot["arena_bytes"]) if rank == 0 else None
    mapper = ShmMapper(boot["run_id"])
    for segment in boot["premap"]:  # map the supervisor's first segment now, so its name can go
        mapper.view(segment, 0, 0)
    # mapped before "ready": the supervisor unlinks its name once every rank is ready
    ring = BroadcastReader(boot["run_id"], boot["ring"], rank, boot["ring_nonce"], spin_ns=boot["spin_ns"],
                           mapper=mapper)
    return core, arena, mapper, ring


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


def _serve(ctl: zmq.Socket, ring: BroadcastReader, core: Any, arena: ShmArena | None, decoder: Any) -> None:
    """Read the ring until it closes (or says "shutdown"): admit, run or step, and answer."""
    is_output = arena is not None
    encoder = wire.TensorEncoder(allocator=arena, inline_threshold=INLINE_LIMIT) if is_output else None
    batching = core.batching
    served = False  # after an answer: look for the next request a moment before sleeping
    while True:
        # Block for messages only while the runner has nothing to advance (an executing one
        # never has: it runs each request as it is taken).
        stepping = batching and core.has_unfinished()
        got = ring.recv(0 if stepping else None, spin=served)
        served = False
        done: list = []
        while got is not None:
            if got is CLOSED:
                return
            seq, flags, data = got
            if flags & FLAG_CONTROL:
                msg = wire.unpack_message(data, expected_types=rp.CONTROL)
                ring.release(seq)
                if msg["type"] == rp.SHUTDOWN:
                    return
                for segment, offset in msg["blocks"] if is_output else ():
                    arena.free(segment, offset)
            elif batching:  # admit whatever has arrived, then step once
                msg = wire.unpack_message(data, expected_types=rp.INBOX, tensor_decoder=decoder)
                if msg["type"] == rp.CANCEL:
                    core.cancel(msg["id"])
                else:
                    core.add(msg["id"], msg["payload"], msg.get("stream") is True)
                ring.release(seq)  # its tensors stay valid until the output rank answers (the rule)
            else:  # one at a time: the rest stay in the ring
                msg = wire.unpack_message(data, expected_types=rp.INBOX, tensor_decoder=decoder)
                if msg["type"] == rp.REQUEST:
                    done = core.run(msg["id"], msg["payload"])
                ring.release(seq)
                if done:
                    break
            got = ring.recv(0)
        if batching:
            done = core.step()
        if done:
            served = _answer(ctl, done, encoder)


def _answer(ctl: zmq.Socket, done: list, encoder: wire.TensorEncoder | None) -> bool:
    """From the output rank (``encoder``): "partial" for each stream chunk and "done" for each
    completion, with its result or error; from another rank only "done" {ok: false} for an
    error. True when some request completed."""
    for request_id, result, error in done:
        if type(result) is Partial:
            if encoder is not None:
                ctl.send(wire.pack_message(rp.PARTIAL, request_id, chunk=result.chunk, tensor_encoder=encoder))
            continue
        if error is None and encoder is not None:
            try:
                reply = wire.pack_message(rp.DONE, request_id, ok=True, result=result, tensor_encoder=encoder)
            except Exception as exc:  # a result the wire cannot carry fails like the plugin did
                error = exc
        if error is not None:
            reply = wire.pack_message(rp.DONE, request_id, ok=False, **rp.error_fields(error))
        elif encoder is None:
            continue  # a non-output rank's completion: nothing to say
        ctl.send(reply)
    return True


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
