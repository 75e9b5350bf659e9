"""Request fingerprints: how the ranks of an external engine check that they were
all given the same request before they enter the plugin's collectives.

Leaf module: msgpack and hashlib only; torch and numpy are looked up in
``sys.modules``, never imported (a request can hold their objects only if they are
loaded).

``request_fingerprint(request)``: a 64-bit BLAKE2b digest of a canonical
msgpack encoding of the request. Covered exactly:
- structure: dicts (keys sorted, so insertion order does not count), lists and
  tuples (one kind: a tuple equals a list), and their nesting;
- values: None, bools, ints (arbitrary size), floats (bit exact), strings and bytes
  (in full up to ``FULL_BYTES``; longer ones: length plus ``SAMPLES`` evenly spaced
  8-byte windows);
- tensors (torch and numpy): dtype and shape, plus every element when the tensor
  holds at most ``FULL_BYTES`` bytes, else ``SAMPLES`` evenly spaced elements (the
  first and the last among them). The device is not covered: ranks may hold the
  same data on different devices;
- anything else: its type's qualified name only; so is anything nested deeper than
  64 levels.
So a difference in an element that was not sampled, or inside an object of another
type, goes unnoticed; shapes, dtypes, structure and small values never do.

"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import msgpack

__all__ = ["FULL_BYTES", "SAMPLES", "request_fingerprint"]

#: tensors and byte strings up to this size are fingerprinted in full
FULL_BYTES = 4096
#: elements (tensors) or 8-byte windows (bytes, strings) sampled from larger ones
SAMPLES = 64


def request_fingerprint(request: Any) -> int:
    """The 64-bit fingerprint of ``request`` (see the module docstring for what it covers)."""
    packed = msgpack.packb(_canonical(request, 0), use_bin_type=True)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


# ExtType codes of the canonical form, so that no plain value can spell a tag
_MAP, _SEQ, _INT, _BLOB, _TENSOR, _OBJECT = range(1, 7)
_SCALARS = frozenset({int, float, bool, type(None)})


def _canonical(obj: Any, depth: int) -> Any:
    if depth > 64:  # deeper nesting is not covered (and never an error, see _agree)
        return msgpack.ExtType(_OBJECT, b"deeper than 64 levels")
    if obj is None or isinstance(obj, (bool, float)):
        return obj
    if isinstance(obj, int):
        return obj if -(1 << 63) <= obj < (1 << 64) else msgpack.ExtType(_INT, str(obj).encode())
    if isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        return obj if len(data) <= FULL_BYTES else _blob(data, "str")
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj).cast("B") if isinstance(obj, memoryview) else memoryview(obj)
        return bytes(view) if len(view) <= FULL_BYTES else _blob(view, "bytes")
    if isinstance(obj, dict):
        pairs = [(msgpack.packb(_canonical(k, depth + 1), use_bin_type=True), _canonical(v, depth + 1))
                 for k, v in obj.items()]
        pairs.sort(key=lambda kv: kv[0])
        return msgpack.ExtType(_MAP, msgpack.packb(pairs, use_bin_type=True))
    if isinstance(obj, (list, tuple)):
        if all(type(x) in _SCALARS for x in obj):  # token ids and the like: packed as they are
            try:
                return msgpack.ExtType(_SEQ, msgpack.packb(list(obj), use_bin_type=True))
            except OverflowError:  # an int beyond 64 bits: spelled out below
                pass
        return msgpack.ExtType(_SEQ, msgpack.packb([_canonical(x, depth + 1) for x in obj], use_bin_type=True))
    # torch and numpy are looked up, not imported: a request can only hold their objects if they are loaded
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch(obj, torch)
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _numpy(np.asarray(obj), np)
    kind = type(obj)
    return msgpack.ExtType(_OBJECT, f"{kind.__module__}.{kind.__qualname__}".encode())


def _blob(data: Any, kind: str) -> msgpack.ExtType:
    view = memoryview(data).cast("B")
    n = len(view)
    starts = {(n - 8) * i // (SAMPLES - 1) for i in range(SAMPLES)}
    digest = hashlib.blake2b(b"".join(view[s:s + 8] for s in sorted(starts)), digest_size=16).digest()
    return msgpack.ExtType(_BLOB, msgpack.packb([kind, n, digest], use_bin_type=True))


def _torch(t: Any, torch: Any) -> msgpack.ExtType:
    head = [str(t.dtype).removeprefix("torch."), list(t.shape)]
    if t.layout != torch.strided or t.is_quantized or t.is_meta:
        return msgpack.ExtType(_TENSOR, msgpack.packb(head + [str(t.layout)], use_bin_type=True))
    t = t.detach()
    if t.numel() * t.element_size() > FULL_BYTES:  # gather the samples where they are, then copy them
        index = torch.arange(SAMPLES, dtype=torch.long, device=t.device) * (t.numel() - 1) // (SAMPLES - 1)
        t = torch.take(t, index)
    flat = t.reshape(-1).cpu().resolve_conj().resolve_neg().contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return msgpack.ExtType(_TENSOR, msgpack.packb(head + [raw], use_bin_type=True))


def _numpy(arr: Any, np: Any) -> msgpack.ExtType:
    head = [arr.dtype.str, list(arr.shape)]
    if arr.dtype.hasobject:  # the bytes would be pointers
        return msgpack.ExtType(_TENSOR, msgpack.packb(head + ["object"], use_bin_type=True))
    if arr.nbytes > FULL_BYTES:
        arr = np.take(arr, np.arange(SAMPLES, dtype=np.int64) * (arr.size - 1) // (SAMPLES - 1))
    raw = np.ascontiguousarray(arr).tobytes()
    return msgpack.ExtType(_TENSOR, msgpack.packb(head + [raw], use_bin_type=True))



def _measure() -> None:
    """Print the fingerprint's cost on this machine (``python -m runtime.execution.fingerprint``): best of 5."""
    import timeit

    import torch

    cases = {
        "small dict": {"op": "echo", "x": 1, "ranks": [0, 1]},
        "qwen3, 1,000 token ids": {"prompt_token_ids": list(range(1000)), "max_tokens": 64, "temperature": 0.0},
        "4 x 3x224x224 float32": {"images": [torch.randn(3, 224, 224) for _ in range(4)], "t": 0.5},
        "one 1 GiB float32 tensor": {"x": torch.empty(1 << 28)},
    }
    for name, request in cases.items():
        best = min(timeit.repeat(lambda: request_fingerprint(request), number=100, repeat=5)) / 100
        print(f"{name:28s} {best * 1e6:8.1f} us")


if __name__ == "__main__":
    _measure()
