"""python -m bench.fuzz --minutes N: malformed bytes into every decoder that reads another
process's messages; counts inputs and crashes (there must be none).

    target      what decodes it                                       who sends it in production
    wire        runtime.transport.wire.unpack_message, default decoder           any phyrt peer
    worker      unpack_message(rank_protocol.INBOX, a real ShmMapper)  the supervisor, to a rank
                and unpack_message(rank_protocol.CONTROL)
    supervisor  unpack_message(rank_protocol.ANSWERS, a real ShmMapper)  a rank, to the supervisor
    server      protocol.unpack_header, the op checks of                any client
                runtime.link.client_protocol, TensorResolver(request_tensor,
                the segments a client registered), finish()
    client      unpack_header, TensorResolver(numpy_tensor, a result    the server, to a client
                segment), error_from_reply
    handle      the server's MessageHandler over an inline engine:  any client
                every message is answered with a typed reply, and
                nothing escapes it (the I/O thread would log a server bug)

Allowed outcomes: a decoded value, or ``ProtocolError`` (``handle``: no exception at all,
and every reply ``ok`` or an error of ``client_protocol.ERROR_TYPES`` without a traceback).
Anything else is a crash; an input that takes longer than ``--hang-s`` (SIGALRM) is a
hang. Both are saved under ``--out`` with their input and count as failures.

Inputs, drawn from one seeded ``random.Random``: valid messages made by the real encoders
(inline and shared-memory tensors of every dtype, nested payloads, every op), then
mutated (bit flips, byte changes, truncation, insertion, splices of two messages), or
random msgpack objects with tensor descriptors whose fields take edge values, or forged
shared-memory references: names of the run that do not exist, another run's live segment,
and decoys in /dev/shm named like a segment of the run (a symlink to a live segment, a
directory, a FIFO, an empty file), path traversal, offsets at, past and before the end,
misaligned, huge. ``tests/test_fuzz.py`` drives the same targets with hypothesis.

Prints one JSON line: seconds, inputs per target, crashes, hangs; exit status 1 if any.
Everything it creates (segments, decoys, the server's socket directory) is removed at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import zmq

from runtime import Engine, EngineArgs, register_plugin
from runtime.transport import protocol, wire
from runtime.client.server_errors import error_from_reply
from runtime.core.errors import ProtocolError
from runtime.core.plugins import Entry
from runtime.link import client_protocol, rank_protocol
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id

WORKER_TYPES = rank_protocol.INBOX
WORKER_CTL_TYPES = rank_protocol.CONTROL
SUPERVISOR_TYPES = rank_protocol.ANSWERS
DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
EDGE_INTS = [0, 1, -1, 2, 3, 7, 8, 63, 64, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40,
             2**44, 2**44 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
#: the FIFO and directory decoys are the inputs a careless open() would hang or crash on
DECOY_KINDS = ("symlink", "directory", "fifo", "empty")


class Hang(BaseException):
    """An input ran past its time (a BaseException, so that no ``except Exception`` hides it)."""


@contextlib.contextmanager
def no_hang(seconds: float) -> Iterator[None]:
    """Raise ``Hang`` in the main thread if the block runs longer than ``seconds``."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------- real shared memory


