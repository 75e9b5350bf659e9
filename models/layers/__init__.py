"""Tensor-parallel layers; every collective goes through runtime.parallel on a named group."""

from models.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear

__all__ = ["ColumnParallelLinear", "LinearBase", "RowParallelLinear"]
