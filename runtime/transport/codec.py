"""The codec core of both wires: dtypes, field checks, and msgpack's fast paths.

Two wires speak msgpack with tensors as extensions, each with its own framing and
extension codes (``wire``: engine <-> ranks, one frame a message; ``protocol``: client
<-> server, a header frame and a frame a tensor); all they share lives here, once::

    encoding                                   decoding
    pack(obj, pairs, leaf): packable(pairs)?   loads(frame, ext_hook): map hooks, no Timestamp
      yes: msgpack's C packer, default=leaf      ext_hook(code, body), each wire's own:
      no: None -> encode(obj, leaf), the           loads_descriptor(body) -> check_*()
        slow path that names what it refuses       -> build(): numpy array or torch tensor

Invariants: map keys are str; nothing nests deeper than MAX_DEPTH on encoding; tensor
bytes are little-endian, C order (no big-endian host imports this); dtypes come from
one allow-list; bfloat16 (no numpy dtype) decodes to torch only. Decoding treats its
input as untrusted: any failure is a ``ProtocolError`` naming the value (clipped to
CLIP characters). Nothing is ever pickled. Leaf module: imports only
``runtime.core.errors`` of the project, and torch only in ``build`` for torch output.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any, Callable, Collection, Iterable

import msgpack
import numpy as np

from runtime.core.errors import ProtocolError

if sys.byteorder != "little":  # the wires carry raw little-endian bytes
    raise ImportError("runtime.transport supports little-endian hosts only")

MAX_DEPTH = 32
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: far above any real tensor, far below int64 overflow
CLIP = 300  # how many characters of an offending value an error message quotes
#: a memoryview frame up to this size is copied to bytes, whose C-level scans (``in``) are cheap
SCAN_COPY_LIMIT = 4096

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


def _little_endian(arr: np.ndarray) -> tuple[str, np.ndarray]:
    """The wire name of an array whose dtype is not a wire dtype as it is, and the array in
    little-endian order (a copy); Unencodable if no byte order makes it one."""
    name = NP_NAMES.get(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else None
    if name is None:
        raise _refused(arr.dtype)
    return name, arr.astype(NP_DTYPES[name])


def _torch_name(t: Any, torch: Any) -> str:
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


# --------------------------------------------------------------------------- encoding
#
# The fast path lets msgpack's C packer walk the value and hands it, through
# ``default=`` (leaf), only tensors and numpy scalars. msgpack would also pack what
# the wires forbid (non-str keys, ExtType, Timestamp, nesting past MAX_DEPTH) and
# would refuse a strided memoryview, so packable first walks the containers, and
# only those, building no paths. What it does not vouch for goes down the slow
# path, encode, which names the path of what it rejects; a value that leaf
# rejects on the fast path is located by identity once it has failed.

#: exact types msgpack packs as they are
_PLAIN = frozenset({str, int, float, bool, type(None), bytes})
#: what the slow path converts (a subclass, a strided memoryview) or refuses (ExtType, Timestamp);
#: a bytearray is in neither set: msgpack packs it as the bin that the slow path's bytes(obj) is
_SLOW = (dict, list, tuple, memoryview, msgpack.ExtType, msgpack.Timestamp)
_STR = frozenset({str})


def packable(pairs: Iterable[tuple[Any, Any]], depth: int) -> bool:
    """Whether msgpack, with ``leaf`` as ``default=``, packs the values of ``pairs`` (the items
    of a container at ``depth``) exactly as ``encode`` then packb would. A map's keys and a
    list of plain scalars each cost one C-level scan and no call; only values that are not
    plain scalars are looked at one by one (a small request's payload: 0.8 µs, not 1.2)."""
    for key, value in pairs:
        if type(key) is not str or (type(value) not in _PLAIN and not _packable_value(value, depth)):
            return False
    return True


def _packable_value(value: Any, depth: int) -> bool:
    """packable for one value that is not a plain scalar, an item of a container at ``depth``."""
    if depth >= MAX_DEPTH:  # the value would sit past the limit
        return False
    t = type(value)
    if t is dict:
        if not _STR.issuperset(map(type, value)):
            return False
        for item in value.values():
            if type(item) not in _PLAIN and not _packable_value(item, depth + 1):
                return False
        return True
    if t is list or t is tuple:
        return _PLAIN.issuperset(map(type, value)) or _packable_seq(value, depth + 1)
    return not issubclass(t, _SLOW)


def _packable_seq(seq: list[Any] | tuple[Any, ...], depth: int) -> bool:
    """packable for a list or tuple at ``depth`` that holds more than plain scalars."""
    if depth >= MAX_DEPTH:  # an item would sit past the limit
        return False
    for item in seq:
        if type(item) not in _PLAIN and not _packable_value(item, depth):
            return False
    return True


def leaf(refusal: str, tensor: Callable[[Any, Any, str], Any], context: Any, obj: Any) -> Any:
    """msgpack's ``default=`` (the first three arguments bound): ``tensor(context, obj, name)`` for
    an array (little-endian by then) or a dense tensor of wire dtype ``name``, a numpy scalar's
    Python number, else Unencodable, ``refusal`` formatted with the type's name."""
    try:
        if isinstance(obj, np.ndarray):
            name = NP_NAMES.get(obj.dtype)
            if name is None:
                name, arr = _little_endian(obj)
                return tensor(context, arr, name)
            return tensor(context, obj, name)
        torch = sys.modules.get("torch")  # a torch tensor implies torch is imported
        if torch is not None and isinstance(obj, torch.Tensor):
            return tensor(context, obj, _torch_name(obj, torch))
        if isinstance(obj, (np.bool_, np.integer, np.floating)):
            return obj.item()
        if isinstance(obj, int):  # msgpack hands on the ints it cannot fit in 64 bits
            raise OverflowError("Integer value out of range")
        raise Unencodable(refusal.format(type(obj).__name__))
    except Unencodable as exc:
        exc.obj = obj  # the value itself: the fast path finds where it sat by identity
        raise


def pack(obj: Any, pairs: Collection[tuple[str, Any]], default: Callable[[Any], Any]) -> bytes | None:
    """The fast path: the msgpack bytes of ``obj``, which holds the (path, value) ``pairs`` at
    depth 1 and plain scalars besides; None where ``packable`` does not vouch for them (the
    caller takes the slow path, ``encode``). An Unencodable becomes a TypeError naming the path."""
    if not packable(pairs, 0):
        return None
    try:  # a Packer of its own: msgpack.packb, a Python wrapper around one, costs more on small messages
        return msgpack.Packer(use_bin_type=True, default=default).pack(obj)
    except Unencodable as exc:  # find where the value sat only now that it failed
        raise TypeError(f"{_locate(pairs, exc.obj)}: {exc}") from None


def _locate(roots: Iterable[tuple[str, Any]], target: Any) -> str:
    """The path of ``target``, first in packing order (packable values only: no cycles)."""
    stack = list(roots)[::-1]
    while stack:
        path, obj = stack.pop()
        if obj is target:
            return path
        if type(obj) is dict:
            stack.extend([(f"{path}.{key}", value) for key, value in obj.items()][::-1])
        elif type(obj) is list or type(obj) is tuple:
            stack.extend([(f"{path}[{i}]", value) for i, value in enumerate(obj)][::-1])
    return "<message>"


def encode(obj: Any, default: Callable[[Any], Any], depth: int, path: str) -> Any:
    """The slow path: ``obj`` (at ``depth``) rebuilt of what msgpack packs as it is, the rest
    through ``default`` (a bound ``leaf``); every error names ``path``."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: map keys must be str, got {key!r}"[:CLIP])
            out[key] = encode(value, default, depth + 1, f"{path}.{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [encode(v, default, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    try:
        return default(obj)
    except Unencodable as exc:
        raise TypeError(f"{path}: {exc}") from None


def ext(code: int, payload: bytes) -> msgpack.ExtType:
    # ExtType is a namedtuple whose __new__ re-checks in Python what is known here
    return tuple.__new__(msgpack.ExtType, (code, payload))


# --------------------------------------------------------------------------- decoding
#
# msgpack's C unpacker does most of the checking: unpackb (msgpack >= 1.0) bounds
# every length by the frame, and strict_map_key refuses keys but str and bytes. The
# rest is one Python call per map: duplicate keys, and bytes keys where the frame has
# a bin header (0xc4-0xc6; three memchr). msgpack decodes a Timestamp (ext -1) without
# ext_hook: only a frame with one of its encodings has every map and list looked at.

#: how a msgpack Timestamp can start: fixext 4 or 8, or ext 8/16/32 of 4, 8 or 12 bytes (msgpack
#: decodes each). Bytes like these inside a str or bin only cost the hooks that then find nothing.
_TIMESTAMP = re.compile(rb"[\xd6\xd7]\xff|\xc7[\x04\x08\x0c]\xff|\xc8\x00[\x04\x08\x0c]\xff"
                       rb"|\xc9\x00\x00\x00[\x04\x08\x0c]\xff")


def _unique_map(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The map hook where no key can be bytes."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _map_error(out, pairs)
    return out


def _str_key_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """The map hook where a key can be bytes (strict_map_key lets through str and bytes only)."""
    out = dict(pairs)  # not _unique_map(pairs): one Python call per map is what decoding costs
    if len(out) != len(pairs) or bytes in map(type, out):
        raise _map_error(out, pairs)
    return out


def _map_error(out: dict[Any, Any], pairs: list[tuple[Any, Any]]) -> ProtocolError:
    if len(out) != len(pairs):
        return ProtocolError("a map has duplicate keys")
    return ProtocolError(f"map keys must be str, got {next(k for k in out if type(k) is not str)!r}"[:CLIP])


_NO_TIMESTAMP = "extension type -1 (msgpack Timestamp) is not allowed"


def _checked_map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    out = _str_key_map(pairs)
    if msgpack.Timestamp in map(type, out.values()):
        raise ProtocolError(_NO_TIMESTAMP)
    return out


def _checked_list(items: list[Any]) -> list[Any]:
    if msgpack.Timestamp in map(type, items):
        raise ProtocolError(_NO_TIMESTAMP)
    return items


def loads(data: Any, ext_hook: Callable[[int, bytes], Any], what: str) -> Any:
    """Decode one whole frame (bytes or any buffer): str keys, no duplicates, no Timestamp;
    ProtocolError on anything malformed, ``what`` naming the frame in the message."""
    try:
        if type(data) is not bytes and type(data) is not bytearray:
            data = memoryview(data)
            if data.nbytes <= SCAN_COPY_LIMIT and data.c_contiguous:
                data = data.tobytes()
        if type(data) is memoryview:  # a large frame: ``in`` would iterate it in Python
            stamped, bins = _TIMESTAMP.search(data) is not None, True
        else:
            stamped = 0xFF in data and _TIMESTAMP.search(data) is not None
            bins = 0xC4 in data or 0xC5 in data or 0xC6 in data
        if stamped:
            return msgpack.unpackb(data, strict_map_key=True, object_pairs_hook=_checked_map,
                                   list_hook=_checked_list, ext_hook=ext_hook)
        return msgpack.unpackb(data, strict_map_key=True, object_pairs_hook=_str_key_map if bins else _unique_map,
                               ext_hook=ext_hook)
    except ProtocolError:
        raise
    except Exception as exc:  # untrusted input: any failure to decode is a protocol failure
        raise ProtocolError(f"malformed {what}: {type(exc).__name__}: {exc}"[:CLIP]) from exc


def reject_ext(code: int, payload: bytes) -> Any:
    raise ProtocolError(f"extension type {code} is not allowed inside a tensor descriptor")


def loads_descriptor(payload: bytes) -> Any:
    """Decode an extension's body, a tensor descriptor. Its callers check the type of every
    field, which refuses bytes keys and Timestamps as well; duplicate keys are refused here."""
    try:
        return msgpack.unpackb(payload, strict_map_key=True, object_pairs_hook=_unique_map, ext_hook=reject_ext)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed tensor descriptor: {type(exc).__name__}: {exc}"[:CLIP]) from exc