class FuzzContext:
    """Live segments and /dev/shm decoys for the decoders to resolve references against.

    ``run_id``'s arena is the one a rank or the supervisor would map (``mapper``);
    ``client_shm`` is a server-side session with one registered client segment;
    ``result_arena`` holds segments a client would map results from. ``names`` are
    segment names to forge references with. ``close()`` removes all of it.
    """

    def __init__(self) -> None:
        from runtime.link.peer_shm import ClientShm

        self.run_id = new_run_id()
        self.arena = ShmArena(self.run_id, 1 << 16)
        self.segment = self.arena.segments[0]
        self.other = ShmArena(new_run_id(), 1 << 12)
        self.mapper = ShmMapper(self.run_id)
        client_run = new_run_id()
        self.client_arena = ShmArena(client_run, 1 << 16)
        self.client_segment = self.client_arena.segments[0]
        self.client_shm = ClientShm(b"fuzz", client_run, os.getpid())
        self.client_shm.register(self.client_segment)  # mapped, then unlinked, as the server does
        self.result_arena = ShmArena(new_run_id(), 1 << 16)
        self.result_mapper = ShmMapper(self.result_arena.run_id)
        self.decoys = []
        for seq, kind in enumerate(DECOY_KINDS, start=900_000):
            for run in (self.run_id, client_run, self.result_arena.run_id):
                path = os.path.join("/dev/shm", f"phyrt-{run}-{os.getpid()}-{seq}")
                if kind == "symlink":
                    os.symlink(os.path.join("/dev/shm", self.segment), path)
                elif kind == "directory":
                    os.mkdir(path, 0o700)
                elif kind == "fifo":
                    os.mkfifo(path, 0o600)
                else:
                    open(path, "wb").close()
                self.decoys.append(path)
        runs = (self.run_id, client_run, self.result_arena.run_id)
        self.names = sorted({self.segment, self.client_segment, self.result_arena.segments[0], self.other.segments[0],
                             *(os.path.basename(p) for p in self.decoys),
                             *(f"phyrt-{r}-1-999999" for r in runs), *(f"phyrt-{r}-{os.getpid()}-0" for r in runs),
                             "", "x", "phyrt-", "phyrt-zz-1-0", "../../etc/passwd", f"/dev/shm/{self.segment}",
                             f"{self.segment}/../{self.segment}", f"./{self.segment}", self.segment.upper(),
                             self.segment + "\x00", f"phyrt-{self.run_id}-0-0", f"phyrt-{self.run_id}-1-1" + "0" * 20})

    def place(self, nbytes: int) -> tuple[str, int, memoryview]:
        """A block of the run's arena (for valid shared-memory messages), freed at once:
        the bytes of the reference are what the fuzzer needs, not the block."""
        segment, offset, view = self.arena.place(nbytes)
        self.arena.free(segment, offset)
        return segment, offset, view

    def client_place(self, nbytes: int) -> tuple[str, int, memoryview] | None:
        segment, offset, view = self.client_arena.place(nbytes)
        self.client_arena.free(segment, offset)
        return (segment, offset, view) if segment == self.client_segment else None

    def result_view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        return self.result_mapper.view(segment, offset, nbytes)

    def close(self) -> None:
        for path in self.decoys:
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        self.client_shm.close()
        for closeable in (self.mapper, self.result_mapper, self.arena, self.other, self.client_arena,
                          self.result_arena):
            closeable.close()


# --------------------------------------------------------------------------- targets


def _decode_any(*decodes: Callable[[], Any]) -> None:
    """Several decoders on one input, each run: ProtocolError only if every one refused it."""
    refusals = []
    for decode in decodes:
        try:
            decode()
        except ProtocolError as exc:
            refusals.append(exc)
    if len(refusals) == len(decodes):
        raise refusals[-1]


def decode_wire(ctx: FuzzContext, data: bytes) -> None:
    _decode_any(*[lambda t=t: wire.unpack_message(data, tensor_decoder=wire.TensorDecoder(tensor_type=t))
                  for t in ("torch", "numpy")])


def decode_worker(ctx: FuzzContext, data: bytes) -> None:
    """What a rank's serve loop decodes: its ring's messages (requests, cancels, and control messages)."""
    decoder = wire.TensorDecoder(mapper=ctx.mapper)
    _decode_any(lambda: wire.unpack_message(data, expected_types=WORKER_TYPES, tensor_decoder=decoder),
                lambda: wire.unpack_message(data, expected_types=WORKER_CTL_TYPES))


def decode_supervisor(ctx: FuzzContext, data: bytes) -> None:
    wire.unpack_message(data, expected_types=SUPERVISOR_TYPES, tensor_decoder=wire.TensorDecoder(mapper=ctx.mapper))


