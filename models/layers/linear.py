"""Tensor-parallel linear layers (the nano-vllm shape: shard, load, forward).

    x (replicated) -> ColumnParallelLinear -> y shard [.., out/tp]     no communication
    y shard        -> RowParallelLinear    -> partial [.., out]        P.all_reduce(sum)
                                           -> y (replicated)

Each layer stores only its slice. A checkpoint loader hands every parameter the
FULL tensor through ``param.weight_loader(param, full)``, which checks its shape
and copies this rank's slice (converting dtype and device). The tensor-parallel
rank and size come from ``P.rank(group)``/``P.size(group)``; sizes that do not
divide are a ``ValueError`` at construction. Fused layers (QKV, gate/up) subclass
``ColumnParallelLinear`` and override ``weight_loader`` with a shard id.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from runtime import parallel as P


def divide(numerator: int, denominator: int, what: str, group: str) -> int:
    """``numerator // denominator``, or a ValueError naming ``what``, the group and both numbers."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the size {denominator} of group {group!r}")
    return numerator // denominator


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
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, **kw), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of the full tensor ``loaded`` into ``param``."""
        sharded = self.tp_dim is not None and self.tp_dim < param.dim()
        full = list(param.shape)
        if sharded:
            full[self.tp_dim] *= self.tp_size
        if list(loaded.shape) != full:
            raise ValueError(
                f"{type(self).__name__}.weight_loader: expected the full tensor of shape {tuple(full)} "
                f"(tp size {self.tp_size} on {self.group!r}), got {tuple(loaded.shape)}")
        if sharded:
            shard = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * shard, shard)
        with torch.no_grad():
            param.data.copy_(loaded)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, bias={self.bias is not None}, group={self.group!r}, tp={self.tp_rank}/{self.tp_size}"


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's output rows split: each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size = P.size(group)
        shard = divide(output_size, tp_size, f"{type(self).__name__}: output_size", group)
        super().__init__(input_size, shard, bias, 0, group=group, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with W's input columns split: takes a sharded x, returns the full y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        tp_size = P.size(group)
        shard = divide(input_size, tp_size, f"{type(self).__name__}: input_size", group)
        super().__init__(shard, output_size, bias, 1, group=group, params_dtype=params_dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by group rank 0, before the partial sums are added up.
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return P.all_reduce(y, self.group)
