"""Echo servers in child processes, and the client ends that call them: the floors and the
pickle baseline that ``bench.transport`` and ``python -m bench`` measure next to phyrt.

    PipeEcho   os.write / os.read  ====================> pipe echo (raw bytes)        floor
    ZmqEcho    DEALER + msgpack    ====================> ROUTER echo (msgpack)        floor
    ZmqEcho    DEALER + pickle     ====================> ROUTER echo (pickle)         baseline

Torch-free at import, so that a spawned echo server starts in a fraction of a second
(the pickle echo imports torch on its first torch tensor, during warm-up). pickle
appears only in the pickle-over-ZMQ baseline, between the benchmark's own processes;
phyrt never pickles on a socket.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle  # the pickle-over-ZMQ baseline only
import select
from typing import Any

import msgpack
import zmq

from bench.common import exit_with_parent as _exit_with_parent
from bench.common import join_or_kill as _join

#: a reply that does not come this long after its request is an error (first replies include startup)
REPLY_TIMEOUT_S = 120.0


def _pipe_echo_server(inbound: multiprocessing.connection.Connection,
                      outbound: multiprocessing.connection.Connection) -> None:
    """Write back whatever arrives (messages are below PIPE_BUF, so each is one read); EOF ends it."""
    _exit_with_parent()
    rfd, wfd = inbound.fileno(), outbound.fileno()
    while True:
        data = os.read(rfd, 65536)
        if not data:
            return
        os.write(wfd, data)


def _zmq_echo_server(address: str, codec: str) -> None:
    """A ROUTER that decodes and re-encodes each frame with ``codec``; an empty frame ends it."""
    _exit_with_parent()
    if codec == "pickle":
        loads, dumps, zero_copy = pickle.loads, _pickle_dumps, True
    else:
        loads, dumps, zero_copy = msgpack.unpackb, msgpack.packb, False
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        while True:
            identity, frame = sock.recv_multipart(copy=not zero_copy)
            data = frame.buffer if zero_copy else frame
            if not len(data):
                return
            sock.send_multipart([identity, dumps(loads(data))], copy=not zero_copy)
    finally:
        sock.close(0)
        ctx.term()


def _pickle_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# --------------------------------------------------------------------------- subjects: one call = one round trip


class PipeEcho:
    label = "OS pipe echo, raw bytes, 2 processes (floor)"

    def __init__(self, mp: Any) -> None:
        server_in, self._to_server = mp.Pipe(duplex=False)
        self._from_server, server_out = mp.Pipe(duplex=False)
        self.process = mp.Process(target=_pipe_echo_server, args=(server_in, server_out),
                                  name="bench-pipe-echo", daemon=True)
        self.process.start()
        server_in.close()  # only the child holds these now, so its death reads as EOF here
        server_out.close()
        self._w, self._r = self._to_server.fileno(), self._from_server.fileno()

    def ready(self, payload: bytes) -> None:
        os.write(self._w, payload)
        if not select.select([self._r], [], [], REPLY_TIMEOUT_S)[0]:
            raise TimeoutError(f"pipe echo server (pid {self.process.pid}) did not answer in {REPLY_TIMEOUT_S} s")
        self._check(payload, os.read(self._r, 65536))

    def call(self, payload: bytes) -> bytes:
        # no select here: it would add to the floor; a dead server reads as EOF and fails _check
        os.write(self._w, payload)
        return self._check(payload, os.read(self._r, 65536))

    def _check(self, payload: bytes, reply: bytes) -> bytes:
        if len(reply) != len(payload):
            raise RuntimeError(f"pipe echo returned {len(reply)} bytes for {len(payload)} "
                               f"(server exit code {self.process.exitcode})")
        return reply

    def close(self) -> None:
        self._to_server.close()
        _join(self.process)
        self._from_server.close()


class ZmqEcho:
    def __init__(self, mp: Any, zctx: zmq.Context, workdir: str, codec: str) -> None:
        self.label = ("bare ZMQ DEALER/ROUTER ipc:// + msgpack, 2 processes (floor)" if codec == "msgpack"
                      else "pickle over ZMQ DEALER/ROUTER ipc:// (baseline)")
        self._path = os.path.join(workdir, f"echo-{codec}")
        address = f"ipc://{self._path}"
        self.process = mp.Process(target=_zmq_echo_server, args=(address, codec),
                                  name=f"bench-zmq-{codec}-echo", daemon=True)
        self.process.start()
        self._zero_copy = codec == "pickle"  # large frames: no copy into ZMQ messages
        self._dumps, self._loads = (_pickle_dumps, pickle.loads) if codec == "pickle" else (msgpack.packb,
                                                                                           msgpack.unpackb)
        self._sock = zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, int(REPLY_TIMEOUT_S * 1000))
        self._sock.connect(address)

    def ready(self, request: Any) -> None:
        self.call(request)

    def call(self, request: Any) -> Any:
        self._sock.send(self._dumps(request), copy=not self._zero_copy)
        try:
            frame = self._sock.recv(copy=not self._zero_copy)
        except zmq.Again:
            raise TimeoutError(f"{self.label}: no reply within {REPLY_TIMEOUT_S} s "
                               f"(server exit code {self.process.exitcode})") from None
        return self._loads(frame.buffer if self._zero_copy else frame)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(b"")
        _join(self.process)
        self._sock.close(0)
        with contextlib.suppress(FileNotFoundError):  # libzmq leaves an ipc:// socket file behind
            os.unlink(self._path)
