"""The client/server protocol: frames, tensor references, and their validation.

Leaf module: imports nothing from the project but ``runtime.core.errors``; needs
msgpack, numpy and pyzmq only (torch is imported lazily, by ``torch_tensor`` and
``torch_view``, or used when a caller hands in torch tensors), so that the
torch-free ``runtime.client`` and the ``runtime.serving.server`` speak it from one place.

    sender                                            receiver
    PayloadEncoder.encode(payload)                    unpack_header(frame 0): a checked map,
      tensor -> frame (ext 1) or shm block (ext 2)      tensors still placeholders
    pack_header(header)                               TensorResolver.resolve(...) -> tensors,
    [header, *encoder.frames]  ---------------->        finish(): every frame used once

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

    submit    payload, [timeout_s: seconds, the request's deadline], [shm_results: bool],
              [release: blocks, as a release's; freed once the request is answered or queued]
    cancel    target: the id of a submit (only a request still queued on an inline
              engine can be cancelled; local replicas run what they were sent)
    ping      -                       -> {server_id, time}
    info      -                       -> plugin, topology, replicas' health and
                                         in-flight counts, versions, limits
    register  run_id, segments, [pid] -> {run_id, result_run_id, mapped}   (ipc:// only)
    release   blocks: [[segment, offset], ...]   (no reply)

Replies (server -> client): ``{"v": 1, "op": OP, "id": ID, "ok": true, "result": ...}``
or ``{..., "ok": false, "error": {"type": T, "message": M}}`` with T one of
``ERROR_TYPES`` (the exception types are in ``runtime.client.errors``). A message
that cannot be parsed gets ``op`` and ``id`` null. A submit reply may carry
``inputs_held: true`` (see below). The server may also send
``{"op": "inputs_done", "id": ID}`` unasked.

Same-host shared memory (ipc:// only). Inputs: the client creates segments in its
own ``ShmArena`` (run id of its own) and registers each one before the first request
that refers to it; the server maps only the segments that connection registered,
checks every offset and size, and unlinks each name right after mapping it, so a
crash of either side leaves nothing in /dev/shm. A block is reused only once the
server is done with it: at the request's reply, or, if that reply said
``inputs_held`` (a deadline fired while the plugin still read the block), at
``inputs_done``. Results: with ``shm_results`` the server places large result
tensors in an arena it keeps for that connection, and never touches a block again
until the client sends its ``release``; the client hands the caller views of the
blocks (no copy) and gives them back once those are collected: in its next submit's
``release`` field, or as a ``release`` sent before its next other message, at the latest
with its next heartbeat. A release's first use of a
segment also tells the server the client has mapped it, so the server unlinks
that name. The server drops a connection's shared memory (and unlinks what is
left) when the ``pid`` it registered with is gone, or after ``client_timeout_s`` of
silence (the client pings every heartbeat interval).

Decoding treats its input as untrusted: every failure raises ``ProtocolError``.

Speed. A small request pays for its encoding and decoding four times per round trip,
so both have a fast path that leaves the walk to msgpack's C code and keeps every
check of the slow one. Encoding (``PayloadEncoder.pack``): ``_packable`` looks at
the containers only (str keys, depth, no type the wire forbids; a list of plain
scalars costs one C-level type scan), then msgpack packs with ``default=`` handing
over the tensors and numpy scalars; anything else goes down the slow path, which
names the path of what it rejects. The packed payload is spliced into its header
(``Packed``), not packed twice. Decoding: without a Timestamp's bytes anywhere in
the frame (``_TIMESTAMP``, every encoding msgpack accepts) only the map hook runs
(duplicate keys; bytes keys only where a bin can be); otherwise every map and list
is checked as before.
The dtype table and the dtype check are the same as ``runtime.transport.wire``'s, which keeps
them private; the shape check differs on purpose (entries below 2**40 here).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
import zmq

from runtime.transport import bulk_copy
from runtime.core.errors import ProtocolError

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


def is_request_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0 <= value < 2**64
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


# --------------------------------------------------------------------------- encoding


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

    def pack(self, obj: Any, path: str = "payload") -> "Packed":
        """``encode`` and msgpack in one: the bytes of ``obj``, tensors to ``frames`` or shared memory.

        The same result, and the same errors, as ``msgpack.packb(self.encode(obj))``.
        """
        if isinstance(obj, (dict, list, tuple)) and _packable(obj, 0):
            frames = len(self.frames)
            try:
                return Packed(msgpack.packb(obj, use_bin_type=True, default=self._leaf))
            except Exception:  # say where, and what, from the slow path (blocks stay listed for free)
                del self.frames[frames:]
        return Packed(msgpack.packb(self.encode(obj, path), use_bin_type=True))

    def _leaf(self, obj: Any) -> Any:
        """msgpack's ``default=``: what ``encode`` makes of a value msgpack cannot pack itself."""
        parts = tensor_parts(obj)
        if parts is not None:
            return self._tensor(*parts)
        if isinstance(obj, (np.bool_, np.integer, np.floating)):
            return obj.item()
        raise TypeError(f"cannot send a {type(obj).__name__}")

    def _tensor(self, name: str, shape: list[int], arr: np.ndarray) -> msgpack.ExtType:
        flat = arr.reshape(-1).view(np.uint8)
        if self.place is not None and flat.nbytes >= self.shm_threshold:
            placed = self.place(flat.nbytes)
            if placed is not None:
                segment, offset, view = placed
                self.blocks.append((segment, offset))
                bulk_copy.copy(np.frombuffer(view, dtype=np.uint8), flat)
                return msgpack.ExtType(EXT_SHM, msgpack.packb([segment, offset, name, shape]))
        if len(self.frames) >= MAX_TENSOR_FRAMES:
            raise ValueError(f"a message carries at most {MAX_TENSOR_FRAMES} tensors as frames")
        self.frames.append(flat.tobytes() if self.copy else memoryview(flat))
        return msgpack.ExtType(EXT_FRAME, msgpack.packb([name, shape, len(self.frames) - 1]))


