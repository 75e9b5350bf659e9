"""Tensor-parallel layers; every collective goes through runtime.parallel on a named group."""

from models.layers.attention import Attention, AttentionMetadata
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVColumnParallelLinear,
    RowParallelLinear,
)
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention", "AttentionMetadata", "ColumnParallelLinear", "LinearBase", "MergedColumnParallelLinear",
    "ParallelLMHead", "QKVColumnParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear",
    "VocabParallelEmbedding",
]
