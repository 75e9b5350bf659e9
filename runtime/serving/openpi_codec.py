"""openpi's message format on phyrt's side: observations in, results and metadata out.

openpi (``openpi_client.msgpack_numpy``) sends msgpack whose numpy arrays are maps with
bytes keys, and whose numpy scalars likewise::

    {b"__ndarray__": True, b"data": bytes, b"dtype": "<f4", b"shape": [2, 3]}
    {b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f4"}

    decode_observation(message, batch_dim)     untrusted bytes -> the engine's request:
                                               arrays become torch tensors (one copy each,
                                               the plugin's to write), a leading
                                               dimension of 1 added when batch_dim
    encode_result(result, batch_dim)           the plugin's result -> bytes: tensors and
                                               arrays as numpy maps, that dimension removed
    pack_metadata(metadata)                    the map sent when a client connects

Decoding treats its input as untrusted: dtypes come from phyrt's own allow-list
(``runtime.transport.codec``: bool, int8-64, uint8, float16-64; never object, void or a
byte string), every array's bytes must fill exactly its shape, map keys other than an
array's own must be str, no msgpack extension is accepted, nothing nests deeper than
``MAX_DEPTH``; any failure is a ``ProtocolError`` naming what it refused. Nothing is
ever pickled. Imports ``runtime.core.errors`` and ``runtime.transport.codec`` from the
project; torch, for the request tensors.
"""

from __future__ import annotations

import functools
from typing import Any

import msgpack
import numpy as np
import torch

from runtime.core.errors import ProtocolError
from runtime.transport.codec import MAX_DEPTH, encode
from runtime.transport.tensor_fields import (CLIP, ITEMSIZE, MAX_NDIM, MAX_TENSOR_BYTES, NP_CODES, NP_DTYPES, NP_NAMES,
                                             Unencodable, check_bools, check_dims, check_nbytes)

__all__ = ["decode_observation", "encode_result", "pack_metadata"]

_ARRAY_KEYS = frozenset({b"__ndarray__", b"data", b"dtype", b"shape"})
_SCALAR_KEYS = frozenset({b"__npgeneric__", b"data", b"dtype"})
#: the dtype strings a sender may use (``dtype.str``, or phyrt's own codes) -> phyrt's dtype name
_DTYPE_NAMES = {**{NP_DTYPES[name].str: name for name in NP_CODES},
                **{code: name for name, code in NP_CODES.items()}}
_ALLOWED = ", ".join(sorted({NP_DTYPES[name].str for name in NP_CODES}))
_PLAIN = (str, int, float, bool, bytes, type(None))


# --------------------------------------------------------------------------- decoding


def decode_observation(message: bytes, batch_dim: bool) -> Any:
    """The request for ``engine.submit`` that one openpi message holds; ProtocolError if malformed."""
    try:
        obj = msgpack.unpackb(message, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack's own errors: ValueError, ExtraData, FormatError, ...
        raise ProtocolError(f"not a msgpack message: {type(exc).__name__}: {exc}"[:CLIP]) from None
    return _decode(obj, batch_dim, 0, "observation")


def _decode(obj: Any, batch_dim: bool, depth: int, path: str) -> Any:
    if isinstance(obj, _PLAIN):
        return obj
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        return [_decode(v, batch_dim, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):  # an ExtType or a Timestamp
        raise ProtocolError(f"{path}: msgpack extension types are not accepted, got {type(obj).__name__}")
    if b"__ndarray__" in obj:
        return _array(obj, batch_dim, path)
    if b"__npgeneric__" in obj:
        return _scalar(obj, batch_dim, path)
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise ProtocolError(f"{path}: map keys must be str, got {key!r}"[:CLIP])
        out[key] = _decode(value, batch_dim, depth + 1, f"{path}.{key}")
    return out


def _dtype_name(value: Any, path: str) -> str:
    name = _DTYPE_NAMES.get(value) if isinstance(value, str) else None
    if name is None:
        raise ProtocolError(f"{path}: dtype {value!r} is not allowed; allowed: {_ALLOWED}"[:CLIP])
    return name


def _array(obj: dict, batch_dim: bool, path: str) -> torch.Tensor:
    if obj.keys() != _ARRAY_KEYS or obj[b"__ndarray__"] is not True:
        raise ProtocolError(f"{path}: an array map has exactly the keys __ndarray__ (True), data, dtype and "
                            f"shape, got {sorted(map(repr, obj))}"[:CLIP])
    data = obj[b"data"]
    if not isinstance(data, bytes):
        raise ProtocolError(f"{path}: an array's data must be bytes, got {type(data).__name__}")
    name = _dtype_name(obj[b"dtype"], path)
    try:
        shape = check_dims(obj[b"shape"], "shape", MAX_TENSOR_BYTES)
    except ProtocolError as exc:
        raise ProtocolError(f"{path}: {exc}") from None
    if batch_dim and len(shape) >= MAX_NDIM:  # the batch dimension would make one too many
        raise ProtocolError(f"{path}: an array has at most {MAX_NDIM - 1} dimensions here (the door adds one)")
    try:
        count = check_nbytes(name, shape, len(data))
        if name == "bool":
            check_bools(data, count)
    except ProtocolError as exc:
        raise ProtocolError(f"{path}: {exc}") from None
    if batch_dim:
        shape = [1, *shape]
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=getattr(torch, name))
    # copied: msgpack made ``data`` an immutable bytes object (a one-byte one is the interpreter's
    # shared b"\xNN"), and torch has no read-only tensors, so a view would let an in-place op of the
    # plugin change it. One memcpy of the array (an image of 150 KB: ~10 µs) next to msgpack's own.
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, name), count=count).reshape(shape)


