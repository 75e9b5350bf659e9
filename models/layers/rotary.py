"""Rotary position embedding as Qwen3 uses it (rotate-half, default rope only).

``rope(positions [T], q [T, h, d], k [T, kv, d]) -> (q, k)``, both rotated by each
token's own position; ``rotate_heads(table, x)`` rotates any [T, n, d] heads at once.
The cos/sin table is computed once in float32 for ``max_position`` positions
(``pos * inv_freq``, exactly as transformers does) and cast to the query dtype when
applied.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_theta(config: Any) -> float:
    """``rope_theta`` of a transformers config (``rope_parameters`` or the legacy fields).

    Only the default rope is supported: any other ``rope_type``/``rope_scaling``, or a
    ``partial_rotary_factor`` other than 1, is a ValueError.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params = {**params, **scaling}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} ({params}) is not supported; only the default rope "
                         "(rope_scaling None) is")
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {factor} is not supported; only 1.0 is")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"the config gives no rope_theta (rope parameters: {params})")
    return float(theta)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_heads(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Every head of ``x`` [T, n, d] rotated by its token's row of ``table`` (``RotaryEmbedding.table``):
    the query and key heads may go together, in one [T, q_heads + kv_heads, d] tensor."""
    cos, sin = table
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, *, device: torch.device | str | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim {head_dim} must be even")
        self.head_dim, self.max_position, self.base = head_dim, max_position, base
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_sin", torch.stack((emb.cos(), emb.sin())).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(self.table(positions, q.dtype), q, k)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin at ``positions`` ([2, T, 1, d]): the same for every layer of a forward pass,
        so a model looks them up once and hands them to each layer's ``rotate``."""
        return self.cos_sin[:, positions].to(dtype).unsqueeze(-2)

    @staticmethod
    def rotate(table: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_heads(table, q), rotate_heads(table, k)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, base={self.base}"
