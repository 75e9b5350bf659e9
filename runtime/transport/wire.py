"""The wire codec: msgpack messages with tensors as typed msgpack extensions.

Leaf module: imports nothing from the project but ``runtime.core.errors``. torch is
imported lazily, only when a torch tensor is encoded or torch output is asked
for, so that a torch-free client (pyzmq, msgpack, numpy) can use it.

One message is one msgpack map in one frame::

    {"v": PROTOCOL_VERSION, "type": <non-empty str>, "id": <int | str>, **fields}

Map keys are ``str`` everywhere; tuples become lists; numpy scalars become
Python numbers. Tensors (torch or numpy) may sit anywhere inside the fields and
travel as ``msgpack.ExtType``; raw bytes are little-endian, C order::

    code 1  inline    [dtype, shape, raw bytes]            nbytes < inline_threshold,
                                                           or no allocator given
    code 2  shm       {segment, offset, nbytes, dtype, shape}
    code 3  cuda ipc  the fields of torch's reduce_tensor() as a msgpack map

    sender                                       receiver
    pack_message(..., tensor_encoder=E)  ---->   unpack_message(data, tensor_decoder=D)
      E.allocator.place(n) -> (seg, off, view)     D.mapper.view(seg, off, n) -> view
      one copy of the tensor into the view         a tensor VIEW over it, no copy

Ownership: a decoded shared-memory tensor is a view, valid while the segment's
owner keeps the block; call ``.clone()`` to keep it. A decoded CUDA IPC tensor
aliases the sender's GPU memory and is valid while the sending process lives.
Inline tensors are decoded into fresh, writable memory.

Decoding treats its input as untrusted: every failure (bad msgpack, trailing
bytes, wrong version, a non-str key, a dtype outside the allow-list, a shape
that does not match the byte count, a segment outside the mapper's run) raises
``ProtocolError``, never IndexError/KeyError/struct errors. bfloat16 decodes
to torch only; asking for numpy output of a bfloat16 tensor raises
``ProtocolError`` rather than handing back raw uint16 bits silently. Nothing is
ever pickled.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from runtime.core.errors import ProtocolError

if sys.byteorder != "little":  # the wire carries raw little-endian bytes
    raise ImportError("runtime.transport.wire supports little-endian hosts only")

PROTOCOL_VERSION = 1
EXT_INLINE, EXT_SHM, EXT_CUDA_IPC = 1, 2, 3
DEFAULT_INLINE_THRESHOLD = 64 * 1024
MAX_MESSAGE_BYTES = 1 << 30
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: far above any real tensor, far below int64 overflow
MAX_DEPTH = 32

_RESERVED = frozenset({"v", "type", "id"})
_NP_DTYPES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "i1", "int16": "<i2",
              "int32": "<i4", "int64": "<i8", "uint8": "u1", "bool": "?"}
_ITEMSIZE = {name: np.dtype(code).itemsize for name, code in _NP_DTYPES.items()}
_ITEMSIZE["bfloat16"] = 2
_NP_NAMES = {np.dtype(code): name for name, code in _NP_DTYPES.items()}
_NP_DTYPE_OF = {name: np.dtype(code) for name, code in _NP_DTYPES.items()}
_FLOAT_NAMES = frozenset({"float16", "float32", "float64", "bfloat16"})
_SHM_KEYS = frozenset({"segment", "offset", "nbytes", "dtype", "shape"})
_CUDA_INT_KEYS = ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_CUDA_KEYS = frozenset(_CUDA_INT_KEYS) | {"size", "stride", "dtype", "handle", "requires_grad",
                                          "ref_counter_handle", "event_handle", "event_sync_required"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Allocator(Protocol):
    """Where the encoder puts large CPU tensors (``runtime.transport.shm.ShmArena``)."""

    def place(self, nbytes: int) -> tuple[str, int, memoryview]: ...


class Mapper(Protocol):
    """How the decoder reaches them (``runtime.transport.shm.ShmMapper``); raises ProtocolError."""

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview: ...


@dataclass(frozen=True)
class TensorEncoder:
    """How tensors are encoded: ``allocator=None`` sends every CPU tensor inline.

    ``cuda_ipc=False`` copies CUDA tensors to the CPU first (for a peer on
    another host, or one without the sender's GPU).
    """

    allocator: Allocator | None = None
    inline_threshold: int = DEFAULT_INLINE_THRESHOLD
    cuda_ipc: bool = True

    def __post_init__(self) -> None:
        if not _is_int(self.inline_threshold) or self.inline_threshold < 0:
            raise ValueError(f"inline_threshold must be an int >= 0, got {self.inline_threshold!r}")


@dataclass(frozen=True)
class TensorDecoder:
    """How tensors are decoded.

    ``mapper=None`` rejects shared-memory references; ``allow_cuda_ipc`` is an
    opt-in because opening a CUDA IPC handle trusts the peer to be a local rank.
    """

    mapper: Mapper | None = None
    tensor_type: str = "torch"
    allow_cuda_ipc: bool = False

    def __post_init__(self) -> None:
        if self.tensor_type not in ("torch", "numpy"):
            raise ValueError(f'tensor_type must be "torch" or "numpy", got {self.tensor_type!r}')


_DEFAULT_ENCODER = TensorEncoder()
_DEFAULT_DECODER = TensorDecoder()


# --------------------------------------------------------------------------- encoding
#
# The fast path lets msgpack's C packer walk the message and hands it, through
# ``default=``, only what it cannot pack itself: tensors, numpy arrays and
# numpy scalars. msgpack would also pack what the wire forbids (non-str map
# keys, ExtType, Timestamp, nesting past MAX_DEPTH) and would refuse a strided
# memoryview, so _packable first walks the dicts and lists, and only those: it
# builds no paths, and a list of plain scalars costs it one C-level type scan.
# Whatever it does not vouch for goes down the slow path, _encode, which builds
# the message in Python and names the path of whatever it rejects. A value that
# default= rejects is located by identity only once it has failed.


class _Unencodable(TypeError):
    """A value the wire cannot carry; the caller prefixes where it sat."""

    obj: Any = None


def pack_message(
    type: str, id: int | str, /, *, tensor_encoder: TensorEncoder | None = None, **fields: Any
) -> bytes:
    """Encode one message. No field may be named ``v``, ``type``, ``id`` or ``tensor_encoder``.

    If encoding fails after some tensors were placed, those blocks are given
    back through ``allocator.free(segment, offset)`` when the allocator has it.
    """
    if not isinstance(type, str) or not type:
        raise TypeError(f"message type must be a non-empty str, got {type!r}")
    if not (isinstance(id, (int, str)) and id is not True and id is not False):
        raise TypeError(f"message id must be an int or a str, got {id!r}")
    if "v" in fields or "type" in fields or "id" in fields:
        raise ValueError(f"field names {sorted(_RESERVED & fields.keys())} are reserved for the message header")
    encoder = tensor_encoder or _DEFAULT_ENCODER
    placed: list[tuple[str, int]] = []
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": type, "id": id}
    try:
        if _packable(fields, 1):
            body.update(fields)
            packer = msgpack.Packer(use_bin_type=True, default=lambda obj: _encode_leaf(obj, encoder, placed))
            try:
                return packer.pack(body)
            except _Unencodable as exc:  # find where the value sat only now that it failed
                raise TypeError(f"{_locate(fields, exc.obj)}: {exc}") from None
        for key, value in fields.items():
            body[key] = _encode(value, encoder, placed, 1, key)
        return msgpack.packb(body, use_bin_type=True)
    except BaseException:
        # the blocks of a message that was never sent would otherwise leak
        free = getattr(encoder.allocator, "free", None)
        if free is not None:
            for segment, offset in placed:
                free(segment, offset)
        raise


_PLAIN = frozenset({str, int, float, bool, type(None), bytes})  # exact types msgpack packs as they are
_SLOW = (dict, list, tuple, memoryview, msgpack.ExtType, msgpack.Timestamp)


def _packable(d: dict[Any, Any], depth: int) -> bool:
    """Whether msgpack, with _encode_leaf as ``default=``, packs this dict exactly as _encode would.

    ``depth`` is that of the dict's values. It looks at containers only and
    builds no paths; False sends the message down the slow path, which
    converts (a strided memoryview, a subclass of a container) or rejects with
    the path (a non-str key, ExtType, Timestamp, nesting deeper than MAX_DEPTH).
    """
    for key, value in d.items():
        if type(key) is not str:
            return False
        t = type(value)
        if t in _PLAIN:
            continue
        if depth > MAX_DEPTH:
            return False
        if t is dict:
            if not _packable(value, depth + 1):
                return False
        elif t is list or t is tuple:
            # a vector of numbers, the common case, costs one C-level scan and no call
            if not _PLAIN.issuperset(map(type, value)) and not _packable_seq(value, depth + 1):
                return False
        elif issubclass(t, _SLOW):
            return False
    return True


def _packable_seq(seq: list[Any] | tuple[Any, ...], depth: int) -> bool:
    """_packable for a list or tuple that holds more than plain scalars, its items ``depth`` levels down."""
    if depth > MAX_DEPTH:
        return False
    for value in seq:
        t = type(value)
        if t in _PLAIN:
            continue
        if t is dict:
            if not _packable(value, depth + 1):
                return False
        elif t is list or t is tuple:
            if not _PLAIN.issuperset(map(type, value)) and not _packable_seq(value, depth + 1):
                return False
        elif issubclass(t, _SLOW):
            return False
    return True


def _encode_leaf(obj: Any, enc: TensorEncoder, placed: list) -> Any:
    """What msgpack cannot pack itself: a tensor extension or a Python number, else _Unencodable."""
    try:
        if isinstance(obj, np.ndarray):
            return _encode_numpy(obj, enc, placed)
        torch = sys.modules.get("torch")  # a torch tensor implies torch is imported
        if torch is not None and isinstance(obj, torch.Tensor):
            return _encode_torch(obj, enc, placed, torch)
        if isinstance(obj, (np.bool_, np.integer, np.floating)):
            return obj.item()
        if isinstance(obj, int):  # msgpack hands on the ints it cannot fit in 64 bits
            raise OverflowError("Integer value out of range")
        raise _Unencodable(f"cannot encode {type(obj).__name__}")
    except _Unencodable as exc:
        exc.obj = obj
        raise


def _locate(fields: dict[str, Any], target: Any) -> str:
    """The path of ``target`` in the fields, first in packing order (fast path only: no cycles)."""
    stack = list(fields.items())[::-1]
    while stack:
        path, obj = stack.pop()
        if obj is target:
            return path
        if type(obj) is dict:
            stack.extend([(f"{path}.{key}", value) for key, value in obj.items()][::-1])
        elif type(obj) in (list, tuple):
            stack.extend([(f"{path}[{i}]", value) for i, value in enumerate(obj)][::-1])
    return "<message>"


def _encode(obj: Any, enc: TensorEncoder, placed: list, depth: int, path: str) -> Any:
    """The slow path: builds the message in Python, naming the path of what it rejects."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: map keys must be str, got {key!r}")
            out[key] = _encode(value, enc, placed, depth + 1, f"{path}.{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [_encode(v, enc, placed, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    try:
        return _encode_leaf(obj, enc, placed)
    except _Unencodable as exc:
        raise TypeError(f"{path}: {exc}") from None


def _encode_numpy(arr: np.ndarray, enc: TensorEncoder, placed: list) -> msgpack.ExtType:
    name = _NP_NAMES.get(arr.dtype)
    if name is None and arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
        name = _NP_NAMES.get(arr.dtype)
    if name is None:
        raise _Unencodable(f"dtype {arr.dtype} is not allowed on the wire")
    nbytes = arr.nbytes
    if _goes_inline(enc, nbytes):
        return _inline_ext(name, arr.shape, np.ascontiguousarray(arr))
    segment, offset, view = _place(enc, placed, nbytes)
    np.frombuffer(view, dtype=arr.dtype).reshape(arr.shape)[...] = arr
    return _shm_ext(segment, offset, nbytes, name, arr.shape)


def _encode_torch(t: Any, enc: TensorEncoder, placed: list, torch: Any) -> msgpack.ExtType:
    if t.requires_grad:
        t = t.detach()
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise _Unencodable(f"only dense strided tensors can be encoded, got {t.layout}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise _Unencodable(f"dtype {t.dtype} is not allowed on the wire")
    if not t.is_cpu:
        if t.is_cuda and enc.cuda_ipc:
            return _encode_cuda(t, name, torch)
        t = t.cpu()
    nbytes = t.numel() * t.element_size()
    if _goes_inline(enc, nbytes):
        return _inline_ext(name, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy())
    segment, offset, view = _place(enc, placed, nbytes)
    # copy_ from a strided source: a non-contiguous input costs one copy, not two
    torch.frombuffer(view, dtype=t.dtype, count=t.numel()).view(t.shape).copy_(t)
    return _shm_ext(segment, offset, nbytes, name, t.shape)


def _goes_inline(enc: TensorEncoder, nbytes: int) -> bool:
    return enc.allocator is None or nbytes == 0 or nbytes < enc.inline_threshold


def _place(enc: TensorEncoder, placed: list, nbytes: int) -> tuple[str, int, memoryview]:
    segment, offset, view = enc.allocator.place(nbytes)
    placed.append((segment, offset))
    if len(view) < nbytes:
        raise ValueError(f"allocator returned {len(view)} bytes for a request of {nbytes}")
    return segment, offset, view[:nbytes]


def _shm_ext(segment: str, offset: int, nbytes: int, name: str, shape: Any) -> msgpack.ExtType:
    ref = {"segment": segment, "offset": offset, "nbytes": nbytes, "dtype": name, "shape": list(shape)}
    return _ext(EXT_SHM, msgpack.packb(ref, use_bin_type=True))


def _inline_ext(name: str, shape: tuple[int, ...], contiguous: Any) -> msgpack.ExtType:
    # msgpack of [name, shape, bin], the bytes joined on once rather than copied through two packers
    return _ext(EXT_INLINE, b"".join((_inline_head(name, shape), contiguous)))


@functools.lru_cache(maxsize=1024)
def _inline_head(name: str, shape: tuple[int, ...]) -> bytes:
    """The msgpack bytes of ``[name, shape, bin]`` up to the tensor's raw bytes."""
    nbytes = math.prod(shape) * _ITEMSIZE[name]
    if nbytes < 1 << 8:
        bin_header = bytes((0xC4, nbytes))
    elif nbytes < 1 << 16:
        bin_header = b"\xc5" + nbytes.to_bytes(2, "big")
    else:
        bin_header = b"\xc6" + nbytes.to_bytes(4, "big")  # OverflowError past 4 GiB, as msgpack would refuse
    return b"\x93" + msgpack.packb(name) + msgpack.packb(list(shape)) + bin_header


def _ext(code: int, payload: bytes) -> msgpack.ExtType:
    # ExtType is a namedtuple whose __new__ re-checks in Python what is known here
    return tuple.__new__(msgpack.ExtType, (code, payload))


def _encode_cuda(t: Any, name: str, torch: Any) -> msgpack.ExtType:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(t)
    if rebuild is not rebuild_cuda_tensor:
        raise TypeError(f"torch reduced this CUDA tensor with {rebuild.__name__}, not CUDA IPC")
    # the argument order of rebuild_cuda_tensor in torch 2.x; classes are implied
    (_, size, stride, offset, _, _, device, handle, storage_size, storage_offset,
     requires_grad, rc_handle, rc_offset, event_handle, event_sync) = args
    desc = {
        "size": list(size), "stride": list(stride), "offset": offset, "dtype": name,
        "device": device, "handle": handle, "storage_size_bytes": storage_size,
        "storage_offset_bytes": storage_offset, "requires_grad": requires_grad,
        "ref_counter_handle": rc_handle, "ref_counter_offset": rc_offset,
        "event_handle": event_handle, "event_sync_required": event_sync,
    }
    return _ext(EXT_CUDA_IPC, msgpack.packb(desc, use_bin_type=True))


# --------------------------------------------------------------------------- decoding
#
# msgpack's C unpacker does most of the checking: unpackb (msgpack >= 1.0)
# bounds every length by the frame, so that a forged header cannot make it
# allocate more than the frame's size, and strict_map_key refuses keys other
# than str and bytes. The rest falls to one Python call per map
# (object_pairs_hook): duplicate keys, and bytes keys. A bytes key needs a bin
# header (0xc4-0xc6) somewhere in the frame, so a frame without one (three
# C-level memchr) gets the hook that only counts keys, any other the one that
# also checks their types. A small memoryview frame, what pyzmq hands over, is
# copied to bytes for that scan; a larger one most likely holds bin anyway
# (inline tensors). No hook at all, with duplicates caught by re-packing the
# result and comparing bytes, costs more than the hook for the common message
# of one or two maps.

_SCAN_COPY_LIMIT = 4096


def unpack_message(
    data: bytes | bytearray | memoryview, *, expected_types: set[str] | frozenset[str] | None = None,
    tensor_decoder: TensorDecoder | None = None, max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Decode and validate one frame; raise ProtocolError on anything wrong."""
    if isinstance(data, (bytes, bytearray)):
        n = len(data)
    elif isinstance(data, memoryview):
        n = data.nbytes
        if n <= _SCAN_COPY_LIMIT and data.c_contiguous:
            data = data.tobytes()
    else:
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    if n > max_bytes:
        raise ProtocolError(f"message of {n} bytes exceeds the limit of {max_bytes}")
    decoder = tensor_decoder or _DEFAULT_DECODER
    if isinstance(data, (bytes, bytearray)) and 0xC4 not in data and 0xC5 not in data and 0xC6 not in data:
        map_hook = _unique_map  # no bin anywhere, so no bytes key
    else:
        map_hook = _str_map
    try:
        msg = msgpack.unpackb(data, strict_map_key=True, object_pairs_hook=map_hook,
                              ext_hook=lambda code, payload: _decode_ext(code, payload, decoder))
    except ProtocolError:
        raise
    except Exception as exc:  # untrusted input: any failure to decode is a protocol failure
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc
    if type(msg) is not dict:
        raise ProtocolError(f"a message must be a msgpack map, got {type(msg).__name__}")
    # msgpack decodes ext -1 without ext_hook; a memchr for its type byte first (bytes only:
    # ``in`` would iterate a memoryview in Python)
    if (type(data) is memoryview or 0xFF in data) and _TIMESTAMP_MARKS.search(data) is not None:
        _refuse_timestamps(msg, 0)
    if "v" not in msg or "type" not in msg or "id" not in msg:
        raise ProtocolError(f"message lacks the header keys {sorted(_RESERVED - msg.keys())}")
    # decoded values have exact types: an int here is never a bool, a str never a subclass
    version = msg["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}, the one this side speaks")
    kind = msg["type"]
    if type(kind) is not str or not kind:
        raise ProtocolError(f"message type must be a non-empty str, got {kind!r}")
    if expected_types is not None and kind not in expected_types:
        raise ProtocolError(f"unexpected message type {kind!r}; expected one of {sorted(expected_types)}")
    if type(msg["id"]) is not int and type(msg["id"]) is not str:
        raise ProtocolError(f"message id must be an int or a str, got {msg['id']!r}")
    return msg


#: how a msgpack Timestamp (extension -1) can start: fixext 4 or 8, or ext 8/16/32 of 4, 8 or 12
#: bytes (msgpack decodes each). Bytes like these inside a str or bin only cost the walk
#: below, which then finds nothing.
_TIMESTAMP_MARKS = re.compile(rb"[\xd6\xd7]\xff|\xc7[\x04\x08\x0c]\xff|\xc8\x00[\x04\x08\x0c]\xff"
                              rb"|\xc9\x00\x00\x00[\x04\x08\x0c]\xff")


def _refuse_timestamps(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
    if type(value) is msgpack.Timestamp:
        raise ProtocolError("extension type -1 (msgpack Timestamp) is not allowed")
    if type(value) is dict:
        for item in value.values():
            _refuse_timestamps(item, depth + 1)
    elif type(value) is list:
        for item in value:
            _refuse_timestamps(item, depth + 1)


def _unique_map(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a map has duplicate keys")
    return out


def _str_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ProtocolError("a map has duplicate keys")
    if bytes in map(type, out):  # strict_map_key let through str and bytes only
        raise ProtocolError(f"map keys must be str, got {next(k for k in out if type(k) is not str)!r}")
    return out


def _no_ext(code: int, payload: bytes) -> Any:
    raise ProtocolError(f"extension type {code} is not allowed inside a tensor descriptor")


def _decode_ext(code: int, payload: bytes, dec: TensorDecoder) -> Any:
    if code == EXT_INLINE:  # a list whose checks let no map through: no map hook needed
        return _decode_inline(msgpack.unpackb(payload, strict_map_key=True, ext_hook=_no_ext), dec)
    decode = _EXT_DECODERS.get(code)
    if decode is None:
        raise ProtocolError(f"unknown extension type {code}")
    map_hook = _str_map if 0xC4 in payload or 0xC5 in payload or 0xC6 in payload else _unique_map
    return decode(msgpack.unpackb(payload, strict_map_key=True, object_pairs_hook=map_hook, ext_hook=_no_ext), dec)


def _check_dtype(name: Any) -> str:
    if not isinstance(name, str) or name not in _ITEMSIZE:
        raise ProtocolError(f"tensor dtype {name!r} is not allowed; allowed: {sorted(_ITEMSIZE)}")
    return name


def _check_dims(dims: Any, what: str, ndim: int | None = None) -> list[int]:
    if not isinstance(dims, list) or len(dims) > MAX_NDIM:
        raise ProtocolError(f"tensor {what} must be a list of at most {MAX_NDIM} ints, got {dims!r}")
    if ndim is not None and len(dims) != ndim:
        raise ProtocolError(f"tensor {what} has {len(dims)} entries for {ndim} dimensions")
    for d in dims:
        if not _is_int(d) or d < 0 or d > MAX_TENSOR_BYTES:
            raise ProtocolError(f"tensor {what} entries must be ints in [0, 2**44], got {dims!r}")
    return dims


def _check_nbytes(name: str, shape: list[int], nbytes: int) -> int:
    """The element count, once the byte count matches it."""
    count = math.prod(shape)
    if count * _ITEMSIZE[name] != nbytes or nbytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensor of shape {shape} and dtype {name} needs {count * _ITEMSIZE[name]} bytes, "
                            f"got {nbytes}")
    return count


def _check_fields(body: Any, keys: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(body, dict) or body.keys() != keys:
        got = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ProtocolError(f"{what} descriptor must have exactly the keys {sorted(keys)}, got {got}")
    return body


def _decode_inline(body: Any, dec: TensorDecoder) -> Any:
    if not isinstance(body, list) or len(body) != 3:
        raise ProtocolError("an inline tensor must be [dtype, shape, bytes]")
    name, shape, raw = _check_dtype(body[0]), _check_dims(body[1], "shape"), body[2]
    if not isinstance(raw, bytes):
        raise ProtocolError(f"inline tensor data must be bytes, got {type(raw).__name__}")
    count = _check_nbytes(name, shape, len(raw))
    return _build(bytearray(raw), name, shape, count, dec)  # bytearray: writable, owned


def _decode_shm(body: Any, dec: TensorDecoder) -> Any:
    ref = _check_fields(body, _SHM_KEYS, "shared-memory")
    name, shape = _check_dtype(ref["dtype"]), _check_dims(ref["shape"], "shape")
    segment, offset, nbytes = ref["segment"], ref["offset"], ref["nbytes"]
    if not isinstance(segment, str):
        raise ProtocolError(f"segment must be a str, got {segment!r}")
    if not _is_int(offset) or not _is_int(nbytes) or offset < 0 or nbytes < 0:
        raise ProtocolError(f"offset and nbytes must be ints >= 0, got {offset!r}, {nbytes!r}")
    count = _check_nbytes(name, shape, nbytes)
    if offset % _ITEMSIZE[name]:
        raise ProtocolError(f"offset {offset} is not aligned to the {name} element size")
    if dec.mapper is None:
        raise ProtocolError("a shared-memory tensor arrived but this decoder has no mapper")
    view = dec.mapper.view(segment, offset, nbytes)
    if len(view) != nbytes:
        raise ProtocolError(f"mapper returned {len(view)} bytes for {segment}+{offset}, expected {nbytes}")
    return _build(view, name, shape, count, dec)


def _build(buf: Any, name: str, shape: list[int], count: int, dec: TensorDecoder) -> Any:
    if name == "bool" and count and np.frombuffer(buf, dtype=np.uint8).max() > 1:
        raise ProtocolError("bool tensor holds bytes other than 0 and 1")
    if dec.tensor_type == "numpy":
        if name == "bfloat16":
            raise ProtocolError("bfloat16 has no numpy dtype; decode with tensor_type='torch'")
        return np.frombuffer(buf, dtype=_NP_DTYPE_OF[name], count=count).reshape(shape)
    import torch

    dtype = getattr(torch, name)
    if count == 0:  # torch.frombuffer rejects empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


def _decode_cuda(body: Any, dec: TensorDecoder) -> Any:
    d = _check_fields(body, _CUDA_KEYS, "CUDA IPC")
    name = _check_dtype(d["dtype"])
    size = _check_dims(d["size"], "size")
    stride = _check_dims(d["stride"], "stride", len(size))
    for key in _CUDA_INT_KEYS:
        if not _is_int(d[key]) or not 0 <= d[key] <= MAX_TENSOR_BYTES:
            raise ProtocolError(f"CUDA IPC field {key!r} must be an int in [0, 2**44], got {d[key]!r}")
    for key in ("requires_grad", "event_sync_required"):
        if not isinstance(d[key], bool):
            raise ProtocolError(f"CUDA IPC field {key!r} must be a bool, got {d[key]!r}")
    for key, optional in (("handle", True), ("ref_counter_handle", False), ("event_handle", True)):
        if not (isinstance(d[key], bytes) or (optional and d[key] is None)):
            raise ProtocolError(f"CUDA IPC field {key!r} must be bytes, got {type(d[key]).__name__}")
    if d["requires_grad"] and name not in _FLOAT_NAMES:
        raise ProtocolError(f"requires_grad is set on a {name} tensor")
    # rebuild_cuda_tensor maps no storage when the handle is None or the size 0
    storage = 0 if d["handle"] is None else d["storage_size_bytes"]
    if math.prod(size):
        last = d["offset"] + sum((n - 1) * s for n, s in zip(size, stride))
        if (last + 1) * _ITEMSIZE[name] > storage:
            raise ProtocolError(f"CUDA tensor view reaches past its storage of {storage} bytes")
    if not dec.allow_cuda_ipc:
        raise ProtocolError("a CUDA IPC tensor arrived but this decoder does not allow CUDA IPC")
    if dec.tensor_type != "torch":
        raise ProtocolError("a CUDA IPC tensor can only be decoded with tensor_type='torch'")
    import torch

    if not torch.cuda.is_available():
        raise ProtocolError("a CUDA IPC tensor arrived but CUDA is not available in this process")
    if d["device"] >= torch.cuda.device_count():
        raise ProtocolError(f"CUDA IPC tensor on device {d['device']}, beyond this process's devices")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(size), tuple(stride), d["offset"], torch.storage.TypedStorage,
            getattr(torch, name), d["device"], d["handle"], d["storage_size_bytes"],
            d["storage_offset_bytes"], d["requires_grad"], d["ref_counter_handle"],
            d["ref_counter_offset"], d["event_handle"], d["event_sync_required"],
        )
    except RuntimeError as exc:
        raise ProtocolError(f"could not open the CUDA IPC handle: {exc}") from exc


_EXT_DECODERS = {EXT_SHM: _decode_shm, EXT_CUDA_IPC: _decode_cuda}
