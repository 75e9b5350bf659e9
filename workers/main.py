"""The rank process of a local replica: ``main(bootstrap)`` is its entry point.

    supervisor (engine process)                       this rank
    PUSH ipc://RUN_DIR/in-R-r ------- requests ------->  PULL  main thread: serve loop
    ROUTER ipc://RUN_DIR/ctl  <------ DEALER "c-R-r" ---  main thread: ready, done; <- free, shutdown
                              <------ DEALER "h-R-r" ---  heartbeat thread: "hb" every interval
    parent's spawn pipe       ------- EOF on death ---->  death-watch thread: os._exit

Start (two-phase): pin the device (cuda: ``torch.cuda.set_device(entry)``, which
composes with CUDA_VISIBLE_DEVICES; cpu: a fair share of threads), join the
replica's process group (NCCL on cuda, gloo on cpu; rendezvous on
``127.0.0.1:base_port + replica``), build the named groups of ``runtime.parallel``
from the ParallelConfig, build the plugin, then send "ready". Any failure on the
way is sent as "startup_error" (type, message, traceback text) and the process exits.

Serve: every rank of the replica receives every request of its replica in the
same order (the supervisor sends each request to every rank's inbox under one
lock, and ZMQ keeps per-connection order),
so all ranks enter the plugin's collectives together. Each rank answers "done" for
each request; the output rank's "done" carries the result. A plugin exception is
reported as data and, because ranks that share collectives cannot resume
mid-request, the supervisor then takes the group down.

Executing runners stay in lock step by construction (same requests, same order,
one at a time). A stepped runner admits whatever has arrived before each step,
which may differ between ranks by a message, so a stepped plugin that runs
collectives must agree on each step's batch itself (rank 0 decides and
broadcasts it on ``P.cpu_group()``).

The heartbeat thread has its own socket (ZMQ sockets are not thread-safe) and
keeps beating while the main thread is inside a forward pass (torch releases the
GIL). The death watch makes a rank exit within moments of its engine's SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import traceback
from typing import Any

import msgpack
import zmq

from runtime import wire
from runtime.shm import ShmArena, ShmMapper

#: inline tensors up to this size; larger CPU tensors go through shared memory
INLINE_LIMIT = 64 * 1024


def _watch_parent() -> None:
    """Exit when the engine process dies, however it died.

    A spawned child holds the read end of a pipe whose write end only its parent
    keeps open (multiprocessing's parent sentinel), so EOF means the parent is gone.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        os._exit(70)

    threading.Thread(target=watch, name="phyrt-death-watch", daemon=True).start()


def _error_fields(exc: BaseException) -> dict[str, str]:
    return {
        "error_type": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


class _Heartbeat:
    def __init__(self, ctx: zmq.Context, address: str, identity: bytes, interval: float) -> None:
        self._socket = ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, identity)
        self._socket.connect(address)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phyrt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        try:
            while not self._stop.is_set():
                self._socket.send(wire.pack_message("hb", beat), copy=False)
                beat += 1
                self._stop.wait(self._interval)
        finally:
            self._socket.close(0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def main(bootstrap: bytes) -> None:
    """Entry point of a spawned rank; ``bootstrap`` is a msgpack map (see supervisor)."""
    _watch_parent()
    boot = msgpack.unpackb(bootstrap, raw=False)
    replica, rank = boot["replica"], boot["rank"]
    ctx = zmq.Context(1)
    ctl = ctx.socket(zmq.DEALER)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.setsockopt(zmq.IDENTITY, f"c-{replica}-{rank}".encode())
    ctl.connect(boot["address"])
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(boot["inbox"])
    heartbeat = _Heartbeat(ctx, boot["address"], f"h-{replica}-{rank}".encode(), boot["heartbeat_interval_s"])
    arena = mapper = core = None
    code = 0
    try:
        try:
            core, arena, mapper = _start(boot)
        except BaseException as exc:
            ctl.send(wire.pack_message("startup_error", rank, **_error_fields(exc)))
            code = 1
            return
        ctl.send(wire.pack_message("ready", rank, segments=arena.segments))
        _serve(ctl, inbox, core, arena, mapper, boot)
    except BaseException:
        traceback.print_exc()  # the supervisor sees the exit; the text goes to the log
        code = 1
    finally:
        heartbeat.stop()
        _shutdown(core, arena, mapper)
        ctl.close(0)
        inbox.close(0)
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(boot: dict[str, Any]):
    import torch
    import torch.distributed as dist

    from runtime import parallel as P
    from runtime.config import DeviceConfig, EngineConfig, ParallelConfig
    from runtime.plugins import resolve_plugin
    from workers.core import EngineCore, make_context

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
        port = boot["port"]
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=_timedelta(boot["startup_timeout_s"]))
        except Exception as exc:
            raise RuntimeError(f"rendezvous of replica {boot['replica']} on 127.0.0.1:{port} failed "
                               f"(is the port taken? set WorkerSupervisorConfig.base_port): {exc}") from exc
        P.initialize(parallel, rank, backend=backend)
    entry = resolve_plugin(boot["plugin"])()
    entry.configure(boot["plugin_args"])
    ctx = make_context(config, rank=rank, world_size=world, replica_index=boot["replica"],
                       device_index=boot["device"])
    core = EngineCore(entry, boot["plugin_args"], ctx)
    arena = ShmArena(boot["run_id"], boot["arena_bytes"])
    mapper = ShmMapper(boot["run_id"])
    for segment in boot["premap"]:  # map the supervisor's first segment now, so its name can go
        mapper.view(segment, 0, 0)
    return core, arena, mapper


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def _serve(ctl: zmq.Socket, inbox: zmq.Socket, core: Any, arena: ShmArena, mapper: ShmMapper,
           boot: dict[str, Any]) -> None:
    is_output = boot["rank"] == 0
    decoder = wire.TensorDecoder(mapper=mapper, allow_cuda_ipc=boot["target"] == "cuda")
    encoder = wire.TensorEncoder(allocator=arena, inline_threshold=INLINE_LIMIT)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(ctl, zmq.POLLIN)
    while True:
        # Block for messages only while the runner has nothing to advance.
        if not core.has_unfinished():
            poller.poll()
        while ctl.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = wire.unpack_message(ctl.recv(copy=False).buffer, expected_types={"free", "shutdown"})
            if msg["type"] == "shutdown":
                return
            for segment, offset in msg["blocks"]:
                arena.free(segment, offset)
        while inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = wire.unpack_message(inbox.recv(copy=False).buffer, expected_types={"request"},
                                      tensor_decoder=decoder)
            core.add(msg["id"], msg["payload"])
            if not core.batching:
                break  # one at a time: the rest stay queued in the socket
        for request_id, result, error in core.step():
            if error is None and is_output:
                try:
                    reply = wire.pack_message("done", request_id, ok=True, result=result, tensor_encoder=encoder)
                except Exception as exc:  # a result the wire cannot carry fails like the plugin did
                    error = exc
            elif error is None:
                reply = wire.pack_message("done", request_id, ok=True)
            if error is not None:
                reply = wire.pack_message("done", request_id, ok=False, **_error_fields(error))
            ctl.send(reply)


def _shutdown(core: Any, arena: ShmArena | None, mapper: ShmMapper | None) -> None:
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
