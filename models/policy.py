"""The demo plugin ``policy``: an action-chunk MLP with seeded random weights.

Request ``{"obs": float32 [B, obs_dim]}`` -> result ``{"actions": float32 [B, horizon, act_dim]}``
(values in [-1, 1]). ``execute_batch`` runs a batch of such requests (``BatchingConfig``) in one
forward. The network is tensor-parallel over ``dense_tp``::

    obs -> Column(obs_dim, hidden) -> gelu -> Row(hidden, hidden) -> gelu
        -> Column(hidden, hidden) -> gelu -> Row(hidden, horizon*act_dim) -> tanh -> reshape

Every rank draws the FULL weights from ``seed`` with a CPU ``torch.Generator`` and
keeps its slice through each parameter's ``weight_loader``, so any ``dense`` tp size
gives the actions of tp 1 (up to float rounding).

``plugin_args``: None or a dict with any of ``obs_dim`` (32), ``act_dim`` (7),
``horizon`` (8), ``hidden`` (256), ``seed`` (0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models.layers import ColumnParallelLinear, RowParallelLinear
from runtime import BuildContext, Entry, ParallelConfig
from runtime.batching import leading_sizes, stack, unstack


@dataclass(frozen=True)
class PolicyArgs:
    obs_dim: int = 32
    act_dim: int = 7
    horizon: int = 8
    hidden: int = 256
    seed: int = 0

    @classmethod
    def parse(cls, plugin_args: Any) -> "PolicyArgs":
        """Defaults for None; TypeError for a non-dict or a non-int value, ValueError otherwise."""
        if plugin_args is None:
            return cls()
        if not isinstance(plugin_args, dict):
            raise TypeError(f"policy plugin_args must be a dict or None, got {type(plugin_args).__name__}")
        known = cls.__dataclass_fields__
        unknown = sorted(str(k) for k in plugin_args if k not in known)
        if unknown:
            raise ValueError(f"policy plugin_args has unknown keys {unknown}; known: {sorted(known)}")
        for key, value in plugin_args.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"policy plugin_args[{key!r}] must be an int, got {value!r}")
            low, high = (0, 2**63 - 1) if key == "seed" else (1, 2**20)
            if not low <= value <= high:
                raise ValueError(f"policy plugin_args[{key!r}] must be in [{low}, {high}], got {value}")
        return cls(**plugin_args)


class PolicyMLP(nn.Module):
    def __init__(self, args: PolicyArgs, params_dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.args = args
        kw = {"params_dtype": params_dtype, "device": device}
        self.layers = nn.ModuleList([
            ColumnParallelLinear(args.obs_dim, args.hidden, **kw),
            RowParallelLinear(args.hidden, args.hidden, **kw),
            ColumnParallelLinear(args.hidden, args.hidden, **kw),
            RowParallelLinear(args.hidden, args.horizon * args.act_dim, **kw),
        ])

    def load_seeded_weights(self) -> None:
        """Draw the full weights in a fixed order (the same on every rank) and load slices."""
        gen = torch.Generator(device="cpu").manual_seed(self.args.seed)
        for layer in self.layers:
            fan_in = layer.weight.size(1) * (layer.tp_size if layer.tp_dim == 1 else 1)
            fan_out = layer.weight.size(0) * (layer.tp_size if layer.tp_dim == 0 else 1)
            weight = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
            bias = (torch.rand(fan_out, generator=gen) - 0.5) * 0.2
            layer.weight.weight_loader(layer.weight, weight)
            layer.bias.weight_loader(layer.bias, bias)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = F.gelu(x) if i < len(self.layers) - 1 else torch.tanh(x)
        return x.reshape(obs.shape[0], self.args.horizon, self.args.act_dim)


class PolicyRunner:
    """One rank's policy: ``execute({"obs": [B, obs_dim]}) -> {"actions": [B, horizon, act_dim]}``."""

    def __init__(self, ctx: BuildContext, args: PolicyArgs):
        self.args = args
        self.device = torch.device(ctx.device)
        dtype = ctx.params_dtype
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
        self.model = PolicyMLP(args, self.dtype, self.device).eval()
        self.model.load_seeded_weights()

    def execute(self, request: dict[str, Any]) -> dict[str, torch.Tensor]:
        obs = torch.as_tensor(request["obs"])
        if obs.dim() != 2 or obs.shape[1] != self.args.obs_dim:
            raise ValueError(f"policy: obs must have shape [B, {self.args.obs_dim}], got {list(obs.shape)}")
        with torch.inference_mode():
            actions = self.model(obs.to(self.device, self.dtype)).float()
        # A clone made outside inference mode is an ordinary tensor the caller may edit in place.
        return {"actions": actions.clone()}

    def execute_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """``execute`` of each request (equal ``batch_key``: obs [B_i, obs_dim] of one dtype), in one
        forward over the concatenated obs. Every rank of a tp replica runs the same batch."""
        return unstack(self.execute(stack(requests)), leading_sizes(requests, "obs"))