def decode_server(ctx: FuzzContext, frames: list[bytes]) -> None:
    """What the server's I/O thread does with a message, short of the engine."""
    from runtime.serving.server import MAX_HEADER_BYTES
    from runtime.link.client_protocol import register_fields, release_blocks, submit_options
    from runtime.serving.outcomes import request_tensor

    if not frames:
        raise ProtocolError("no frames")
    header = protocol.unpack_header(frames[0], MAX_HEADER_BYTES)
    op = header.get("op")
    protocol.is_request_id(header.get("id"))
    if op == "submit":
        submit_options(header)
    elif op == "register":
        register_fields(header)
    elif op == "release":
        release_blocks(header)
    elif op == "cancel":
        protocol.is_request_id(header.get("target"))
    resolver = protocol.TensorResolver(frames[1:], request_tensor, ctx.client_shm.view)
    resolver.resolve(header.get("payload"))
    resolver.finish()


def decode_client(ctx: FuzzContext, frames: list[bytes]) -> None:
    if not frames:
        raise ProtocolError("no frames")
    header = protocol.unpack_header(frames[0], 1 << 30)
    resolver = protocol.TensorResolver(frames[1:], protocol.numpy_tensor, ctx.result_view)
    resolver.resolve(header.get("result"))
    resolver.finish()
    if header.get("ok") is not True:
        error_from_reply(header.get("error"), header.get("id"))


BYTE_TARGETS: dict[str, Callable[[FuzzContext, bytes], None]] = {
    "wire": decode_wire, "worker": decode_worker, "supervisor": decode_supervisor}
FRAME_TARGETS: dict[str, Callable[[FuzzContext, list[bytes]], None]] = {
    "server": decode_server, "client": decode_client}


def run_target(target: Callable[..., None], ctx: FuzzContext, data: Any, hang_s: float) -> bool:
    """Run one input: True if it decoded, False for ProtocolError (Hang and the rest propagate)."""
    with no_hang(hang_s):
        try:
            target(ctx, data)
        except ProtocolError:
            return False
    return True


class SinkRunner:
    def execute(self, request: Any) -> Any:
        return request


class Sink(Entry):
    """The fuzzed server's plugin: answers every request with the request itself."""

    def build(self, build_ctx: Any, plugin_args: Any) -> Any:
        return SinkRunner()


class ServerHandle:
    """The server's message handling (``runtime.serving.handlers.MessageHandler``, as a
    ``Server`` runs it) over an inline engine (a sink plugin), with no socket and no thread:
    ``feed(frames)`` handles one message and collects the replies instead of sending them."""

    def __init__(self, ctx: FuzzContext) -> None:
        from runtime.link.listener import Responder
        from runtime.serving.handlers import MessageHandler

        register_plugin("phyrt-fuzz-sink", Sink)
        self.dir = tempfile.mkdtemp(prefix="phyrt-fuzz-")
        self.engine = Engine(EngineArgs(plugin="phyrt-fuzz-sink"))
        # ipc://: shared memory is offered there only (nothing is bound: the replies come here)
        self.server = MessageHandler(self.engine, Responder(f"ipc://{self.dir}/fuzz.sock", self._capture))
        self.replies: list[dict] = []
        self.identity = b"fuzz-peer"
        self.ctx = ctx

    def _capture(self, identity: bytes, header: dict | bytes, frames: Any = ()) -> bool:
        self.replies.append(reply_fields(header))
        return True

    def feed(self, frames: list[bytes]) -> bool:
        """One message (at least one frame, as a ROUTER hands it over); True if some reply
        so far said ok. ``BadReply`` for a reply that breaks the protocol."""
        self.server.handle(self.identity, [zmq.Frame(f) for f in frames])
        return self.feed_nothing()

    def settle(self, timeout: float = 10.0) -> None:
        """Let the engine finish what it was given; check those replies too."""
        deadline = time.monotonic() + timeout
        while self.server.inflight and time.monotonic() < deadline:
            time.sleep(0.01)
            self.feed_nothing()

    def feed_nothing(self) -> bool:
        self.server.settle()  # the I/O thread's share: replies left to it, deadlines due
        replies, self.replies = self.replies, []
        for reply in replies:
            check_reply(reply)
        return any(reply.get("ok") is True for reply in replies)

    def close(self) -> None:
        try:
            self.engine.close(timeout=2.0)
        finally:
            self.server.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def reply_fields(header: dict | bytes) -> dict:
    """A reply as the server's send was handed it: a header dict, or its packed bytes (a
    successful submit's, ``Outcome.result``), decoded as a client would."""
    return header if isinstance(header, dict) else protocol.unpack_header(header, 1 << 30)


