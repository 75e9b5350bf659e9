"""The light client of ``runtime.server``, and the wire format both sides speak.

Needs pyzmq, msgpack and numpy only: torch is used when the caller hands in torch
tensors or asks for torch results, never imported here otherwise.

    caller threads                      I/O thread (owns the DEALER)              server (ROUTER)
    submit(payload) -> Future
      encode: tensors -> frames | shm
      pending[id] = Future
      outbox.append(frames); wake ----> send ------ [header, *tensor frames] ---->
    Future.set_result / set_exception <- recv <----- [header, *tensor frames] -----
                                        "ping" every heartbeat_interval_s
                                        socket monitor: DISCONNECTED -> in-flight fail

Wire (protocol version 1). Every message is one msgpack header frame, then one raw
frame per tensor (little-endian, C order). Map keys are str. A tensor inside the
header is a msgpack extension:

    ext 1  frame   [dtype, shape, index]            bytes are tensor frame ``index``
                                                    (0 = the first frame after the header);
                                                    every frame is referenced exactly once
    ext 2  shm     [segment, offset, dtype, shape]  bytes live in shared memory

dtypes: float16 float32 float64 bfloat16 int8 int16 int32 int64 uint8 bool.

Requests (client -> server), always ``{"v": 1, "op": OP, "id": ID, ...}``; ``ID`` is
an int in [0, 2**64) or a str of at most 128 characters, chosen by the client and
unique among that connection's requests in flight:

    submit    payload, [timeout_s: seconds, the request's deadline], [shm_results: bool]
    cancel    target: the id of a submit (only a request still queued on an inline
              engine can be cancelled; local replicas run what they were sent)
    ping      -                       -> {server_id, time}
    info      -                       -> plugin, topology, replicas' health and
                                         in-flight counts, versions, limits
    register  run_id, segments, [pid] -> {run_id, result_run_id, mapped}   (ipc:// only)
    release   blocks: [[segment, offset], ...]   (no reply)

Replies (server -> client): ``{"v": 1, "op": OP, "id": ID, "ok": true, "result": ...}``
or ``{..., "ok": false, "error": {"type": T, "message": M}}`` with T one of
InvalidRequest, DeadlineExceeded, Overloaded, EngineUnavailable, PluginError,
Cancelled. A message that cannot be parsed gets ``op`` and ``id`` null. A submit
reply may carry ``inputs_held: true`` (see below). The server may also send
``{"op": "inputs_done", "id": ID}`` unasked.

Same-host shared memory (ipc:// only). Inputs: the client creates segments in its
own ``ShmArena`` (run id of its own) and registers each one before the first request
that refers to it; the server maps only the segments that connection registered,
checks every offset and size, and unlinks each name right after mapping it, so a
crash of either side leaves nothing in /dev/shm. A block is reused only once the
server is done with it: at the request's reply, or, if that reply said
``inputs_held`` (a deadline fired while the plugin still read the block), at
``inputs_done``. Results: with ``shm_results`` the server places large result
tensors in an arena it keeps for that connection; the client copies them out at
once and sends ``release``, whose first use of a segment also tells the server the
client has mapped it, so the server unlinks that name. Results are therefore always
ordinary, writable arrays the caller owns. The server drops a connection's shared
memory (and unlinks what is left) when the ``pid`` it registered with is gone, or
after ``client_timeout_s`` of silence (the client pings every heartbeat interval).

Failure. A lost connection (the socket monitor's DISCONNECTED, or no word from the
server for ``heartbeat_timeout_s`` while requests are in flight) fails those
requests with ``ConnectionLostError``; the socket reconnects by itself, and a
server restart (a new ``server_id``) starts a fresh shared-memory session.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.errors import EngineUnavailableError, PhyrtError, ProtocolError
from runtime.shm import ShmArena, ShmMapper, new_run_id, sweep_stale

__all__ = [
    "AsyncClient", "Client", "ConnectionLostError", "DeadlineExceededError", "InvalidRequestError",
    "OverloadedError", "PluginError", "ServerError", "ServerUnavailableError",
]

log = logging.getLogger("phyrt.client")

PROTOCOL_VERSION = 1
EXT_FRAME, EXT_SHM = 1, 2
MAX_DEPTH = 32
MAX_NDIM = 16
MAX_TENSOR_FRAMES = 256
MAX_ID_CHARS = 128
#: tensors at least this large go through shared memory when it is available
DEFAULT_SHM_THRESHOLD = 64 * 1024
ERROR_TYPES = ("InvalidRequest", "DeadlineExceeded", "Overloaded", "EngineUnavailable", "PluginError", "Cancelled")

_NP_CODES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "i1", "int16": "<i2",
             "int32": "<i4", "int64": "<i8", "uint8": "u1", "bool": "?"}
ITEMSIZE = {name: np.dtype(code).itemsize for name, code in _NP_CODES.items()} | {"bfloat16": 2}
_NP_NAMES = {np.dtype(code): name for name, code in _NP_CODES.items()}
_CLIENT_ARENA_BYTES = 8 << 20


# =========================================================================== errors


class ServerError(PhyrtError):
    """The server answered a request with an error ``{type, message}``."""

    type = "ServerError"
    #: the id of the request it answers (None when the server could not tell)
    request_id: Any = None

    @classmethod
    def for_request(cls, message: str, request_id: Any) -> "ServerError":
        # one constructor argument only: TimeoutError (an OSError) reads two as errno, strerror
        error = cls(message)
        error.request_id = request_id
        return error


class InvalidRequestError(ServerError, ValueError):
    type = "InvalidRequest"


class DeadlineExceededError(ServerError, TimeoutError):
    type = "DeadlineExceeded"


class OverloadedError(ServerError):
    """More requests were in flight than the server's ``--max-inflight``; retry later."""

    type = "Overloaded"


