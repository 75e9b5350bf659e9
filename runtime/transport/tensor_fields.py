"""What a tensor's descriptor may say on either wire: the dtype allow-list, the checks of its
fields (dtype, shape, byte count, placement), and the array or tensor built over its bytes.

Leaf module: imports only ``runtime.core.errors`` of the project, and torch only in ``build`` for
torch output. ``runtime.transport.codec`` (msgpack's fast paths) and each wire's tensor codec
(``wire``, ``protocol``, ``cuda_ipc``; the openpi door's ``openpi_codec``) use it. Every check
treats its input as untrusted: a failure is a ``ProtocolError`` naming the value, clipped to
``CLIP`` characters.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from runtime.core.errors import ProtocolError

MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: far above any real tensor, far below int64 overflow
CLIP = 300  # how many characters of an offending value an error message quotes

# --------------------------------------------------------------------------- dtypes

#: wire name -> little-endian numpy type code; bfloat16 travels too, but only torch has it
NP_CODES = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "i1", "int16": "<i2",
            "int32": "<i4", "int64": "<i8", "uint8": "u1", "bool": "?"}
NP_DTYPES = {name: np.dtype(code) for name, code in NP_CODES.items()}
NP_NAMES = {dtype: name for name, dtype in NP_DTYPES.items()}
ITEMSIZE = {name: dtype.itemsize for name, dtype in NP_DTYPES.items()} | {"bfloat16": 2}
FLOAT_NAMES = frozenset({"float16", "float32", "float64", "bfloat16"})
_ALLOWED = ", ".join(sorted(ITEMSIZE))


class Unencodable(TypeError):
    """A value no wire carries; ``obj`` is set to it by ``leaf``, and the caller prefixes where it sat."""

    obj: Any = None


def _refused(dtype: Any) -> Unencodable:
    return Unencodable(f"dtype {dtype} is not allowed on the wire and cannot be sent; allowed: {_ALLOWED}")


def little_endian(arr: np.ndarray) -> tuple[str, np.ndarray]:
    """The wire name of an array whose dtype is not a wire dtype as it is, and the array in
    little-endian order (a copy); Unencodable if no byte order makes it one."""
    name = NP_NAMES.get(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else None
    if name is None:
        raise _refused(arr.dtype)
    return name, arr.astype(NP_DTYPES[name])


def torch_name(t: Any, torch: Any) -> str:
    """The wire name of a dense tensor's dtype; Unencodable for any other tensor."""
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        kind = "quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
        raise Unencodable(f"only dense strided tensors can be sent, got {kind}")
    name = str(t.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise _refused(t.dtype)
    return name


def build(buf: Any, name: str, shape: list[int], count: int, tensor_type: str) -> Any:
    """A numpy array (``tensor_type="numpy"``) or a torch tensor over ``buf`` itself, no copy,
    of a checked dtype and shape whose ``count`` elements fill ``buf``."""
    if name == "bool":
        check_bools(buf, count)
    if tensor_type == "numpy":
        if name == "bfloat16":  # raw uint16 bits handed back silently would be worse
            raise ProtocolError("bfloat16 has no numpy dtype; decode with tensor_type='torch'")
        return np.frombuffer(buf, dtype=NP_DTYPES[name], count=count).reshape(shape)
    import torch

    dtype = getattr(torch, name)
    if count == 0:  # torch.frombuffer rejects empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


# --------------------------------------------------------------------------- field checks


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _span(below: int) -> str:
    """``[0, below)`` as an error message writes it: 2**40 rather than 1099511627776."""
    for n, close in ((below, ")"), (below - 1, "]")):
        if n > 0 and n & (n - 1) == 0:
            return f"[0, 2**{n.bit_length() - 1}{close}"
    return f"[0, {below})"


def check_dtype(name: Any) -> str:
    if not isinstance(name, str) or name not in ITEMSIZE:
        raise ProtocolError(f"tensor dtype {name!r} is not allowed; allowed: {_ALLOWED}"[:CLIP])
    return name


def check_dims(dims: Any, what: str, below: int, ndim: int | None = None) -> list[int]:
    """``dims`` (a shape, a stride): at most MAX_NDIM ints, ``ndim`` of them if given, each in
    [0, below), a bound of each wire's own (the two differ on purpose)."""
    if not isinstance(dims, list) or len(dims) > MAX_NDIM:
        raise ProtocolError(f"tensor {what} must be a list of at most {MAX_NDIM} ints, got {dims!r}"[:CLIP])
    if ndim is not None and len(dims) != ndim:
        raise ProtocolError(f"tensor {what} has {len(dims)} entries for {ndim} dimensions")
    for d in dims:
        if not is_int(d) or not 0 <= d < below:
            raise ProtocolError(f"tensor {what} entries must be ints in {_span(below)}, got {dims!r}"[:CLIP])
    return dims


def check_nbytes(name: str, shape: list[int], nbytes: int, source: str = "got") -> int:
    """The element count of a checked dtype and shape, once ``nbytes`` (``source`` says whose) matches it."""
    count = math.prod(shape)
    if count * ITEMSIZE[name] != nbytes or nbytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"tensor of shape {shape} and dtype {name} needs {count * ITEMSIZE[name]} bytes, "
                            f"{source} {nbytes}"[:CLIP])
    return count


def check_keys(body: Any, keys: frozenset[str], what: str) -> dict[str, Any]:
    """A descriptor map with exactly ``keys`` (a bytes key is never one of them)."""
    if not isinstance(body, dict) or body.keys() != keys:
        got = sorted(map(repr, body)) if isinstance(body, dict) else type(body).__name__
        raise ProtocolError(f"{what} descriptor must have exactly the keys {sorted(keys)}, got {got}"[:CLIP])
    return body


def check_placement(segment: Any, offset: Any, name: str) -> None:
    """Where a shared-memory tensor of dtype ``name`` lies: a segment name, an aligned offset."""
    if not isinstance(segment, str):
        raise ProtocolError(f"segment must be a str, got {segment!r}"[:CLIP])
    if not is_int(offset) or offset < 0:
        raise ProtocolError(f"offset must be an int >= 0, got {offset!r}"[:CLIP])
    if offset % ITEMSIZE[name]:
        raise ProtocolError(f"offset {offset} is not aligned to the {name} element size")


def check_bools(buf: Any, count: int) -> None:
    """A bool tensor's bytes are 0 or 1: numpy and torch assume it, and other bytes misbehave."""
    if count and np.frombuffer(buf, dtype=np.uint8).max() > 1:
        raise ProtocolError("a bool tensor holds bytes other than 0 and 1")