class BadReply(Exception):
    """A server reply outside the protocol (or carrying a traceback)."""


def check_reply(reply: Any) -> None:
    """Raise ``BadReply`` unless ``reply`` is ok, or an error of ``ERROR_TYPES`` without a traceback."""
    if not isinstance(reply, dict) or reply.get("v") != client_protocol.PROTOCOL_VERSION:
        raise BadReply(repr(reply)[:500])
    if reply.get("op") == "inputs_done":
        return
    if reply.get("ok") is True:
        return
    error = reply.get("error")
    if (reply.get("ok") is not False or not isinstance(error, dict)
            or error.get("type") not in client_protocol.ERROR_TYPES):
        raise BadReply(repr(reply)[:500])
    message = str(error.get("message"))
    if "Traceback" in message or 'File "' in message:
        raise BadReply(message[:2000])


# --------------------------------------------------------------------------- inputs


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Inputs:
    """Random inputs for every target, from one seeded generator."""

    def __init__(self, ctx: FuzzContext, seed: int) -> None:
        self.ctx = ctx
        self.rng = random.Random(seed)
        self.wire_seeds = self._make_wire_seeds()
        self.frame_seeds = self._make_frame_seeds()

    # valid messages, made by the real encoders
    def _tensors(self) -> list[Any]:
        rng = np.random.default_rng(self.rng.randrange(2**32))
        out = []
        for name in DTYPES:
            if name == "bfloat16":
                continue
            shape = tuple(int(d) for d in rng.integers(0, 5, size=int(rng.integers(0, 4))))
            out.append((rng.random(shape) * 10).astype(name))
        out.append(np.zeros((300, 300), np.float32))  # large: shared memory
        return out

    def _make_wire_seeds(self) -> list[bytes]:
        import torch

        shm = wire.TensorEncoder(allocator=self.ctx, inline_threshold=64)
        tensors = self._tensors()
        seeds = [
            wire.pack_message("request", 1, payload={"x": tensors[1], "nested": [tensors[2], {"k": tensors[3]}]}),
            wire.pack_message("request", 2, payload=tensors, tensor_encoder=shm),
            wire.pack_message("request", "id", payload={"t": torch.ones(3, 4, dtype=torch.bfloat16),
                                                        "b": torch.tensor([True, False])}),
            wire.pack_message("free", 0, blocks=[[self.ctx.segment, 0], [self.ctx.segment, 64]]),
            wire.pack_message("shutdown", 0),
            wire.pack_message("done", 3, ok=True, result={"a": tensors[-1]}, tensor_encoder=shm),
            wire.pack_message("done", 4, ok=False, error_type="KeyError", message="m", traceback="t"),
            wire.pack_message("ready", 0, segments=[self.ctx.segment]),
            wire.pack_message("startup_error", 1, error_type="E", message="m", traceback=""),
            wire.pack_message("hb", 7),
        ]
        return seeds

    def _make_frame_seeds(self) -> list[list[bytes]]:
        seeds = []
        for place in (None, self.ctx.client_place):
            encoder = protocol.PayloadEncoder(copy=True, place=place, shm_threshold=64)
            payload = encoder.encode({"obs": self._tensors(), "meta": {"a": [1, 2.5, "s", None, True, b"b"]}})
            header = {"v": 1, "op": "submit", "id": self.rng.randrange(2**20), "payload": payload, "timeout_s": 1.0}
            seeds.append([protocol.pack_header(header), *[bytes(f) for f in encoder.frames]])
        result_segment, offset, _ = self.ctx.result_arena.place(4096)
        reply = {"v": 1, "op": "submit", "id": 5, "ok": True,
                 "result": {"r": msgpack.ExtType(protocol.EXT_SHM, msgpack.packb([result_segment, offset, "float32",
                                                                                  [1024]]))}}
        seeds.append([protocol.pack_header(reply)])
        seeds += [[protocol.pack_header(h)] for h in (
            {"v": 1, "op": "ping", "id": 1}, {"v": 1, "op": "info", "id": "i"},
            {"v": 1, "op": "cancel", "id": 2, "target": 1},
            {"v": 1, "op": "register", "id": 3, "run_id": self.ctx.client_shm.run_id, "segments": [], "pid": 1},
            {"v": 1, "op": "release", "id": 4, "blocks": [[self.ctx.client_segment, 0]]},
            {"v": 1, "op": "submit", "id": 6, "ok": False, "error": {"type": "PluginError", "message": "m"}},
        )]
        return seeds

    # random structures
    def scalar(self) -> Any:
        rng = self.rng
        return rng.choice([
            lambda: None, lambda: rng.random() < 0.5, lambda: rng.choice(EDGE_INTS),
            lambda: rng.randrange(-5, 70), lambda: rng.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), 1e308]),
            lambda: rng.choice(["", "x", "request", "done", "v", "type", "id", "payload", "op", "submit",
                                "register", "segment", *DTYPES, "complex64", "\ufffd", "\U0001f600" * 3]),
            lambda: rng.randbytes(rng.randrange(0, 40)),
        ])()

    def shape(self) -> Any:
        rng = self.rng
        if rng.random() < 0.8:
            return [rng.choice([0, 1, 2, 3, 4, 8, 1024, -1, 2**40, 2**44, True]) for _ in range(rng.randrange(0, 5))]
        return rng.choice([[1] * 17, "3", None, [1.5], [[2]], {}])

    def name(self) -> Any:
        return self.rng.choice(self.ctx.names) if self.rng.random() < 0.9 else self.scalar()

    def offset(self) -> Any:
        rng = self.rng
        return rng.choice([0, 2, 4, 8, 63, 64, 4096, (1 << 16) - 4, 1 << 16, (1 << 16) + 64, 2**40, 2**63 - 1,
                           -4, True, 1.0, None])

    def descriptor(self, code: int) -> Any:
        rng = self.rng
        dtype = rng.choice(DTYPES + ["x", 5])
        if code == wire.EXT_INLINE:
            nbytes = rng.choice([0, 1, 4, 8, 16, 100])
            body = [dtype, self.shape(), rng.randbytes(nbytes) if rng.random() < 0.9 else self.scalar(), 0]
            return body[:rng.choice([3, 3, 3, 2, 4])]
        if code == wire.EXT_SHM:
            ref = {"segment": self.name(), "offset": self.offset(), "nbytes": rng.choice([0, 4, 16, 64, 2**20, -1]),
                   "dtype": dtype, "shape": self.shape()}
            if rng.random() < 0.1:
                ref.pop(rng.choice(list(ref)))
            return ref
        fields = ["size", "stride", "offset", "dtype", "device", "handle", "storage_size_bytes",
                  "storage_offset_bytes", "requires_grad", "ref_counter_handle", "ref_counter_offset",
                  "event_handle", "event_sync_required"]
        return {f: self.scalar() if rng.random() < 0.5 else self.shape() for f in fields}

    def frame_ref(self, frames: int) -> msgpack.ExtType:
        rng = self.rng
        if rng.random() < 0.5:
            body = [rng.choice(DTYPES + ["x"]), self.shape(), rng.choice([0, 1, frames, -1, True, "0", 2**63])]
            return msgpack.ExtType(protocol.EXT_FRAME, _packb(body))
        body = [self.name(), self.offset(), rng.choice(DTYPES), self.shape()]
        return msgpack.ExtType(protocol.EXT_SHM, _packb(body[:rng.choice([4, 4, 4, 3, 5])]))

    def ext(self) -> Any:
        rng = self.rng
        code = rng.choice([1, 1, 2, 2, 3, 0, 4, 127, -1])
        if code < 0:  # msgpack's own extension type -1
            return msgpack.Timestamp(rng.randrange(2**32), rng.randrange(10**9))
        payload = _packb(self.descriptor(code)) if rng.random() < 0.85 and code in (1, 2, 3) else rng.randbytes(
            rng.randrange(0, 24))
        return msgpack.ExtType(code, payload)

    def obj(self, depth: int = 0) -> Any:
        rng = self.rng
        roll = rng.random()
        if depth > 4 or roll < 0.35:
            return self.scalar()
        if roll < 0.55:
            return self.ext()
        if roll < 0.75:
            return [self.obj(depth + 1) for _ in range(rng.randrange(0, 5))]
        keys = [self.scalar() if rng.random() < 0.15 else rng.choice(["v", "type", "id", "x", "payload", "op",
                                                                     "result", "blocks", "segments", "ok"])
                for _ in range(rng.randrange(0, 5))]
        out = {}
        for key in keys:
            try:
                hash(key)
            except TypeError:
                continue
            out[key] = self.obj(depth + 1)
        return out

    def message(self, frames: bool = False) -> dict:
        rng = self.rng
        msg = {"v": 1 if rng.random() < 0.9 else self.scalar()}
        if frames:
            msg["op"] = rng.choice(["submit", "submit", "register", "release", "cancel", "ping", "info",
                                    self.scalar()])
            msg["id"] = rng.choice([1, "a", 2**64 - 1, -1, "x" * 129, None, 1.5])
            for key in rng.sample(["payload", "timeout_s", "shm_results", "priority", "run_id", "segments", "pid",
                                   "blocks", "target", "result", "ok", "error", "extra"], rng.randrange(0, 5)):
                msg[key] = self.obj(1)
        else:
            msg["type"] = rng.choice(["request", "free", "shutdown", "ready", "done", "startup_error", "hb", ""]
                                     + [self.scalar()])
            msg["id"] = rng.choice([0, 1, "id", -1, 2**64 - 1, None, True, 1.5, [1]])
            for key in rng.sample(["payload", "blocks", "segments", "ok", "result", "error_type", "x"],
                                  rng.randrange(0, 4)):
                msg[key] = self.obj(1)
        if rng.random() < 0.05:
            msg.pop(rng.choice(list(msg)))
        return msg

    # mutation
    def mutate(self, data: bytes, donor: bytes) -> bytes:
        rng = self.rng
        data = bytearray(data)
        for _ in range(rng.choice([1, 1, 1, 2, 4, 8])):
            op = rng.randrange(7)
            pos = rng.randrange(len(data) + 1)
            if op == 0 and data:  # flip a bit
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
            elif op == 1 and data:  # an interesting byte
                i = rng.randrange(len(data))
                data[i] = rng.choice([0x00, 0xff, 0x7f, 0x80, 0xc0, 0xc1, 0xc4, 0xc7, 0xd4, 0xd9, 0xdc, 0xdd, 0xde,
                                      0xdf, 0x90, 0x80, 0xa0, 0x91, 0x81, rng.randrange(256)])
            elif op == 2:  # truncate
                del data[pos:]
            elif op == 3:  # insert bytes
                data[pos:pos] = rng.randbytes(rng.randrange(1, 9))
            elif op == 4 and data:  # delete a run
                del data[pos:pos + rng.randrange(1, 9)]
            elif op == 5:  # splice another message in
                cut = rng.randrange(len(donor) + 1)
                data[pos:] = donor[cut:]
            else:  # a big-endian length field set to a large value
                data[pos:pos] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\xf0",
                                            b"\xdb\x00\x01\x00\x00", b"\xc9\xff\xff\xff\xff\x01"])
        return bytes(data)

    # one input per target kind
    def message_bytes(self) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.45:
            return self.mutate(rng.choice(self.wire_seeds), rng.choice(self.wire_seeds))
        if roll < 0.9:
            return _packb(self.message())
        if roll < 0.95:
            return _packb(self.obj())
        return rng.randbytes(rng.randrange(0, 64))

    def frames(self) -> list[bytes]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            seed = [bytes(f) for f in rng.choice(self.frame_seeds)]
            donor = rng.choice(self.frame_seeds)[0]
            i = rng.randrange(len(seed))
            seed[i] = self.mutate(seed[i], donor)
            if rng.random() < 0.2:
                seed = seed[:rng.randrange(len(seed) + 1)] + [rng.randbytes(rng.choice([0, 4, 128]))] * rng.randrange(2)
            return seed
        n = rng.choice([0, 0, 1, 1, 2, 3])
        frames = [rng.randbytes(rng.choice([0, 1, 4, 8, 16, 64, 128, 4096])) for _ in range(n)]
        msg = self.message(frames=True)
        refs = [self.frame_ref(n) for _ in range(rng.randrange(0, 4))]
        if refs:
            target = "payload" if msg.get("op") != "submit" or rng.random() < 0.8 else "result"
            msg[target] = refs if rng.random() < 0.5 else {"t": refs[0], "rest": refs[1:]}
        if roll > 0.95:
            return [rng.randbytes(rng.randrange(0, 64)), *frames]
        return [_packb(msg), *frames]


