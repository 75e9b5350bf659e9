"""The wire codec: msgpack messages with tensors as typed msgpack extensions.

Leaf module: imports nothing from the project but ``runtime.core.errors`` and the
codec core (``codec``, and ``cuda_ipc`` for extension 3). torch is imported lazily,
only when a torch tensor is encoded or torch output is asked for, so that a
torch-free client (pyzmq, msgpack, numpy) can use it.

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

dtypes: float16 float32 float64 bfloat16 int8 int16 int32 int64 uint8 bool. Shape
entries are ints in [0, 2**44]; a tensor holds at most 2**44 bytes.

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
ever pickled. Speed: both directions take msgpack's C fast paths of ``codec``.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import msgpack
import numpy as np

from runtime.core.errors import ProtocolError
from runtime.transport import codec, cuda_ipc, tensor_fields
from runtime.transport.codec import MAX_DEPTH
from runtime.transport.tensor_fields import ITEMSIZE, MAX_NDIM, MAX_TENSOR_BYTES, check_dtype
from runtime.transport.cuda_ipc import EXT_CUDA_IPC

__all__ = ["PROTOCOL_VERSION", "EXT_INLINE", "EXT_SHM", "EXT_CUDA_IPC", "DEFAULT_INLINE_THRESHOLD",
           "MAX_MESSAGE_BYTES", "MAX_NDIM", "MAX_TENSOR_BYTES", "MAX_DEPTH", "Allocator", "Mapper",
           "TensorEncoder", "TensorDecoder", "pack_message", "unpack_message"]

PROTOCOL_VERSION = 1
EXT_INLINE, EXT_SHM = 1, 2
DEFAULT_INLINE_THRESHOLD = 64 * 1024
MAX_MESSAGE_BYTES = 1 << 30

_RESERVED = frozenset({"v", "type", "id"})
_SHM_KEYS = frozenset({"segment", "offset", "nbytes", "dtype", "shape"})
_DIM_BOUND = MAX_TENSOR_BYTES + 1  # shape entries up to 2**44 inclusive
_REFUSAL = "cannot encode {}"


class Allocator(Protocol):
    """Where the encoder puts large CPU tensors (``runtime.transport.arena.ShmArena``). One that
    also has ``borrow(address, nbytes) -> (segment, block offset, offset) | None`` (a lent
    block, ``runtime.transport.lending``) gets tensors already in its memory sent without a copy."""

    def place(self, nbytes: int) -> tuple[str, int, memoryview]: ...


class Mapper(Protocol):
    """How the decoder reaches them (``runtime.transport.arena.ShmMapper``); raises ProtocolError."""

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
        if not tensor_fields.is_int(self.inline_threshold) or self.inline_threshold < 0:
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
    #: msgpack's ext_hook for this decoder, made once rather than per message
    _ext_hook: Callable[[int, bytes], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tensor_type not in ("torch", "numpy"):
            raise ValueError(f'tensor_type must be "torch" or "numpy", got {self.tensor_type!r}')
        object.__setattr__(self, "_ext_hook", functools.partial(_decode_ext, self))


_DEFAULT_ENCODER = TensorEncoder()


# --------------------------------------------------------------------------- encoding


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
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": type, "id": id, **fields}
    context = (encoder, placed)

    def leaf(obj: Any) -> Any:  # cheaper to make than a functools.partial, and most messages never call it
        return codec.leaf(_REFUSAL, _encode_tensor, context, obj)

    try:
        data = codec.pack(body, fields.items(), leaf)
        if data is None:
            for key, value in fields.items():
                body[key] = codec.encode(value, leaf, 1, key)
            data = msgpack.packb(body, use_bin_type=True)
        return data
    except BaseException:
        # the blocks of a message that was never sent would otherwise leak
        free = getattr(encoder.allocator, "free", None)
        if free is not None:
            for segment, offset in placed:
                free(segment, offset)
        raise


def _encode_tensor(context: tuple[TensorEncoder, list], obj: Any, name: str) -> msgpack.ExtType:
    """``codec.leaf``'s tensor: ``obj`` is a little-endian array or a dense tensor of dtype ``name``."""
    enc, placed = context
    if isinstance(obj, np.ndarray):
        nbytes = obj.nbytes
        if _goes_inline(enc, nbytes):
            return _inline_ext(name, obj.shape, np.ascontiguousarray(obj))
        if obj.flags.c_contiguous and (lent := _borrow(enc, placed, obj.ctypes.data, nbytes)) is not None:
            return _shm_ext(lent[0], lent[1], nbytes, name, obj.shape)
        segment, offset, view = _place(enc, placed, nbytes)
        np.frombuffer(view, dtype=obj.dtype).reshape(obj.shape)[...] = obj
        return _shm_ext(segment, offset, nbytes, name, obj.shape)
    torch = sys.modules["torch"]  # codec.leaf hands over torch tensors only once torch is imported
    t = obj.detach() if obj.requires_grad else obj
    if not t.is_cpu:
        if t.is_cuda and enc.cuda_ipc:
            return cuda_ipc.encode(t, name, torch)
        t = t.cpu()
    nbytes = t.numel() * t.element_size()
    if _goes_inline(enc, nbytes):
        return _inline_ext(name, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy())
    if t.is_contiguous() and (lent := _borrow(enc, placed, t.data_ptr(), nbytes)) is not None:
        return _shm_ext(lent[0], lent[1], nbytes, name, t.shape)
    segment, offset, view = _place(enc, placed, nbytes)
    # copy_ from a strided source: a non-contiguous input costs one copy, not two
    torch.frombuffer(view, dtype=t.dtype, count=t.numel()).view(t.shape).copy_(t)
    return _shm_ext(segment, offset, nbytes, name, t.shape)


