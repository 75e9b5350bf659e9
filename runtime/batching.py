"""Dynamic batching helpers: the key that groups requests, and stacking them into one batch.

With ``EngineConfig(batching=BatchingConfig(max_batch_size=16, max_delay_ms=2))`` a replica
takes up to 16 of its queued requests (waiting at most 2 ms after the first) and hands them
to its runner's ``execute_batch(requests) -> results`` in one call. The contract:

- ``requests`` is a list of requests with equal ``batch_key``: the same structure (dict keys,
  list and tuple lengths), the same non-tensor values, and tensors or arrays that agree in
  everything (kind, dtype, device, trailing dimensions) but their leading dimension.
- The runner returns one result per request, in the same order. A result list of the wrong
  length, or an exception, fails exactly that batch's requests, each with the cause.
- On a replica of several ranks every rank gets the same batch, so a batched forward with
  collectives inside it is fine.

The helpers turn the list into one request and the one result back into a list::

    from runtime.batching import leading_sizes, stack, unstack

    class Runner:
        def execute(self, request):                  # {"obs": [B, obs_dim]}
            return {"actions": self.model(request["obs"])}

        def execute_batch(self, requests):
            batched = stack(requests)                # {"obs": [sum B_i, obs_dim]}
            result = self.execute(batched)           # one forward
            return unstack(result, leading_sizes(requests))

``batch_key`` lives in ``runtime.core.batch_key`` (the engine calls it per request on the
submit path, from layers below this module); it is handed out here with the rest.
"""

from __future__ import annotations

import sys
from typing import Any, Hashable, Sequence

from runtime.core.batch_key import batch_key

__all__ = ["batch_key", "leading_sizes", "stack", "unstack"]

#: hashable scalar leaves: equal by key means equal in value, so a batch takes the first one's
_SCALARS = (str, int, float, bool, bytes, type(None))
_Path = Any  # a key (str, int) or a sequence of keys


def stack(requests: Sequence[Any]) -> Any:
    """One request of the same structure as each of ``requests`` (equal ``batch_key``).

    Torch tensors are concatenated along dim 0 (``torch.cat``), numpy arrays likewise
    (``np.concatenate``); a 0-dim tensor or array (or numpy scalar) becomes a 1-D one of
    ``len(requests)`` values (``torch.stack``/``np.stack``). Other leaves are taken from the
    first request: they are equal. Dicts come back as ``dict`` (in the first request's key
    order), lists as ``list``, tuples as their own type (namedtuples too). The tensors of the
    result are new memory, never the requests'. ValueError, naming the path
    (``request['obs']``), where the requests differ or a leaf cannot be stacked.
    """
    requests = list(requests)
    if not requests:
        raise ValueError("stack needs at least one request")
    return _stack(requests, "request")


def unstack(result: Any, n: int | Sequence[int]) -> list[Any]:
    """The inverse of ``stack`` on a result: a list of per-request results.

    ``n`` an int: every tensor or array of ``result`` is cut into ``n`` equal pieces along dim 0
    (ValueError if its leading size is not divisible by ``n``). ``n`` a sequence of ints (such as
    ``leading_sizes(requests)``): into pieces of those leading sizes (ValueError if they do not
    sum to its leading size). Dicts, lists and tuples are walked; any other leaf goes, as the
    same object, into every piece. A 0-dim tensor cannot be cut: ValueError.

    The pieces are views (``torch.split``, ``np.split``): they share memory with ``result``, so
    an in-place edit of one piece shows in ``result``, and a piece keeps all of ``result``'s
    memory alive. The engine's transport copies each result anyway; clone a piece to own it.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        sizes = [int(s) for s in n]
        if not sizes or any(s < 0 for s in sizes):
            raise ValueError(f"unstack: the sizes must be a non-empty list of ints >= 0, got {list(n)}")
        count = len(sizes)
    elif n < 1:
        raise ValueError(f"unstack: n must be >= 1, got {n}")
    else:
        sizes, count = None, n
    return _unstack(result, count, sizes, "result")


def leading_sizes(requests: Sequence[Any], path: _Path = None) -> list[int]:
    """The leading size of one tensor or array in each request: for ``unstack(out, leading_sizes(requests))``.

    ``path`` None: the first tensor or array with at least one dimension, dict keys taken in
    sorted order (as ``batch_key`` walks them). Else the leaf at ``path``: a key (``"obs"``) or a
    sequence of keys and indices (``("inputs", "obs")``); a 0-dim leaf counts 1 (``stack`` makes
    it one row). ValueError when there is no such leaf.
    """
    sizes = []
    for i, request in enumerate(requests):
        if path is None:
            leaf = _first_array(request)
            if leaf is None:
                raise ValueError(f"leading_sizes: request {i} holds no tensor or array with a leading dimension")
        else:
            leaf = _at(request, path, i)
        sizes.append(1 if leaf.ndim == 0 else int(leaf.shape[0]))
    return sizes


def _kind(value: Any) -> str:
    """"torch", "numpy", "scalar", "dict", "list", "tuple" or "other"."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")  # a tensor implies its module is loaded
    if torch is not None and isinstance(value, torch.Tensor):
        return "torch"
    if np is not None and isinstance(value, np.ndarray):
        return "numpy"
    if isinstance(value, _SCALARS):  # np.float64 too: batch_key takes its value
        return "scalar"
    if np is not None and isinstance(value, np.generic):  # np.float32 and kin: 0-dim arrays to batch_key
        return "numpy"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, list):
        return "list"
    return "tuple" if isinstance(value, tuple) else "other"


