"""The wire's CUDA IPC tensors (extension 3 of ``runtime.transport.wire``).

    sender (a rank, or the engine)                  receiver (same host, same GPUs)
    encode(t): torch's reduce_tensor(t) as a map    decode(map): every field checked, then
      {size, stride, offset, dtype, device,           rebuild_cuda_tensor opens the handle:
       handle, storage_size_bytes, ...}  -------->    a tensor aliasing the sender's memory

Invariants: the descriptor is exactly the arguments of torch 2.x's
``rebuild_cuda_tensor`` (classes implied), so nothing is pickled; the receiver
checks every field and that the view stays inside its storage before it opens
anything, and opens nothing unless its decoder allows CUDA IPC (the peer must be
a local rank). The tensor is valid while the sending process lives. torch is
imported by the callers' need only: encode gets it, decode imports it.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from runtime.core.errors import ProtocolError
from runtime.transport.codec import ext
from runtime.transport.tensor_fields import (FLOAT_NAMES, ITEMSIZE, MAX_TENSOR_BYTES, check_dims, check_dtype, check_keys,
                                             is_int)

EXT_CUDA_IPC = 3

_INT_KEYS = ("offset", "device", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")
_KEYS = frozenset(_INT_KEYS) | {"size", "stride", "dtype", "handle", "requires_grad",
                                "ref_counter_handle", "event_handle", "event_sync_required"}
_DIM_BOUND = MAX_TENSOR_BYTES + 1
#: in torch's refusal to share a tensor that this process got by CUDA IPC itself
RECEIVED_ELSEWHERE = "received from another process"


def encode(t: Any, name: str, torch: Any) -> msgpack.ExtType:
    """The extension of a CUDA tensor (``name``: its checked wire dtype)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    try:
        rebuild, args = reduce_tensor(t)
    except RuntimeError as exc:
        if RECEIVED_ELSEWHERE not in str(exc):
            raise
        rebuild, args = reduce_tensor(t.clone())  # the one device copy of a second trip
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
    return ext(EXT_CUDA_IPC, msgpack.packb(desc, use_bin_type=True))


def _check(body: Any) -> tuple[dict[str, Any], str, list[int], list[int]]:
    """The descriptor, its dtype, size and stride, once every field is of its type and in range."""
    d = check_keys(body, _KEYS, "CUDA IPC")
    name = check_dtype(d["dtype"])
    size = check_dims(d["size"], "size", _DIM_BOUND)
    stride = check_dims(d["stride"], "stride", _DIM_BOUND, len(size))
    for key in _INT_KEYS:
        if not is_int(d[key]) or not 0 <= d[key] <= MAX_TENSOR_BYTES:
            raise ProtocolError(f"CUDA IPC field {key!r} must be an int in [0, 2**44], got {d[key]!r}")
    for key in ("requires_grad", "event_sync_required"):
        if not isinstance(d[key], bool):
            raise ProtocolError(f"CUDA IPC field {key!r} must be a bool, got {d[key]!r}")
    for key, optional in (("handle", True), ("ref_counter_handle", False), ("event_handle", True)):
        if not (isinstance(d[key], bytes) or (optional and d[key] is None)):
            raise ProtocolError(f"CUDA IPC field {key!r} must be bytes, got {type(d[key]).__name__}")
    if d["requires_grad"] and name not in FLOAT_NAMES:
        raise ProtocolError(f"requires_grad is set on a {name} tensor")
    # rebuild_cuda_tensor maps no storage when the handle is None or the size 0
    storage = 0 if d["handle"] is None else d["storage_size_bytes"]
    if math.prod(size):
        last = d["offset"] + sum((n - 1) * s for n, s in zip(size, stride))
        if (last + 1) * ITEMSIZE[name] > storage:
            raise ProtocolError(f"CUDA tensor view reaches past its storage of {storage} bytes")
    return d, name, size, stride


def decode(body: Any, allowed: bool, tensor_type: str) -> Any:
    """The tensor of a decoded descriptor; ProtocolError unless it checks out and may be opened."""
    d, name, size, stride = _check(body)
    if not allowed:
        raise ProtocolError("a CUDA IPC tensor arrived but this decoder does not allow CUDA IPC")
    if tensor_type != "torch":
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