def _goes_inline(enc: TensorEncoder, nbytes: int) -> bool:
    return enc.allocator is None or nbytes == 0 or nbytes < enc.inline_threshold


def _borrow(enc: TensorEncoder, placed: list, address: int, nbytes: int) -> tuple[str, int] | None:
    """A tensor lying in a block its allocator lent (``Engine.empty``): (segment, offset) to send
    instead of a copy; the message holds the block, listed among what it placed."""
    borrow = getattr(enc.allocator, "borrow", None)
    lent = None if borrow is None else borrow(address, nbytes)
    if lent is None:
        return None
    segment, block, offset = lent
    placed.append((segment, block))
    return segment, offset


def _place(enc: TensorEncoder, placed: list, nbytes: int) -> tuple[str, int, memoryview]:
    segment, offset, view = enc.allocator.place(nbytes)
    placed.append((segment, offset))
    if len(view) < nbytes:
        raise ValueError(f"allocator returned {len(view)} bytes for a request of {nbytes}")
    return segment, offset, view[:nbytes]


def _shm_ext(segment: str, offset: int, nbytes: int, name: str, shape: Any) -> msgpack.ExtType:
    ref = {"segment": segment, "offset": offset, "nbytes": nbytes, "dtype": name, "shape": list(shape)}
    return codec.ext(EXT_SHM, msgpack.packb(ref, use_bin_type=True))


def _inline_ext(name: str, shape: tuple[int, ...], contiguous: Any) -> msgpack.ExtType:
    # msgpack of [name, shape, bin], the bytes joined on once rather than copied through two packers
    return codec.ext(EXT_INLINE, b"".join((_inline_head(name, shape), contiguous)))


@functools.lru_cache(maxsize=1024)
def _inline_head(name: str, shape: tuple[int, ...]) -> bytes:
    """The msgpack bytes of ``[name, shape, bin]`` up to the tensor's raw bytes."""
    nbytes = math.prod(shape) * ITEMSIZE[name]
    if nbytes < 1 << 8:
        bin_header = bytes((0xC4, nbytes))
    elif nbytes < 1 << 16:
        bin_header = b"\xc5" + nbytes.to_bytes(2, "big")
    else:
        bin_header = b"\xc6" + nbytes.to_bytes(4, "big")  # OverflowError past 4 GiB, as msgpack would refuse
    return b"\x93" + msgpack.packb(name) + msgpack.packb(list(shape)) + bin_header


# --------------------------------------------------------------------------- decoding