class PluginError(ServerError):
    type = "PluginError"


class ServerUnavailableError(ServerError, EngineUnavailableError):
    """The server's engine cannot serve (closed, shutting down, no healthy replica)."""

    type = "EngineUnavailable"


class ConnectionLostError(ServerUnavailableError):
    """The connection to the server was lost with the request in flight (client side)."""

    type = "ConnectionLost"


_ERROR_CLASSES = {cls.type: cls for cls in (InvalidRequestError, DeadlineExceededError, OverloadedError,
                                            PluginError, ServerUnavailableError)}


def error_from_reply(error: Any, request_id: Any = None) -> ServerError:
    if not isinstance(error, dict):
        return ServerError.for_request(f"malformed error reply: {error!r}"[:500], request_id)
    kind, message = str(error.get("type")), str(error.get("message"))
    cls = _ERROR_CLASSES.get(kind)
    if cls is None:
        return ServerError.for_request(f"{kind}: {message}", request_id)
    return cls.for_request(message, request_id)


# =========================================================================== wire format


def is_request_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0 <= value < 2**64
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def tensor_parts(obj: Any) -> tuple[str, list[int], np.ndarray] | None:
    """(dtype name, shape, C-contiguous numpy array of the bytes) for a tensor, else None.

    bfloat16 torch tensors come back as their int16 bit pattern.
    """
    if isinstance(obj, np.ndarray):
        shape = list(obj.shape)
        arr = obj.astype(obj.dtype.newbyteorder("<")) if obj.dtype.byteorder == ">" else obj
        name = _NP_NAMES.get(arr.dtype)
        if name is None:
            raise TypeError(f"dtype {obj.dtype} cannot be sent; allowed: {sorted(ITEMSIZE)}")
        return name, shape, np.ascontiguousarray(arr)
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    t = obj.detach()
    if t.layout != torch.strided:
        raise TypeError(f"only dense tensors can be sent, got layout {t.layout}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise TypeError(f"dtype {t.dtype} cannot be sent; allowed: {sorted(ITEMSIZE)}")
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return name, list(t.shape), (t.view(torch.int16) if name == "bfloat16" else t).numpy()


class PayloadEncoder:
    """Turns a payload into msgpack-ready data; tensors go to ``frames`` or shared memory.

    ``copy=True`` snapshots every tensor (a caller may change its array once submit
    returns); ``place(nbytes)`` returns ``(segment, offset, view)`` or None.
    """

    def __init__(self, *, copy: bool, place: Callable[[int], tuple[str, int, memoryview] | None] | None = None,
                 shm_threshold: int = DEFAULT_SHM_THRESHOLD) -> None:
        self.copy = copy
        self.place = place
        self.shm_threshold = shm_threshold
        self.frames: list[Any] = []
        self.blocks: list[tuple[str, int]] = []

    def encode(self, obj: Any, path: str = "payload", depth: int = 0) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        if depth >= MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, dict):
            out = {}
            for key, value in obj.items():
                if not isinstance(key, str):
                    raise TypeError(f"{path}: map keys must be str, got {key!r}")
                out[key] = self.encode(value, f"{path}.{key}", depth + 1)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.encode(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
        parts = tensor_parts(obj)
        if parts is not None:
            return self._tensor(*parts)
        if isinstance(obj, (np.bool_, np.integer, np.floating)):
            return obj.item()
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        raise TypeError(f"{path}: cannot send a {type(obj).__name__}")

    def _tensor(self, name: str, shape: list[int], arr: np.ndarray) -> msgpack.ExtType:
        flat = arr.reshape(-1).view(np.uint8)
        if self.place is not None and flat.nbytes >= self.shm_threshold:
            placed = self.place(flat.nbytes)
            if placed is not None:
                segment, offset, view = placed
                self.blocks.append((segment, offset))
                np.frombuffer(view, dtype=np.uint8)[:] = flat
                return msgpack.ExtType(EXT_SHM, msgpack.packb([segment, offset, name, shape]))
        if len(self.frames) >= MAX_TENSOR_FRAMES:
            raise ValueError(f"a message carries at most {MAX_TENSOR_FRAMES} tensors as frames")
        self.frames.append(flat.tobytes() if self.copy else memoryview(flat))
        return msgpack.ExtType(EXT_FRAME, msgpack.packb([name, shape, len(self.frames) - 1]))


def pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


@dataclass(frozen=True)
class _Ext:
    """A tensor reference as it was read, resolved by ``TensorResolver`` afterwards."""

    code: int
    data: bytes


def _no_timestamps(obj: Any) -> None:
    if isinstance(obj, msgpack.Timestamp):
        raise ProtocolError("msgpack timestamps are not allowed")


def _str_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a map has duplicate keys")
    for key, value in pairs:
        if not isinstance(key, str):
            raise ProtocolError(f"map keys must be str, got {type(key).__name__}")
        _no_timestamps(value)
    return out


def _checked_list(items: list[Any]) -> list[Any]:
    for item in items:
        _no_timestamps(item)
    return items


def _unpackb(data: Any, ext_hook: Callable[[int, bytes], Any]) -> Any:
    # unpackb on one whole frame, every length bounded by the frame: a forged length
    # fails at once instead of allocating (a streaming Unpacker would wait for more)
    n = memoryview(data).nbytes
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=_str_map,
                           list_hook=_checked_list, ext_hook=ext_hook, max_str_len=n, max_bin_len=n,
                           max_array_len=n, max_map_len=n, max_ext_len=n)


