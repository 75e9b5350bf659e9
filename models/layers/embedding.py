"""Vocabulary-parallel embedding and LM head (vocab rows split over a named group).

    ids (replicated) -> VocabParallelEmbedding: rows of my shard, 0 elsewhere -> P.all_reduce -> x
    x (replicated)   -> ParallelLMHead: logits of my shard -> P.gather(dim=-1) -> logits on group rank 0

The vocabulary is PADDED to a multiple of the group size rather than required to
divide it: each rank holds ``ceil(V / tp)`` rows, rows past ``V`` stay zero, and
``ParallelLMHead`` cuts the gathered logits back to ``V`` columns. The padded rows are
never looked up (ids are < V) and never returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from models.layers import packed as packing
from models.layers.linear import check_shape, copy_into, take
from runtime import parallel as P


class VocabParallelEmbedding(nn.Module):
    """``weight[ids]`` with the ``[V, D]`` table split by rows: rank r holds ``[r*s, (r+1)*s)``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.group, self.tp_rank, self.tp_size = group, P.rank(group), P.size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)  # real rows held
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.zeros(self.shard_size, embedding_dim, **kw), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any) -> None:
        """Copy rows ``[vocab_start, vocab_end)`` of the full ``[V, D]`` table; padding rows get 0."""
        check_shape(self, loaded, [self.num_embeddings, self.embedding_dim])
        held = max(0, self.vocab_end - self.vocab_start)
        if held:
            copy_into(param[:held], take(loaded, 0, self.vocab_start, held))
        with torch.no_grad():
            param[held:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        y = F.embedding((ids - self.vocab_start) * mine, self.weight)
        return P.all_reduce(y * mine.unsqueeze(-1).to(y.dtype), self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, dim={self.embedding_dim}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), group={self.group!r}, tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """``x W^T`` over the vocab shards, gathered to group rank 0 (None on the other ranks).

    Ties with an embedding by sharing its parameter: ``head.weight = embed.weight``
    (same ``num_embeddings``, dim and group, hence the same shard).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, *, group: str = "dense_tp",
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        if bias:
            raise ValueError("ParallelLMHead: bias=True is not supported (Qwen3's lm_head has no bias)")
        super().__init__(num_embeddings, embedding_dim, group=group, params_dtype=params_dtype, device=device)
        self.packed: Any = None  # models.layers.packed.pack_model: the weight reordered for oneDNN (CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = packing.matmul(self, x)
        if self.tp_size == 1:
            return logits[..., :self.num_embeddings] if self.shard_size != self.num_embeddings else logits
        logits = P.gather(logits, self.group, dst=0, dim=-1)
        return logits[..., :self.num_embeddings] if logits is not None else None