class Packed:
    """msgpack bytes of one value (``PayloadEncoder.pack``), spliced into a header by ``pack_header``."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


#: the header fields that may hold a ``Packed`` value, and their msgpack bytes
_PACKED_FIELDS = {key: msgpack.packb(key) for key in ("payload", "result")}


def pack_header(header: dict[str, Any]) -> bytes:
    """msgpack bytes of a header; a ``Packed`` payload or result is spliced in as it is."""
    for key, packed_key in _PACKED_FIELDS.items():
        value = header.get(key)
        if type(value) is Packed:
            rest = header.copy()
            del rest[key]
            if len(header) > 15:  # a fixmap: its first byte holds its size
                raise ValueError("a header with a packed field holds at most 15 fields")
            return b"".join((bytes((0x80 | len(header),)), msgpack.packb(rest, use_bin_type=True)[1:],
                             packed_key, value.data))
    return msgpack.packb(header, use_bin_type=True)


_STR = frozenset({str})
#: exact types msgpack packs as they are
_PLAIN = frozenset({str, int, float, bool, type(None), bytes})
#: what the slow path converts (a subclass, a strided memoryview) or refuses (ExtType, Timestamp)
_SLOW = (dict, list, tuple, memoryview, bytearray, msgpack.ExtType, msgpack.Timestamp)


def _packable(obj: dict | list | tuple, depth: int) -> bool:
    """Whether msgpack, with ``PayloadEncoder._leaf`` as ``default=``, packs ``obj`` (at ``depth``)
    exactly as ``encode`` then ``packb`` would. Looks at containers only; False: the slow path."""
    if depth >= MAX_DEPTH - 1:  # the slow path counts the levels of every value
        return False
    t = type(obj)
    if t is dict:
        if not _STR.issuperset(map(type, obj)):
            return False
        values: Any = obj.values()
    elif t is list or t is tuple:
        values = obj
    else:
        return False
    if _PLAIN.issuperset(map(type, values)):  # a vector of numbers: one C-level scan
        return True
    for value in values:
        t = type(value)
        if t in _PLAIN:
            continue
        if t is dict or t is list or t is tuple:
            if not _packable(value, depth + 1):
                return False
        elif issubclass(t, _SLOW):
            return False
    return True


# --------------------------------------------------------------------------- decoding


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


def _unique_map(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The map hook where no key can be bytes (no bin in the frame) and no value a Timestamp."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a map has duplicate keys")
    return out


def _str_key_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The map hook where no value can be a Timestamp (strict_map_key lets through str and bytes only)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a map has duplicate keys")
    if bytes in map(type, out):
        raise ProtocolError(f"map keys must be str, got {next(k for k in out if type(k) is not str)!r}")
    return out


#: every encoding of a msgpack Timestamp (extension -1 of 4, 8 or 12 bytes), which msgpack
#: decodes without asking ext_hook; bytes like these inside a str or bin only cost the slow path
_TIMESTAMP = re.compile(rb"[\xd6\xd7]\xff|\xc7[\x04\x08\x0c]\xff|\xc8\x00[\x04\x08\x0c]\xff"
                        rb"|\xc9\x00\x00\x00[\x04\x08\x0c]\xff")
_SCAN_COPY_LIMIT = 4096


def _unpackb(data: Any, ext_hook: Callable[[int, bytes], Any]) -> Any:
    # unpackb on one whole frame, every length bounded by the frame: a forged length
    # fails at once instead of allocating (a streaming Unpacker would wait for more)
    if type(data) is not bytes:
        view = memoryview(data)
        if view.nbytes <= _SCAN_COPY_LIMIT and view.c_contiguous:
            data = view.tobytes()
    n = memoryview(data).nbytes
    if type(data) is bytes and (0xFF not in data or _TIMESTAMP.search(data) is None):
        bins = 0xC4 in data or 0xC5 in data or 0xC6 in data
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                               object_pairs_hook=_str_key_map if bins else _unique_map, ext_hook=ext_hook,
                               max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n)
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=_str_map,
                           list_hook=_checked_list, ext_hook=ext_hook, max_str_len=n, max_bin_len=n,
                           max_array_len=n, max_map_len=n, max_ext_len=n)


def unpack_header(data: Any, max_bytes: int, refs: list | None = None) -> dict[str, Any]:
    """Decode a header frame; tensors stay ``_Ext`` placeholders. ProtocolError if malformed.

    ``refs``: a list that gets every placeholder, so that a caller can skip
    ``TensorResolver`` when there is none.
    """
    n = memoryview(data).nbytes
    if n > max_bytes:
        raise ProtocolError(f"header frame of {n} bytes exceeds the limit of {max_bytes}")
    if refs is None:
        hook: Callable[[int, bytes], Any] = _Ext
    else:
        def hook(code: int, body: bytes) -> _Ext:
            ext = _Ext(code, body)
            refs.append(ext)
            return ext
    try:
        msg = _unpackb(data, hook)
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
    returns a bounds-checked view or raises ProtocolError (None: shm refused);
    ``make_shm`` (default ``make``) builds the tensors of shared-memory references.
    """

    def __init__(self, frames: Sequence[Any], make: Callable[[memoryview, str, list[int]], Any],
                 shm_view: Callable[[str, int, int], memoryview] | None = None,
                 make_shm: Callable[[memoryview, str, list[int]], Any] | None = None) -> None:
        self.frames = frames
        self.make = make
        self.shm_view = shm_view
        self.make_shm = make if make_shm is None else make_shm
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
            _check_bools(buf, name, nbytes)
            return self.make_shm(buf, name, shape)
        else:
            raise ProtocolError(f"unknown extension type {ext.code}")
        _check_bools(buf, name, nbytes)
        return self.make(buf, name, shape)