# --------------------------------------------------------------------------- the run


def fuzz(seconds: float, seed: int, hang_s: float, out: str | None, max_inputs: int | None = None) -> dict:
    ctx = FuzzContext()
    handle = None
    started = time.monotonic()
    counts = {name: 0 for name in [*BYTE_TARGETS, *FRAME_TARGETS, "handle"]}
    accepted = dict.fromkeys(counts, 0)  # decoded without a ProtocolError (handle: answered ok)
    failures: list[dict] = []
    try:
        handle = ServerHandle(ctx)
        inputs = Inputs(ctx, seed)
        started = time.monotonic()
        i = 0
        names = [*BYTE_TARGETS, *FRAME_TARGETS, "handle"]
        while time.monotonic() - started < seconds and (max_inputs is None or i < max_inputs):
            name = names[i % len(names)]
            i += 1
            if name in BYTE_TARGETS:
                data: Any = inputs.message_bytes()
                call = lambda: run_target(BYTE_TARGETS[name], ctx, data, hang_s)  # noqa: E731
            elif name in FRAME_TARGETS:
                data = inputs.frames()
                call = lambda: run_target(FRAME_TARGETS[name], ctx, data, hang_s)  # noqa: E731
            else:
                data = inputs.frames() or [b""]  # a ROUTER hands over at least one frame after the identity

                def call() -> bool:
                    with no_hang(hang_s):
                        return handle.feed(data)
            counts[name] += 1
            try:
                accepted[name] += bool(call())
            except (Hang, Exception) as exc:  # noqa: BLE001 - every other outcome is the finding
                failures.append(_record(name, data, exc, out, len(failures)))
            if i % 500 == 0:
                handle.settle()
        handle.settle()
    finally:
        if handle is not None:
            handle.close()
        ctx.close()
    crashes = [f for f in failures if f["kind"] == "crash"]
    hangs = [f for f in failures if f["kind"] == "hang"]
    return {"seconds": round(time.monotonic() - started, 1), "seed": seed, "inputs": sum(counts.values()),
            "per_target": counts, "accepted": accepted, "crashes": len(crashes), "hangs": len(hangs),
            "first_failures": failures[:5]}