class PolicyEntry(Entry):
    """Built-in demo plugin: tensor parallel over ``dense_tp``.

    It has no attention, but besides an unsplit attention domain it accepts one that
    mirrors the dense split (attention tp = dense tp, cp 1), so that layouts written for a
    transformer, such as the spec's ``dense tp 2 + attention tp 2``, run it
    unchanged. Any split that would make ranks of one replica compute the same
    thing twice (a dense or attention dp > 1) is refused.
    """

    name = "policy"
    parallel_domains = frozenset({"dense", "attention"})

    def __init__(self) -> None:
        self.args: PolicyArgs | None = None

    def configure(self, plugin_args: Any) -> None:
        """Validate ``plugin_args`` in the caller and remember them for the other checks."""
        self.args = PolicyArgs.parse(plugin_args)

    def validate_parallel(self, parallel: ParallelConfig) -> None:
        super().validate_parallel(parallel)
        tp = parallel.dense.tp_size
        attention = parallel.attention
        if parallel.dense.dp_size != 1 or attention.tp_size not in (1, tp) or attention.cp_size != 1:
            raise ValueError(
                "policy splits only dense_tp: it needs dense dp 1 and attention either unsplit or "
                f"mirroring it (tp 1 or {tp}, cp 1), got dense tp {tp} dp {parallel.dense.dp_size}, attention tp "
                f"{attention.tp_size} cp {attention.cp_size} dp {attention.dp_size}")
        if self.args is not None and self.args.hidden % tp:
            raise ValueError(f"policy: hidden {self.args.hidden} is not divisible by dense.tp_size {tp}")

    def validate_request(self, request: Any) -> None:
        """TypeError: ``request`` is not a dict or ``obs`` is not a tensor/ndarray.
        ValueError: keys other than exactly {"obs"}, dtype not float32, not 2-D, an
        empty batch, a width other than the configured ``obs_dim``, NaN or inf.
        """
        if not isinstance(request, dict):
            raise TypeError(f"policy request must be a dict {{'obs': tensor}}, got {type(request).__name__}")
        if set(request) != {"obs"}:
            raise ValueError(f"policy request must have exactly the key 'obs', got {sorted(map(str, request))}")
        obs = request["obs"]
        if not isinstance(obs, (torch.Tensor, np.ndarray)):
            raise TypeError(f"policy obs must be a torch.Tensor or numpy array, got {type(obs).__name__}")
        if (obs.dtype != torch.float32) if isinstance(obs, torch.Tensor) else (obs.dtype != np.float32):
            raise ValueError(f"policy obs must be float32, got {obs.dtype}")
        if obs.ndim != 2 or obs.shape[0] == 0:
            raise ValueError(f"policy obs must have shape [B >= 1, obs_dim], got {list(obs.shape)}")
        if self.args is not None and obs.shape[1] != self.args.obs_dim:
            raise ValueError(f"policy obs must have shape [B, {self.args.obs_dim}], got {list(obs.shape)}")
        if not bool(torch.isfinite(torch.as_tensor(obs)).all()):
            raise ValueError("policy obs contains NaN or inf")

    def build(self, ctx: BuildContext, plugin_args: Any) -> PolicyRunner:
        return PolicyRunner(ctx, PolicyArgs.parse(plugin_args))