def _scalar(obj: dict, batch_dim: bool, path: str) -> torch.Tensor:
    if obj.keys() != _SCALAR_KEYS or obj[b"__npgeneric__"] is not True:
        raise ProtocolError(f"{path}: a numpy scalar map has exactly the keys __npgeneric__ (True), data and "
                            f"dtype, got {sorted(map(repr, obj))}"[:CLIP])
    name = _dtype_name(obj[b"dtype"], path)
    data = obj[b"data"]
    dtype = NP_DTYPES[name]
    if name == "bool":
        fits = isinstance(data, bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        fits = isinstance(data, int) and not isinstance(data, bool) and info.min <= data <= info.max
    else:
        fits = isinstance(data, (int, float)) and not isinstance(data, bool)
    if not fits:
        raise ProtocolError(f"{path}: {data!r} is not a value of dtype {name}"[:CLIP])
    tensor = torch.from_numpy(np.array(data, dtype=dtype))
    return tensor.reshape(1) if batch_dim else tensor


# --------------------------------------------------------------------------- encoding


def encode_result(result: Any, batch_dim: bool) -> bytes:
    """The openpi message of the plugin's ``result``; TypeError, naming where, for a value
    openpi's format cannot carry (or, with ``batch_dim``, an array whose first dimension is
    not the batch of 1)."""
    return msgpack.packb(encode(result, functools.partial(_leaf, batch_dim), 0, "result"), use_bin_type=True)


def pack_metadata(metadata: dict[str, Any]) -> bytes:
    """The metadata map as openpi's client reads it (plain data; arrays as in results)."""
    return msgpack.packb(encode(metadata, functools.partial(_leaf, False), 0, "metadata"), use_bin_type=True)


def _leaf(batch_dim: bool, obj: Any) -> Any:
    """What ``codec.encode`` calls for a value msgpack cannot pack as it is."""
    if isinstance(obj, torch.Tensor):
        obj = _tensor_array(obj)
    if isinstance(obj, np.ndarray):
        return _array_map(obj, batch_dim)
    if isinstance(obj, (np.bool_, np.integer, np.floating)) and obj.dtype in NP_NAMES:
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise Unencodable(f"a value of type {type(obj).__name__} cannot be sent to an openpi client")


def _tensor_array(t: torch.Tensor) -> np.ndarray:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise Unencodable(f"only dense tensors can be sent, got {t.layout}")
    t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds every value
        t = t.float()
    name = str(t.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise Unencodable(f"dtype {t.dtype} cannot be sent; allowed: {_ALLOWED}, and bfloat16 as float32")
    return t.cpu().numpy()


def _array_map(arr: np.ndarray, batch_dim: bool) -> dict[bytes, Any]:
    if arr.dtype not in NP_NAMES:
        raise Unencodable(f"dtype {arr.dtype} cannot be sent; allowed: {_ALLOWED}")
    if batch_dim:
        if arr.ndim == 0 or arr.shape[0] != 1:
            raise Unencodable(f"shape {list(arr.shape)} has no leading batch dimension of 1 to remove "
                              "(the door runs one observation at a time; see batch_dim)")
        arr = arr[0]
    return {b"__ndarray__": True, b"data": np.ascontiguousarray(arr).tobytes(), b"dtype": arr.dtype.str,
            b"shape": list(arr.shape)}