def _record(target: str, data: Any, exc: BaseException, out: str | None, index: int) -> dict:
    kind = "hang" if isinstance(exc, Hang) else "crash"
    entry = {"kind": kind, "target": target, "error": f"{type(exc).__name__}: {exc}"[:500]}
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"{kind}-{index:04d}-{target}.json")
        frames = data if isinstance(data, list) else [data]
        with open(path, "w") as f:
            json.dump({**entry, "frames_hex": [bytes(x).hex() for x in frames],
                       "traceback": "".join(traceback.format_exception(exc))}, f, indent=1)
        entry["saved"] = path
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz")
    parser.add_argument("--seed", type=int, default=None, help="the generator's seed (default: random, printed)")
    parser.add_argument("--hang-s", type=float, default=5.0, help="an input running longer is a hang")
    parser.add_argument("--out", default=None,
                        help="save each failing input here (default: $TMPDIR/phyrt-fuzz-failures-SEED)")
    opts = parser.parse_args(argv)
    if not 0 < opts.minutes <= 24 * 60:
        parser.error(f"--minutes must be in (0, 1440], got {opts.minutes}")
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**32)
    # made only when an input fails: a clean run leaves nothing behind
    out = opts.out or os.path.join(tempfile.gettempdir(), f"phyrt-fuzz-failures-{seed}")
    report = fuzz(opts.minutes * 60, seed, opts.hang_s, out)
    report["failures_dir"] = out if report["crashes"] or report["hangs"] else None
    print(json.dumps(report), flush=True)
    return 1 if report["crashes"] or report["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
