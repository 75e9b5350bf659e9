"""RMSNorm (Qwen3's: statistics in float32, the weight applied in the input dtype).

``norm(x)`` returns the normalised x. ``norm(x, residual)`` is the pre-norm block's
fused step: ``s = x + residual`` (in x's dtype, as transformers adds), returns
``(norm(s), s)`` so the caller carries ``s`` as the next residual.

In float32 the norm is torch's ``F.rms_norm``: one operator instead of six, bitwise equal
to the steps below on the CPU (tests/test_layers_qwen.py); other dtypes take the steps.

``rms_norm_heads(x, weight, eps)`` normalises each head of ``x`` [T, n, d] with its own
row of ``weight`` [n, d]: Qwen3's q_norm and k_norm in one pass over the query and key
heads together (the same operations per element as the two norms, so the same bits).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.weight = nn.Parameter(torch.ones(hidden_size, **kw), requires_grad=False)
        self.shape = (hidden_size,)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return _steps(x, self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _steps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm step by step: statistics in float32, ``weight`` applied in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every head of ``x`` [T, n, d] (a strided view will do) with ``weight`` [n, d]:
    row i of ``weight`` for head i."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight
    return _steps(x, weight, eps)