def _check_bools(buf: memoryview, name: str, nbytes: int) -> None:
    if name == "bool" and nbytes and np.frombuffer(buf, dtype=np.uint8).max() > 1:
        raise ProtocolError("a bool tensor holds bytes other than 0 and 1")


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"extension type {code} is not allowed inside a tensor reference")


def _buffer(frame: Any) -> memoryview:
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def numpy_tensor(buf: memoryview, name: str, shape: list[int]) -> np.ndarray:
    """A writable copy the caller owns."""
    return numpy_view(buf, name, shape).copy()


def numpy_view(buf: memoryview, name: str, shape: list[int]) -> np.ndarray:
    """An array over ``buf`` itself, no copy: it keeps ``buf``'s exporter alive, and is
    writable if ``buf`` is."""
    if name == "bfloat16":
        raise ProtocolError("bfloat16 has no numpy dtype; use Client(..., tensor_type='torch')")
    return np.frombuffer(buf, dtype=_NP_CODES[name], count=math.prod(shape)).reshape(shape)


def torch_tensor(buf: memoryview, name: str, shape: list[int]) -> Any:
    """A writable copy the caller owns."""
    import torch

    if name == "bfloat16":
        if not math.prod(shape):
            return torch.empty(shape, dtype=torch.bfloat16)
        return torch.frombuffer(bytearray(buf), dtype=torch.bfloat16).reshape(shape)
    return torch.from_numpy(numpy_tensor(buf, name, shape))


def torch_view(buf: memoryview, name: str, shape: list[int]) -> Any:
    """A tensor over ``buf`` itself, no copy (``buf`` must be writable): it keeps ``buf``'s
    exporter alive, as ``numpy_view`` does."""
    import torch

    count = math.prod(shape)
    if name == "bfloat16":
        if not count:
            return torch.empty(shape, dtype=torch.bfloat16)
        return torch.frombuffer(buf, dtype=torch.bfloat16, count=count).reshape(shape)
    return torch.from_numpy(numpy_view(buf, name, shape))