def _stack(items: list[Any], path: str) -> Any:
    first = items[0]
    kind = _kind(first)
    for i, item in enumerate(items[1:], 1):
        if type(item) is not type(first):
            _differ(path, i, type(item).__name__, type(first).__name__)
    if kind == "dict":
        for i, item in enumerate(items[1:], 1):
            if item.keys() != first.keys():
                _differ(path, i, f"keys {_names(item)}", f"keys {_names(first)}")
        return {k: _stack([item[k] for item in items], f"{path}[{k!r}]") for k in first}
    if kind in ("list", "tuple"):
        for i, item in enumerate(items[1:], 1):
            if len(item) != len(first):
                _differ(path, i, f"length {len(item)}", f"length {len(first)}")
        values = [_stack([item[j] for item in items], f"{path}[{j}]") for j in range(len(first))]
        return _rebuild(first, values)
    if kind in ("torch", "numpy"):
        return _stack_arrays(items, path, kind)
    if kind == "other" and any(item is not first for item in items):
        raise ValueError(f"stack: {path} is a {type(first).__name__}, which cannot be batched "
                         "(batch_key makes such a request unique)")
    for i, item in enumerate(items[1:], 1):
        if item is not first and item != first:
            _differ(path, i, repr(item), repr(first))
    return first


def _stack_arrays(items: list[Any], path: str, kind: str) -> Any:
    first = items[0]
    want = _describe(first)
    for i, item in enumerate(items[1:], 1):
        if item.ndim != first.ndim or item.shape[1:] != first.shape[1:] or item.dtype != first.dtype or (
                kind == "torch" and item.device != first.device):
            _differ(path, i, _describe(item), want)
    if kind == "torch":
        import torch
        return torch.stack(items) if first.ndim == 0 else torch.cat(items)
    import numpy as np
    return np.stack(items) if first.ndim == 0 else np.concatenate(items)


def _unstack(value: Any, count: int, sizes: list[int] | None, path: str) -> list[Any]:
    kind = _kind(value)
    if kind == "dict":
        parts = {k: _unstack(v, count, sizes, f"{path}[{k!r}]") for k, v in value.items()}
        return [{k: part[i] for k, part in parts.items()} for i in range(count)]
    if kind in ("list", "tuple"):
        columns = [_unstack(v, count, sizes, f"{path}[{j}]") for j, v in enumerate(value)]
        return [_rebuild(value, [column[i] for column in columns]) for i in range(count)]
    if kind not in ("torch", "numpy"):
        return [value] * count
    if value.ndim == 0:
        raise ValueError(f"unstack: {path} is 0-dim ({_describe(value)}); it has no leading dimension to cut")
    total = int(value.shape[0])
    if sizes is None:
        if total % count:
            raise ValueError(f"unstack: {path} has leading size {total}, which n={count} does not divide")
        pieces = [total // count] * count
    elif sum(sizes) != total:
        raise ValueError(f"unstack: {path} has leading size {total}, but the sizes {sizes} sum to {sum(sizes)}")
    else:
        pieces = sizes
    if kind == "torch":
        return list(value.split(pieces))
    import numpy as np
    return np.split(value, np.cumsum(pieces[:-1]))


def _rebuild(like: Any, values: list[Any]) -> Any:
    """A list or tuple of ``like``'s type holding ``values`` (a namedtuple through ``_make``)."""
    if type(like) is list or type(like) is tuple:
        return type(like)(values)
    make = getattr(type(like), "_make", None)
    return make(values) if make is not None else type(like)(values)


def _first_array(value: Any) -> Any:
    kind = _kind(value)
    if kind in ("torch", "numpy"):
        return value if value.ndim > 0 else None
    if kind == "dict":
        children = [value[k] for k in _sorted_keys(value)]
    elif kind in ("list", "tuple"):
        children = value
    else:
        return None
    for child in children:
        found = _first_array(child)
        if found is not None:
            return found
    return None


def _at(request: Any, path: _Path, index: int) -> Any:
    keys = tuple(path) if isinstance(path, (list, tuple)) else (path,)
    node = request
    try:
        for key in keys:
            node = node[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"leading_sizes: request {index} has nothing at {list(keys)}") from None
    if _kind(node) not in ("torch", "numpy"):
        raise ValueError(f"leading_sizes: request {index} holds a {type(node).__name__} at {list(keys)}, "
                         "not a tensor or array")
    return node


def _sorted_keys(d: dict) -> list[Any]:
    try:
        return sorted(d)
    except TypeError:  # keys of mixed types
        return list(d)


def _names(d: dict) -> list[str]:
    return sorted(map(repr, d))


def _describe(array: Any) -> str:
    device = f" on {array.device}" if _kind(array) == "torch" else ""
    return f"{type(array).__name__} {array.dtype} {list(array.shape)}{device}"


def _differ(path: str, index: int, theirs: str, first: str) -> None:
    raise ValueError(f"stack: the requests differ at {path}: request {index} has {theirs}, request 0 has "
                     f"{first} (only requests with equal batch_key can be stacked)")