def unpack_header(data: Any, max_bytes: int) -> dict[str, Any]:
    """Decode a header frame; tensors stay ``_Ext`` placeholders. ProtocolError if malformed."""
    n = memoryview(data).nbytes
    if n > max_bytes:
        raise ProtocolError(f"header frame of {n} bytes exceeds the limit of {max_bytes}")
    try:
        msg = _unpackb(data, _Ext)
    except ProtocolError:
        raise
    except Exception as exc:  # untrusted input: any failure to decode is a protocol failure
        raise ProtocolError(f"malformed header: {type(exc).__name__}: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"a header must be a msgpack map, got {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION or isinstance(msg.get("v"), bool):
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not {PROTOCOL_VERSION}, the one this side speaks")
    return msg


def _check_shape(shape: Any) -> list[int]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolError(f"tensor shape must be a list of at most {MAX_NDIM} ints, got {shape!r}"[:300])
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < 2**40:
            raise ProtocolError(f"tensor shape entries must be ints in [0, 2**40), got {shape!r}"[:300])
    return shape


def _check_dtype(name: Any) -> str:
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise ProtocolError(f"tensor dtype {name!r} is not allowed; allowed: {sorted(ITEMSIZE)}"[:300])
    return name


class TensorResolver:
    """Replaces ``_Ext`` placeholders by tensors built with ``make(buffer, dtype, shape)``.

    ``frames``: the message's tensor frames; ``shm_view(segment, offset, nbytes)``
    returns a bounds-checked view or raises ProtocolError (None: shm refused).
    """

    def __init__(self, frames: Sequence[Any], make: Callable[[memoryview, str, list[int]], Any],
                 shm_view: Callable[[str, int, int], memoryview] | None = None) -> None:
        self.frames = frames
        self.make = make
        self.shm_view = shm_view
        self.used = [False] * len(frames)
        self.shm_blocks: list[tuple[str, int]] = []

    def resolve(self, obj: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, _Ext):
            return self._tensor(obj)
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(value, (_Ext, dict, list)):
                    obj[key] = self.resolve(value, depth + 1)
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                if isinstance(value, (_Ext, dict, list)):
                    obj[i] = self.resolve(value, depth + 1)
        return obj

    def finish(self) -> None:
        unused = [i for i, used in enumerate(self.used) if not used]
        if unused:
            raise ProtocolError(f"tensor frames {unused[:8]} are not referenced by the header")

    def _tensor(self, ext: _Ext) -> Any:
        try:
            body = _unpackb(ext.data, _reject_ext)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"malformed tensor reference: {type(exc).__name__}: {exc}") from None
        if ext.code == EXT_FRAME:
            if not isinstance(body, list) or len(body) != 3:
                raise ProtocolError("a frame tensor must be [dtype, shape, index]")
            name, shape, index = _check_dtype(body[0]), _check_shape(body[1]), body[2]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.frames):
                raise ProtocolError(f"tensor frame index {index!r} is out of range ({len(self.frames)} frames)"[:300])
            if self.used[index]:
                raise ProtocolError(f"tensor frame {index} is referenced twice")
            self.used[index] = True
            buf = _buffer(self.frames[index])
            nbytes = math.prod(shape) * ITEMSIZE[name]
            if buf.nbytes != nbytes:
                raise ProtocolError(f"tensor of shape {shape} and dtype {name} needs {nbytes} bytes, "
                                    f"frame {index} has {buf.nbytes}")
        elif ext.code == EXT_SHM:
            if not isinstance(body, list) or len(body) != 4:
                raise ProtocolError("a shared-memory tensor must be [segment, offset, dtype, shape]")
            segment, offset = body[0], body[1]
            name, shape = _check_dtype(body[2]), _check_shape(body[3])
            if not isinstance(segment, str) or isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ProtocolError(f"bad shared-memory reference {body!r}"[:300])
            if offset % ITEMSIZE[name]:
                raise ProtocolError(f"offset {offset} is not aligned to the {name} element size")
            if self.shm_view is None:
                raise ProtocolError("a shared-memory tensor arrived, but this connection has none registered")
            nbytes = math.prod(shape) * ITEMSIZE[name]
            buf = self.shm_view(segment, offset, nbytes)
            self.shm_blocks.append((segment, offset))
        else:
            raise ProtocolError(f"unknown extension type {ext.code}")
        if name == "bool" and nbytes and np.frombuffer(buf, dtype=np.uint8).max() > 1:
            raise ProtocolError("a bool tensor holds bytes other than 0 and 1")
        return self.make(buf, name, shape)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"extension type {code} is not allowed inside a tensor reference")