def unpack_message(
    data: bytes | bytearray | memoryview, *, expected_types: set[str] | frozenset[str] | None = None,
    tensor_decoder: TensorDecoder | None = None, max_bytes: int = MAX_MESSAGE_BYTES,
) -> dict[str, Any]:
    """Decode and validate one frame; raise ProtocolError on anything wrong."""
    if isinstance(data, (bytes, bytearray)):
        n = len(data)
    elif isinstance(data, memoryview):
        n = data.nbytes
    else:
        raise ProtocolError(f"a message must be bytes, got {type(data).__name__}")
    if n > max_bytes:
        raise ProtocolError(f"message of {n} bytes exceeds the limit of {max_bytes}")
    decoder = tensor_decoder or _DEFAULT_DECODER
    msg = codec.loads(data, decoder._ext_hook, "message")
    if type(msg) is not dict:
        raise ProtocolError(f"a message must be a msgpack map, got {type(msg).__name__}")
    if "v" not in msg or "type" not in msg or "id" not in msg:
        raise ProtocolError(f"message lacks the header keys {sorted(_RESERVED - msg.keys())}")
    # decoded values have exact types: an int here is never a bool, a str never a subclass
    version = msg["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}, the one this side speaks"
                            [:tensor_fields.CLIP])
    kind = msg["type"]
    if type(kind) is not str or not kind:
        raise ProtocolError(f"message type must be a non-empty str, got {kind!r}"[:tensor_fields.CLIP])
    if expected_types is not None and kind not in expected_types:
        raise ProtocolError(f"unexpected message type {kind!r}; expected one of {sorted(expected_types)}"
                            [:tensor_fields.CLIP])
    if type(msg["id"]) is not int and type(msg["id"]) is not str:
        raise ProtocolError(f"message id must be an int or a str, got {msg['id']!r}"[:tensor_fields.CLIP])
    return msg


def _decode_ext(dec: TensorDecoder, code: int, payload: bytes) -> Any:
    if code == EXT_INLINE:
        return _decode_inline(codec.loads_descriptor(payload), dec)
    if code == EXT_SHM:
        return _decode_shm(codec.loads_descriptor(payload), dec)
    if code == EXT_CUDA_IPC:
        return cuda_ipc.decode(codec.loads_descriptor(payload), dec.allow_cuda_ipc, dec.tensor_type)
    raise ProtocolError(f"unknown extension type {code}")


def _decode_inline(body: Any, dec: TensorDecoder) -> Any:
    if not isinstance(body, list) or len(body) != 3:
        raise ProtocolError("an inline tensor must be [dtype, shape, bytes]")
    name, shape, raw = check_dtype(body[0]), tensor_fields.check_dims(body[1], "shape", _DIM_BOUND), body[2]
    if not isinstance(raw, bytes):
        raise ProtocolError(f"inline tensor data must be bytes, got {type(raw).__name__}")
    count = tensor_fields.check_nbytes(name, shape, len(raw))
    return tensor_fields.build(bytearray(raw), name, shape, count, dec.tensor_type)  # bytearray: writable, owned


def _decode_shm(body: Any, dec: TensorDecoder) -> Any:
    ref = tensor_fields.check_keys(body, _SHM_KEYS, "shared-memory")
    name, shape = check_dtype(ref["dtype"]), tensor_fields.check_dims(ref["shape"], "shape", _DIM_BOUND)
    segment, offset, nbytes = ref["segment"], ref["offset"], ref["nbytes"]
    tensor_fields.check_placement(segment, offset, name)
    if not tensor_fields.is_int(nbytes) or nbytes < 0:
        raise ProtocolError(f"nbytes must be an int >= 0, got {nbytes!r}"[:tensor_fields.CLIP])
    count = tensor_fields.check_nbytes(name, shape, nbytes)
    if dec.mapper is None:
        raise ProtocolError("a shared-memory tensor arrived but this decoder has no mapper")
    view = dec.mapper.view(segment, offset, nbytes)
    if len(view) != nbytes:
        raise ProtocolError(f"mapper returned {len(view)} bytes for {segment}+{offset}, expected {nbytes}")
    return tensor_fields.build(view, name, shape, count, dec.tensor_type)


_DEFAULT_DECODER = TensorDecoder()  # here, once _decode_ext exists
