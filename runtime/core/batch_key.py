"""``batch_key(request)``: which requests may share a batch (``runtime.batching`` hands it out).

Requests with equal keys have the same structure, the same non-tensor values, and tensors that
agree in everything but their leading dimension, so ``runtime.batching.stack`` can concatenate
them. Duck-typed (an object with ``shape``, ``dtype`` and a ``ndim`` is a tensor or an array), so
this module needs neither torch nor numpy; the engine calls it per request when batching is on.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable

_SCALARS = (str, int, float, bool, bytes, type(None))
_unique = itertools.count()


def batch_key(request: Any) -> Hashable:
    """The key (see the module): dicts by sorted key, lists and tuples item by item; a tensor or
    array by its kind, dtype, shape but the first dimension and device; a scalar by its type and
    value. Anything else makes the key unique: that request is batched alone."""
    try:
        return _key(request)
    except _Unbatchable:
        return ("unique", next(_unique))


class _Unbatchable(Exception):
    pass


def _key(value: Any) -> Hashable:
    kind = type(value)
    if kind is dict:
        try:
            items = sorted(value.items())
        except TypeError:  # keys of mixed types
            raise _Unbatchable from None
        return ("dict", tuple((k, _key(v)) for k, v in items))
    if kind is list or kind is tuple:
        return (kind.__name__, tuple(_key(v) for v in value))
    if isinstance(value, _SCALARS):
        return (kind.__name__, value)
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype") and hasattr(value, "ndim"):
        dims = tuple(shape)
        device = getattr(value, "device", None)
        if not dims:
            return (kind.__name__, "0-dim", str(value.dtype), str(device))
        return (kind.__name__, str(value.dtype), dims[1:], str(device))
    raise _Unbatchable