def _buffer(frame: Any) -> memoryview:
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def numpy_tensor(buf: memoryview, name: str, shape: list[int]) -> np.ndarray:
    """A writable copy the caller owns."""
    if name == "bfloat16":
        raise ProtocolError("bfloat16 has no numpy dtype; use Client(..., tensor_type='torch')")
    return np.frombuffer(buf, dtype=_NP_CODES[name], count=math.prod(shape)).reshape(shape).copy()


def torch_tensor(buf: memoryview, name: str, shape: list[int]) -> Any:
    import torch

    if name == "bfloat16":
        if not math.prod(shape):
            return torch.empty(shape, dtype=torch.bfloat16)
        return torch.frombuffer(bytearray(buf), dtype=torch.bfloat16).reshape(shape)
    return torch.from_numpy(numpy_tensor(buf, name, shape))


# =========================================================================== client


@dataclass
class _Pending:
    future: Future
    op: str
    sent_at: float
    blocks: list[tuple[str, int]] = field(default_factory=list)
    session: "_ShmSession | None" = None


class _ShmSession:
    """One server instance's shared memory on this client: our input arena, its result arena."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.run_id = new_run_id()
        self.arena: ShmArena | None = None
        self.registered: set[str] = set()
        self.result_mapper: ShmMapper | None = None
        self.refused = False
        self.closed = False

    def free(self, blocks: list[tuple[str, int]]) -> None:
        if self.arena is not None:
            for segment, offset in blocks:
                self.arena.free(segment, offset)  # a no-op once the arena is closed

    def result_view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        if self.result_mapper is None:
            raise ProtocolError("a shared-memory result arrived before this client registered")
        return self.result_mapper.view(segment, offset, nbytes)

    def close(self) -> None:
        self.closed = True
        if self.arena is not None:
            self.arena.close()
        if self.result_mapper is not None:
            self.result_mapper.close()


def _load_key(value: str | bytes | None, secret: bool) -> bytes | None:
    """A CURVE key: 40 z85 characters, or a key file of ``zmq.auth.create_certificates``."""
    if value is None:
        return None
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) == 40:
        return raw
    import zmq.auth

    public, secret_key = zmq.auth.load_certificate(os.fsdecode(raw))
    key = secret_key if secret else public
    if key is None:
        raise ValueError(f"{os.fsdecode(raw)} holds no secret key")
    return key


class Client:
    """A thread-safe connection to a phyrt server.

    ``submit`` returns a ``concurrent.futures.Future`` at once and never waits on the
    network, so it is safe inside a ROS callback. Results hold numpy arrays, or torch
    tensors with ``tensor_type="torch"``. ``shm`` (default: on for ipc://) sends
    tensors of at least ``shm_threshold`` bytes through shared memory. CURVE:
    ``server_public_key`` plus this client's ``public_key``/``secret_key`` (z85 text
    or key files); without them the client speaks plain ZMQ.
    """

    def __init__(self, address: str, *, tensor_type: str = "numpy", shm: bool | None = None,
                 shm_threshold: int = DEFAULT_SHM_THRESHOLD, heartbeat_interval_s: float = 1.0,
                 heartbeat_timeout_s: float = 5.0, server_public_key: str | bytes | None = None,
                 public_key: str | bytes | None = None, secret_key: str | bytes | None = None) -> None:
        if not isinstance(address, str) or "://" not in address:
            raise ValueError(f"address must look like ipc:///path or tcp://host:port, got {address!r}")
        if tensor_type not in ("numpy", "torch"):
            raise ValueError(f'tensor_type must be "numpy" or "torch", got {tensor_type!r}')
        if not 0 < heartbeat_interval_s < heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s, got "
                             f"{heartbeat_interval_s} and {heartbeat_timeout_s}")
        self.address = address
        self._make = torch_tensor if tensor_type == "torch" else numpy_tensor
        self._shm = address.startswith("ipc://") and shm is not False
        self._shm_threshold = shm_threshold
        self._hb_interval = heartbeat_interval_s
        self._hb_timeout = heartbeat_timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()  # pending, outbox order, closed
        self._shm_lock = threading.Lock()  # the session and its arena
        self._pending: dict[int, _Pending] = {}
        self._held: dict[int, tuple[_ShmSession, list[tuple[str, int]]]] = {}
        self._outbox: collections.deque[list[Any]] = collections.deque()
        self._session: _ShmSession | None = None
        self._server_id: str | None = None
        self._last_heard = time.monotonic()
        self._closed = False
        self._broken: str | None = None  # why the I/O thread died, if it did
        if self._shm:
            sweep_stale()  # names left by phyrt processes that were killed

        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket | None = None
        success = False
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)  # replies are never dropped on this side
            self._sock.setsockopt(zmq.SNDHWM, 100_000)
            self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if server_public_key is not None:
                self._sock.curve_serverkey = _load_key(server_public_key, secret=False)
                own_secret = _load_key(secret_key, secret=True)
                if own_secret is None:
                    raise ValueError("CURVE needs this client's secret_key too (public_key is derived from it)")
                self._sock.curve_secretkey = own_secret
                self._sock.curve_publickey = _load_key(public_key, secret=False) or zmq.curve_public(own_secret)
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            self._sock.connect(address)
            success = True
        finally:
            if not success:
                if self._monitor is not None:
                    self._monitor.close(0)
                self._sock.close(0)
                self._ctx.term()
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="phyrt-client", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------

    def submit(self, payload: Any, *, timeout: float | None = None) -> Future:
        """Send one request; the Future gets the result, or a ``ServerError`` subclass.

        ``timeout`` (seconds) is the request's deadline on the server: past it the
        Future fails with ``DeadlineExceededError``. ``future.cancel()`` also asks
        the server to drop the request if it is still queued.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self._check_open()
        request_id = next(self._ids)
        session = self._session
        place = None if session is None else (lambda nbytes: self._place(session, nbytes))
        encoder = PayloadEncoder(copy=True, place=place, shm_threshold=self._shm_threshold)
        try:
            header = {"v": PROTOCOL_VERSION, "op": "submit", "id": request_id, "payload": encoder.encode(payload)}
        except BaseException:
            if session is not None:
                session.free(encoder.blocks)
            raise
        if timeout is not None:
            header["timeout_s"] = float(timeout)
        if session is not None and session.result_mapper is not None:
            header["shm_results"] = True
        future: Future = Future()
        future.request_id = request_id  # type: ignore[attr-defined]  # for Client.cancel
        self._send(request_id, _Pending(future, "submit", time.monotonic(), encoder.blocks, session),
                   [pack_header(header), *encoder.frames])
        future.add_done_callback(self._on_future_done)
        return future

    def call(self, payload: Any, timeout: float | None = None) -> Any:
        """``submit(payload, timeout=timeout).result(timeout)``; raises DeadlineExceededError on time-out."""
        future = self.submit(payload, timeout=timeout)
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            if future.done() and not future.cancelled():
                return future.result()
            future.cancel()
            raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                    future.request_id) from None  # type: ignore[attr-defined]

    def cancel(self, future: Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a submitted request; True if it was still queued and is dropped."""
        request_id = getattr(future, "request_id", None)
        if request_id is None:
            raise ValueError("not a future returned by this client's submit()")
        reply = self._control("cancel", target=request_id).result(timeout)
        return bool(reply.get("cancelled")) if isinstance(reply, dict) else False

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time to the server's I/O thread, in seconds."""
        started = time.monotonic()
        self._control("ping").result(timeout)
        return time.monotonic() - started

    def info(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's plugin, topology, replicas (health, in flight) and versions."""
        return self._control("info").result(timeout)

    def close(self) -> None:
        """Fail what is in flight, stop the I/O thread, release sockets and segments. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, {}
        self._wake()
        self._thread.join(10)
        for p in pending.values():
            _resolve(p.future, error=ConnectionLostError(f"the client of {self.address} was closed"))
        with self._shm_lock:
            if self._session is not None:
                self._session.close()
                self._session = None
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = None
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLostError(f"the client of {self.address} is closed")

    def _control(self, op: str, **fields: Any) -> Future:
        self._check_open()
        request_id = next(self._ids)
        future: Future = Future()
        self._send(request_id, _Pending(future, op, time.monotonic()),
                   [pack_header({"v": PROTOCOL_VERSION, "op": op, "id": request_id, **fields})])
        return future

    def _send(self, request_id: int, pending: _Pending, frames: list[Any]) -> None:
        with self._lock:
            if self._closed or self._broken:
                if pending.session is not None:
                    pending.session.free(pending.blocks)
                raise ConnectionLostError(f"the client of {self.address} is {self._broken or 'closed'}")
            self._pending[request_id] = pending
            self._outbox.append(frames)
        self._wake()

    def _place(self, session: _ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of our arena for a request tensor; registers a new segment before its first use."""
        with self._shm_lock:
            if session is not self._session or session.closed or session.refused or session.result_mapper is None:
                return None
            if session.arena is None:
                session.arena = ShmArena(session.run_id, max(_CLIENT_ARENA_BYTES, 2 * nbytes))
            segment, offset, view = session.arena.place(nbytes)
            if segment not in session.registered:
                # queued under the shm lock: no request using this segment can be queued before it
                session.registered.add(segment)
                self._outbox.append([pack_header({"v": PROTOCOL_VERSION, "op": "register", "id": "register",
                                                  "run_id": session.run_id, "segments": [segment]})])
            return segment, offset, view

    def _on_future_done(self, future: Future) -> None:
        if future.cancelled() and not self._closed:
            request_id = future.request_id  # type: ignore[attr-defined]
            if request_id in self._pending:  # still in flight: ask the server to drop it
                self._outbox.append([pack_header({"v": PROTOCOL_VERSION, "op": "cancel", "id": "cancel",
                                                  "target": request_id})])
                self._wake()

    def _wake(self) -> None:
        with self._wake_lock:  # never write to the descriptor number after close() gave it back
            if self._wake_w is not None:
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                    pass

    # -- the I/O thread -------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._closed:
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(now)
                    next_beat = now + self._hb_interval
                events = dict(poller.poll(max(0.0, next_beat - now) * 1000 + 1))
                if self._wake_r in events:
                    _drain_pipe(self._wake_r)
                self._flush_outbox()
                if self._sock in events:
                    self._drain_replies()
                if self._monitor in events:
                    self._drain_monitor()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            log.exception("the client's I/O thread failed")
            self._broken = f"the client's I/O thread failed: {exc!r}"
            self._connection_lost(self._broken)
        finally:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    def _flush_outbox(self) -> None:
        while self._outbox:
            frames = self._outbox.popleft()
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._fail_unsent(frames, "the send queue to the server is full (is it reachable?)")

    def _fail_unsent(self, frames: list[Any], reason: str) -> None:
        try:
            request_id = unpack_header(frames[0], 1 << 30).get("id")
        except ProtocolError:
            return
        with self._lock:
            p = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if p is not None:
            if p.session is not None:
                p.session.free(p.blocks)
            _resolve(p.future, error=ConnectionLostError.for_request(f"{reason}: {self.address}", request_id))

    def _heartbeat(self, now: float) -> None:
        try:
            self._sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "ping", "id": "heartbeat"}), zmq.NOBLOCK)
        except zmq.Again:
            pass
        with self._lock:
            silent = [(i, p) for i, p in self._pending.items()
                      if now - max(p.sent_at, self._last_heard) > self._hb_timeout]
            for request_id, _ in silent:
                del self._pending[request_id]
        for request_id, p in silent:
            if p.blocks and p.session is not None:  # the server may still read them: wait for its word
                self._held[request_id] = (p.session, p.blocks)
            _resolve(p.future, error=ConnectionLostError.for_request(
                f"no word from the server at {self.address} for more than {self._hb_timeout} s "
                f"(heartbeat_timeout_s) while request {request_id} was in flight", request_id))

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                self._handle_reply(frames)
            except ProtocolError as exc:
                log.warning("dropped a malformed reply from %s: %s", self.address, exc)

    def _handle_reply(self, frames: list[zmq.Frame]) -> None:
        header = unpack_header(frames[0].buffer, 1 << 30)
        op, request_id = header.get("op"), header.get("id")
        if op == "ping" and header.get("ok") and isinstance(header.get("result"), dict):
            self._on_server_id(header["result"].get("server_id"))
        if op == "register":
            self._on_registered(header)
            return
        if op == "inputs_done":
            held = self._held.pop(request_id, None)
            if held is not None:
                held[0].free(held[1])
            return
        with self._lock:
            p = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        session = self._session
        resolver = TensorResolver(frames[1:], self._make, session.result_view if session is not None else None)
        try:
            result = resolver.resolve(header.get("result"))
            resolver.finish()
        except ProtocolError as exc:
            result, error = None, exc
        else:
            error = None
        if resolver.shm_blocks:  # copied out: the server may reuse them, and unlink a segment we mapped
            self._sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "release", "id": "release",
                                         "blocks": [list(b) for b in resolver.shm_blocks]}), zmq.NOBLOCK)
        if p is None:  # failed here already; free its inputs once the server is done with them
            held = self._held.pop(request_id, None) if isinstance(request_id, int) else None
            if held is not None and header.get("inputs_held") is True:
                self._held[request_id] = held
            elif held is not None:
                held[0].free(held[1])
            return
        if p.blocks and p.session is not None:
            if header.get("inputs_held") is True:
                self._held[request_id] = (p.session, p.blocks)
            else:
                p.session.free(p.blocks)
        if error is None and header.get("ok") is not True:
            err = header.get("error")
            if isinstance(err, dict) and err.get("type") == "Cancelled":
                if not p.future.cancel():
                    _resolve(p.future, error=ServerError.for_request(f"Cancelled: {err.get('message')}", request_id))
                return
            error = error_from_reply(err, request_id)
        _resolve(p.future, result=result, error=error)

    def _on_server_id(self, server_id: Any) -> None:
        if not isinstance(server_id, str) or server_id == self._server_id:
            return
        if self._server_id is not None:
            self._connection_lost(f"the server at {self.address} restarted")
        self._server_id = server_id
        if self._shm:
            with self._shm_lock:
                self._session = _ShmSession(server_id)
                self._sock.send(pack_header({"v": PROTOCOL_VERSION, "op": "register", "id": "register",
                                             "run_id": self._session.run_id, "segments": [],
                                             "pid": os.getpid()}), zmq.NOBLOCK)

    def _on_registered(self, header: dict[str, Any]) -> None:
        result = header.get("result")
        with self._shm_lock:
            session = self._session
            if session is None or not isinstance(result, dict) or result.get("run_id") != session.run_id:
                if session is not None and header.get("ok") is not True:
                    session.refused = True
                    log.warning("the server at %s refused shared memory (%s); tensors go as frames",
                                self.address, header.get("error"))
                return
            if session.result_mapper is None and isinstance(result.get("result_run_id"), str):
                session.result_mapper = ShmMapper(result["result_run_id"])
            for segment in result.get("mapped") or []:
                if session.arena is not None and segment in session.arena.segments:
                    session.arena.unlink(segment)  # the server unlinked it already; this makes sure

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                self._connection_lost(f"the connection to the server at {self.address} was lost")
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                log.warning("handshake with %s failed (CURVE keys?): event %s", self.address, kind)

    def _connection_lost(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        with self._shm_lock:
            session, self._session = self._session, None
        self._server_id = None
        self._held.clear()
        for request_id, p in pending.items():
            _resolve(p.future, error=ConnectionLostError.for_request(
                f"{reason} while request {request_id} was in flight (the client reconnects by itself; "
                "send it again)", request_id))
        if session is not None:
            session.close()
            sweep_stale()  # the server's unreleased result segments, if it was killed


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless something already did (never twice, never raising)."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except Exception:  # lost a race with a canceller
        pass


# =========================================================================== asyncio


class AsyncClient:
    """``Client`` for asyncio: the same verbs, awaitable. Takes ``Client``'s keyword arguments.

    Cancelling an awaited ``submit`` also asks the server to drop the request if it
    is still queued.
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        self._client = Client(address, **kwargs)
        self.address = address
        self._sources: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def submit(self, payload: Any, *, timeout: float | None = None) -> asyncio.Future:
        """Send one request from the running loop; await the returned future for the result."""
        source = self._client.submit(payload, timeout=timeout)
        future = asyncio.wrap_future(source)
        self._sources[future] = source
        return future

    async def call(self, payload: Any, timeout: float | None = None) -> Any:
        future = self._client.submit(payload, timeout=timeout)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except DeadlineExceededError:
            raise
        except asyncio.TimeoutError:
            raise DeadlineExceededError.for_request(f"no result within {timeout} s from {self.address}",
                                                    future.request_id) from None  # type: ignore[attr-defined]

    async def cancel(self, future: asyncio.Future, timeout: float = 5.0) -> bool:
        """Ask the server to cancel a request from ``submit``; True if it was still queued."""
        source = self._sources.get(future)
        if source is None:
            raise ValueError("cancel() takes a future returned by this AsyncClient's submit()")
        return await asyncio.to_thread(self._client.cancel, source, timeout)

    async def ping(self, timeout: float = 5.0) -> float:
        started = time.monotonic()
        await asyncio.wait_for(asyncio.wrap_future(self._client._control("ping")), timeout)
        return time.monotonic() - started

    async def info(self, timeout: float = 5.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.wrap_future(self._client._control("info")), timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
