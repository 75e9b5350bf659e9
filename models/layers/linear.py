"""Tensor-parallel linear layers (the nano-vllm shape: shard, load, forward).

    x (replicated) -> ColumnParallelLinear -> y shard [.., out/tp]     no communication
    y shard        -> RowParallelLinear    -> partial [.., out]        P.all_reduce(sum)
                                           -> y (replicated)

Each layer stores only its slice. A checkpoint loader hands every parameter the
FULL tensor through ``param.weight_loader(param, loaded[, shard_id])``, which checks
its shape and copies this rank's slice (converting dtype and device). ``loaded`` is
either a ``torch.Tensor`` or a lazy view of one that has ``.shape`` and basic
slicing (``models.loader`` passes a safetensors slice): a loader only ever indexes
it with the rows or columns its rank keeps, so a lazy view reads nothing else.

The tensor-parallel rank and size come from ``P.rank(group)``/``P.size(group)``;
sizes that do not divide are a ``ValueError`` at construction. Fused layers
subclass ``ColumnParallelLinear`` and take a shard id: ``QKVColumnParallelLinear``
("q"/"k"/"v", whole heads per rank, KV heads replicated when there are fewer
than ranks) and ``MergedColumnParallelLinear`` (0, 1, ... for gate, up).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.layers import packed as packing
from runtime import parallel as P


def divide(numerator: int, denominator: int, what: str, group: str) -> int:
    """``numerator // denominator``, or a ValueError naming ``what``, the group and both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the size {denominator} of group {group!r}")
    return numerator // denominator


def take(loaded: Any, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
    """``loaded[start:start+length]`` along ``dim`` (all of it for None) as a tensor.

    Works on tensors and on lazy slices alike, reading only the requested part.
    """
    if dim is None:
        return loaded[:]
    return loaded[(slice(None),) * dim + (slice(start, start + length),)]


def check_shape(layer: nn.Module, loaded: Any, full: list[int] | tuple[int, ...], what: str = "") -> None:
    if tuple(loaded.shape) != tuple(full):
        tp = f" (tp size {layer.tp_size} on {layer.group!r})" if hasattr(layer, "group") else ""
        raise ValueError(f"{type(layer).__name__}.weight_loader{what}: expected the full tensor of shape "
                         f"{tuple(full)}{tp}, got {tuple(loaded.shape)}")


def copy_into(param: torch.Tensor, part: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(part)


class LinearBase(nn.Module):
    """Holds a ``[output, input]`` weight (and bias) already cut along ``tp_dim``.

    ``tp_dim``: 0 shards outputs, 1 shards inputs, None replicates. A parameter
    with fewer dims than ``tp_dim + 1`` (the row-parallel bias) is loaded whole.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, *,
                 group: str, params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.group = group
        self.tp_dim = tp_dim
        self.tp_rank = P.rank(group)
        self.tp_size = P.size(group)
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.empty(output_size, input_size, **kw), requires_grad=False)
        self.weight_shape = (output_size, input_size)
        self.packed: Any = None  # models.layers.packed.pack_model: the weight reordered for oneDNN (CPU)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, **kw), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        """Copy this rank's slice of the full tensor ``loaded`` into ``param``."""
        sharded = self.tp_dim is not None and self.tp_dim < param.dim()
        full = list(param.shape)
        if sharded:
            full[self.tp_dim] *= self.tp_size
        check_shape(self, loaded, full)
        if sharded:
            shard = param.size(self.tp_dim)
            copy_into(param, take(loaded, self.tp_dim, self.tp_rank * shard, shard))
        else:
            copy_into(param, take(loaded))

    def extra_repr(self) -> str:
        out, inp = self.weight_shape
        return (f"in={inp}, out={out}, bias={self.bias is not None}, group={self.group!r}, "
                f"tp={self.tp_rank}/{self.tp_size}, packed={self.packed is not None}")


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split: each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size = P.size(group)
        shard = divide(output_size, tp_size, f"{type(self).__name__}: output_size", group)
        super().__init__(input_size, shard, bias, 0, group=group, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packing.matmul(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): ``[g_r | u_r]`` on rank r.

    ``weight_loader(param, loaded, shard_id)`` loads the ``shard_id``-th output
    (``output_sizes[shard_id]`` rows, full) into its place.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size = P.size(group)
        self.output_sizes = list(output_sizes)
        self.shard_sizes = [divide(n, tp_size, f"{type(self).__name__}: output_sizes[{i}]", group)
                            for i, n in enumerate(self.output_sizes)]
        super().__init__(input_size, sum(self.output_sizes), bias, group=group,
                         params_dtype=params_dtype, device=device)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        if isinstance(shard_id, bool) or not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"{type(self).__name__}.weight_loader: shard_id must be an int in "
                             f"[0, {len(self.shard_sizes)}), got {shard_id!r}")
        size = self.shard_sizes[shard_id]
        check_shape(self, loaded, [self.output_sizes[shard_id], *param.shape[1:]], f"[{shard_id}]")
        offset = sum(self.shard_sizes[:shard_id])
        copy_into(param[offset:offset + size], take(loaded, 0, self.tp_rank * size, size))


class QKVColumnParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, cut at head boundaries: ``[q_r | k_r | v_r]`` on rank r.

    Rank r keeps q heads ``[r*h, (r+1)*h)`` with ``h = total_num_heads / tp``. KV heads:
    ``total_num_kv_heads / tp`` per rank when that divides; when there are fewer KV
    heads than ranks and ``tp`` is a multiple of their count, each rank keeps ONE KV
    head, the one its q heads use (``r // (tp / total_num_kv_heads)``), replicated on
    ``tp / total_num_kv_heads`` ranks (as vLLM does).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False, *, group: str = "attention_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size, tp_rank, name = P.size(group), P.rank(group), type(self).__name__
        total_num_kv_heads = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        if total_num_heads % total_num_kv_heads:
            raise ValueError(f"{name}: total_num_heads {total_num_heads} is not a multiple of "
                             f"total_num_kv_heads {total_num_kv_heads}")
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, f"{name}: total_num_heads", group)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{name}: total_num_kv_heads", group)
            self.kv_head_start = tp_rank * self.num_kv_heads
        elif tp_size % total_num_kv_heads == 0:
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // total_num_kv_heads)
        else:
            raise ValueError(f"{name}: total_num_kv_heads {total_num_kv_heads} neither is divisible by nor "
                             f"divides the size {tp_size} of group {group!r}")
        output = (self.num_heads + 2 * self.num_kv_heads) * head_size
        LinearBase.__init__(self, hidden_size, output, bias, 0, group=group,
                            params_dtype=params_dtype, device=device)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str) -> None:
        d, q, kv = self.head_size, self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            total, offset, size, start = self.total_num_heads * d, 0, q, self.tp_rank * q
        elif shard_id in ("k", "v"):
            total, size, start = self.total_num_kv_heads * d, kv, self.kv_head_start * d
            offset = q if shard_id == "k" else q + kv
        else:
            raise ValueError(f"{type(self).__name__}.weight_loader: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(self, loaded, [total, *param.shape[1:]], f"[{shard_id!r}]")
        copy_into(param[offset:offset + size], take(loaded, 0, start, size))


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split: takes a sharded x, returns the full y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size = P.size(group)
        shard = divide(input_size, tp_size, f"{type(self).__name__}: input_size", group)
        super().__init__(shard, output_size, bias, 1, group=group, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by group rank 0, before the partial sums are added up.
        y = packing.matmul(self, x, self.bias if self.tp_rank == 0 else None)
        return P.all_reduce(y, self.group)
