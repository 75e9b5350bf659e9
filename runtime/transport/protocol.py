"""The client/server protocol's frames: headers, tensor references, and their validation.

Leaf module: imports nothing from the project but ``runtime.core.errors``,
``runtime.transport.bulk_copy`` and the codec core (``codec``: dtypes, checks, msgpack's
fast paths, shared with ``runtime.transport.wire``); needs msgpack, numpy and pyzmq only
(torch is imported lazily, by ``torch_tensor`` and ``torch_view``, or used when a caller
hands in torch tensors), so that the torch-free ``runtime.client`` and the
``runtime.serving.server`` speak it from one place.

    sender                                            receiver
    PayloadEncoder.pack(payload)                      unpack_header(frame 0): a checked map,
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

dtypes: float16 float32 float64 bfloat16 int8 int16 int32 int64 uint8 bool. Shape entries
are ints in [0, 2**40) (the engine's wire allows larger ones); a message carries at most
MAX_TENSOR_FRAMES tensor frames.

The messages themselves (the ops, their fields and checks, the replies, the builders
of both sides) are ``runtime.link.client_protocol``'s; docs/protocol.md is the page a client
in another language is written from. This module is the frame codec under them: every header
carries ``v`` (``PROTOCOL_VERSION``, checked by ``unpack_header``) and an ``id``
(``is_request_id``). Shared memory (ipc:// only): a client registers its own segments, and
the server maps only those, checks every offset and size, and unlinks each name right after
mapping it (``runtime.link.session``, ``runtime.link.peer_shm``).

Decoding treats its input as untrusted: every failure raises ``ProtocolError``.

Speed. A small request pays for its encoding and decoding four times per round trip, so
both take the fast paths of ``codec`` (msgpack's C code walks the value, every check of
the slow path kept); ``PayloadEncoder.pack`` packs a payload once, and ``pack_header``
splices those bytes into the header (``Packed``) instead of packing them twice.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import numpy as np
import zmq

from runtime.core.errors import ProtocolError
from runtime.transport import bulk_copy, codec
from runtime.transport import tensor_fields
from runtime.transport.codec import MAX_DEPTH
from runtime.transport.tensor_fields import ITEMSIZE, MAX_NDIM, check_dtype

__all__ = ["PROTOCOL_VERSION", "EXT_FRAME", "EXT_SHM", "MAX_DEPTH", "MAX_NDIM", "MAX_TENSOR_FRAMES", "MAX_ID_CHARS",
           "DEFAULT_SHM_THRESHOLD", "ITEMSIZE", "is_request_id", "PayloadEncoder", "Packed", "pack_header",
           "unpack_header", "TensorResolver", "byte_view", "numpy_tensor", "numpy_view", "torch_tensor", "torch_view"]

PROTOCOL_VERSION = 1
EXT_FRAME, EXT_SHM = 1, 2
MAX_TENSOR_FRAMES = 256
MAX_ID_CHARS = 128
#: tensors at least this large go through shared memory when it is available
DEFAULT_SHM_THRESHOLD = 64 * 1024

_DIM_BOUND = 1 << 40
_REFUSAL = "cannot send a {}"


def is_request_id(value: Any) -> bool:
    if type(value) is int or tensor_fields.is_int(value):  # (an int, as nearly every id is, in one look)
        return 0 <= value < 2**64
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


# --------------------------------------------------------------------------- encoding


def _host_bytes(obj: Any) -> tuple[list[int], np.ndarray]:
    """The shape and bytes (a flat uint8 array in host memory) of a little-endian array or a dense tensor."""
    if isinstance(obj, np.ndarray):
        return list(obj.shape), np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
    torch = sys.modules["torch"]  # codec.leaf hands over torch tensors only once torch is imported
    t = obj.detach().cpu().contiguous()
    return list(t.shape), t.reshape(-1).view(torch.uint8).numpy()


class PayloadEncoder:
    """Turns a payload into msgpack-ready data; tensors go to ``frames`` or shared memory.

    ``copy=True`` snapshots every tensor (a caller may change its array once submit
    returns); ``place(nbytes)`` returns ``(segment, offset, view)`` or None; ``borrow(address,
    nbytes)`` finds a tensor that already lies in a lent block of that arena (``Client.empty``).
    """

    def __init__(self, *, copy: bool, place: Callable[[int], tuple[str, int, memoryview] | None] | None = None,
                 shm_threshold: int = DEFAULT_SHM_THRESHOLD,
                 borrow: Callable[[int, int], tuple[str, int, int] | None] | None = None) -> None:
        self.copy = copy
        self.place = place
        self.borrow = borrow  # ``ShmArena.borrow`` of the arena ``place`` takes from (``Client.empty``)
        self.shm_threshold = shm_threshold
        self.frames: list[Any] = []
        self.blocks: list[tuple[str, int]] = []

    def encode(self, obj: Any, path: str = "payload", depth: int = 0) -> Any:
        """The slow path: ``obj`` as msgpack-ready data; errors name ``path``."""
        return codec.encode(obj, self._default(), depth + 1, path)  # a payload sits one level below its message

    def pack(self, obj: Any, path: str = "payload") -> Packed:
        """``encode`` and msgpack in one: the bytes of ``obj``, tensors to ``frames`` or shared memory.

        The same result, and the same errors, as ``msgpack.packb(self.encode(obj))``.
        """
        default = self._default()
        data = codec.pack(obj, ((path, obj),), default)
        if data is None:  # codec.pack did not vouch for the fast path
            data = msgpack.packb(codec.encode(obj, default, 1, path), use_bin_type=True)
        return Packed(data)

    def pack_message(self, header: dict[str, Any], key: str = "payload") -> bytes:
        """``pack_header`` of ``header`` whose ``key`` field holds a value still to encode: the bytes
        of ``pack_header({**header, key: self.pack(header[key], key)})`` with the same errors, in one
        msgpack call where ``codec.pack`` vouches for the value. The other fields are this side's own
        and packed as they are."""
        default = self._default()
        value = header[key]
        data = codec.pack(header, ((key, value),), default)
        if data is None:  # the slow path names what it refuses
            data = pack_header({**header, key: Packed(msgpack.packb(codec.encode(value, default, 1, key),
                                                                    use_bin_type=True))})
        return data

    def _default(self) -> Callable[[Any], Any]:
        """msgpack's ``default=``: what ``encode`` makes of a value msgpack cannot pack itself.

        Made per call rather than kept: an attribute would tie the encoder into a reference cycle.
        """
        return functools.partial(codec.leaf, _REFUSAL, PayloadEncoder._tensor, self)

    def _tensor(self, obj: Any, name: str) -> msgpack.ExtType:
        shape, flat = _host_bytes(obj)
        if self.borrow is not None and flat.nbytes >= self.shm_threshold:
            lent = self.borrow(flat.ctypes.data, flat.nbytes)  # an array Client.empty made: sent where it lies
            if lent is not None:
                segment, block, offset = lent
                self.blocks.append((segment, block))
                return codec.ext(EXT_SHM, msgpack.packb([segment, offset, name, shape]))
        if self.place is not None and flat.nbytes >= self.shm_threshold:
            placed = self.place(flat.nbytes)
            if placed is not None:
                segment, offset, view = placed
                self.blocks.append((segment, offset))
                bulk_copy.copy(np.frombuffer(view, dtype=np.uint8), flat)
                return codec.ext(EXT_SHM, msgpack.packb([segment, offset, name, shape]))
        if len(self.frames) >= MAX_TENSOR_FRAMES:
            raise ValueError(f"a message carries at most {MAX_TENSOR_FRAMES} tensors as frames")
        self.frames.append(flat.tobytes() if self.copy else memoryview(flat))
        return codec.ext(EXT_FRAME, msgpack.packb([name, shape, len(self.frames) - 1]))


def pack_plain(header: dict[str, Any], key: str) -> bytes | None:
    """``pack_header`` of ``header`` whose ``key`` field holds plain values only (no tensor, no numpy
    scalar: nothing for an encoder to place or convert); None otherwise, and a ``PayloadEncoder``
    packs it (or names what it refuses). A small message's path: one msgpack call, no encoder."""
    if not codec.packable(((key, header[key]),), 0):
        return None
    try:  # no default=: a tensor or a numpy scalar raises here
        return msgpack.Packer(use_bin_type=True).pack(header)
    except (TypeError, ValueError, OverflowError):
        return None


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


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _Ext:
    """A tensor reference as it was read, resolved by ``TensorResolver`` afterwards."""

    code: int
    data: bytes


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
    msg = codec.loads(data, hook, "header")
    if not isinstance(msg, dict):
        raise ProtocolError(f"a header must be a msgpack map, got {type(msg).__name__}")
    if msg.get("v") != PROTOCOL_VERSION or isinstance(msg.get("v"), bool):
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not {PROTOCOL_VERSION}, the one this side speaks"
                            [:tensor_fields.CLIP])
    return msg


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
        body = codec.loads_descriptor(ext.data)
        if ext.code == EXT_FRAME:
            buf, name, shape, count = self._frame(body)
            make = self.make
        elif ext.code == EXT_SHM:
            buf, name, shape, count = self._shm(body)
            make = self.make_shm
        else:
            raise ProtocolError(f"unknown extension type {ext.code}")
        if name == "bool":
            tensor_fields.check_bools(buf, count)
        return make(buf, name, shape)

    def _frame(self, body: Any) -> tuple[memoryview, str, list[int], int]:
        if not isinstance(body, list) or len(body) != 3:
            raise ProtocolError("a frame tensor must be [dtype, shape, index]")
        name, shape, index = check_dtype(body[0]), tensor_fields.check_dims(body[1], "shape", _DIM_BOUND), body[2]
        if not tensor_fields.is_int(index) or not 0 <= index < len(self.frames):
            raise ProtocolError(f"tensor frame index {index!r} is out of range ({len(self.frames)} frames)"
                                [:tensor_fields.CLIP])
        if self.used[index]:
            raise ProtocolError(f"tensor frame {index} is referenced twice")
        self.used[index] = True
        buf = byte_view(self.frames[index])
        return buf, name, shape, tensor_fields.check_nbytes(name, shape, buf.nbytes, f"frame {index} has")

    def _shm(self, body: Any) -> tuple[memoryview, str, list[int], int]:
        if not isinstance(body, list) or len(body) != 4:
            raise ProtocolError("a shared-memory tensor must be [segment, offset, dtype, shape]")
        segment, offset = body[0], body[1]
        name, shape = check_dtype(body[2]), tensor_fields.check_dims(body[3], "shape", _DIM_BOUND)
        tensor_fields.check_placement(segment, offset, name)
        if self.shm_view is None:
            raise ProtocolError("a shared-memory tensor arrived, but this connection has none registered")
        count = math.prod(shape)
        buf = self.shm_view(segment, offset, count * ITEMSIZE[name])
        self.shm_blocks.append((segment, offset))
        return buf, name, shape, count


def byte_view(frame: Any) -> memoryview:
    """``frame`` (a zmq.Frame or any C-contiguous buffer) as a flat memoryview of bytes, no copy."""
    buf = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf


def numpy_tensor(buf: memoryview, name: str, shape: list[int]) -> np.ndarray:
    """A writable copy the caller owns."""
    return numpy_view(buf, name, shape).copy()


def numpy_view(buf: memoryview, name: str, shape: list[int]) -> np.ndarray:
    """An array over ``buf`` itself, no copy: it keeps ``buf``'s exporter alive, and is
    writable if ``buf`` is."""
    return tensor_fields.build(buf, name, shape, math.prod(shape), "numpy")


def torch_tensor(buf: memoryview, name: str, shape: list[int]) -> Any:
    """A writable copy the caller owns."""
    return tensor_fields.build(bytearray(buf), name, shape, math.prod(shape), "torch")


def torch_view(buf: memoryview, name: str, shape: list[int]) -> Any:
    """A tensor over ``buf`` itself, no copy (``buf`` must be writable): it keeps ``buf``'s
    exporter alive, as ``numpy_view`` does."""
    return tensor_fields.build(buf, name, shape, math.prod(shape), "torch")
