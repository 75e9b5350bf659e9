"""The codec core of both wires: dtypes, field checks, and msgpack's fast paths.

Two wires speak msgpack with tensors as extensions, each with its own framing and
extension codes (``wire``: engine <-> ranks, one frame a message; ``protocol``: client
<-> server, a header frame and a frame a tensor); all they share lives here, once::

    encoding                                   decoding
    pack(obj, pairs, leaf): packable(pairs)?   loads(frame, ext_hook): map hooks, no Timestamp
      yes: msgpack's C packer, default=leaf      ext_hook(code, body), each wire's own:
      no: None -> encode(obj, leaf), the           loads_descriptor(body) -> check_*()
        slow path that names what it refuses       -> build(): numpy array or torch tensor
                                                 (the last two: ``runtime.transport.tensor_fields``)

Invariants: map keys are str; nothing nests deeper than MAX_DEPTH on encoding; tensor
bytes are little-endian, C order (no big-endian host imports this); dtypes come from
one allow-list; bfloat16 (no numpy dtype) decodes to torch only. Decoding treats its
input as untrusted: any failure is a ``ProtocolError`` naming the value (clipped to
CLIP characters). Nothing is ever pickled. Imports only ``runtime.core.errors`` and
``runtime.transport.tensor_fields`` (dtypes and descriptor checks) of the project.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, Collection, Iterable

import msgpack
import numpy as np

from runtime.core.errors import ProtocolError
from runtime.transport.tensor_fields import CLIP, NP_NAMES, Unencodable, little_endian, torch_name

if sys.byteorder != "little":  # the wires carry raw little-endian bytes
    raise ImportError("runtime.transport supports little-endian hosts only")

MAX_DEPTH = 32
#: a memoryview frame up to this size is copied to bytes, whose C-level scans (``in``) are cheap
SCAN_COPY_LIMIT = 4096

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
                name, arr = little_endian(obj)
                return tensor(context, arr, name)
            return tensor(context, obj, name)
        torch = sys.modules.get("torch")  # a torch tensor implies torch is imported
        if torch is not None and isinstance(obj, torch.Tensor):
            return tensor(context, obj, torch_name(obj, torch))
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
