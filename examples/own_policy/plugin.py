"""``OwnPolicy``: the phyrt plugin that serves a ``TinyPolicy`` from its safetensors file.

    python -m runtime.launch --plugin examples.own_policy.plugin:OwnPolicy \\
        --plugin-args '{"weights": "policy.safetensors"}'

Run it from the repository root: ``examples.own_policy.plugin`` is then importable (the
root is on ``sys.path`` of ``python -m`` and of every rank it spawns). From elsewhere,
put the root on ``PYTHONPATH`` or ship your own plugin as an installed package.

``plugin_args``: ``{"weights": PATH}``; the network's sizes come from the file's metadata.
Request ``{"obs": float [B, obs_dim]}`` (a tensor or numpy array, any float dtype) ->
result ``{"actions": float32 [B, horizon, action_dim]}``; ``execute_batch`` runs several such
requests in one forward when the engine batches (``BatchingConfig``). Single rank per replica:
``--replicas N`` runs N copies, each loading the file on its own device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from examples.own_policy.model import TinyPolicyConfig, load_policy, read_config
from runtime import BuildContext, Entry
from runtime.batching import leading_sizes, stack, unstack

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NP_FLOATS = (np.float16, np.float32, np.float64)


def weights_path(plugin_args: Any) -> str:
    """The ``weights`` path of ``plugin_args``; TypeError/ValueError when they are not ``{"weights": str}``."""
    if not isinstance(plugin_args, dict):
        raise TypeError(f'OwnPolicy plugin_args must be a dict {{"weights": PATH}}, got {type(plugin_args).__name__}')
    unknown = sorted(str(key) for key in plugin_args if key != "weights")
    if unknown:
        raise ValueError(f"OwnPolicy plugin_args has unknown keys {unknown}; the only key is 'weights' "
                         "(the sizes come from the file's metadata)")
    path = plugin_args.get("weights")
    if not isinstance(path, str) or not path:
        raise ValueError(f'OwnPolicy plugin_args needs "weights": the path of a .safetensors file, got {path!r}')
    return path


class OwnPolicyRunner:
    """One rank's model: ``execute({"obs": [B, obs_dim]}) -> {"actions": [B, horizon, action_dim]}``."""

    def __init__(self, ctx: BuildContext, path: str) -> None:
        self.device = torch.device(ctx.device)
        dtype = ctx.params_dtype
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
        self.model = load_policy(path, self.device).to(self.dtype)

    def execute(self, request: dict[str, Any]) -> dict[str, torch.Tensor]:
        obs = torch.as_tensor(request["obs"]).to(self.device, self.dtype)
        with torch.inference_mode():
            actions = self.model(obs).float()
        # A clone made outside inference mode is an ordinary tensor the caller may edit in place.
        return {"actions": actions.clone()}

    def execute_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """Dynamic batching (``BatchingConfig``): the requests (equal ``batch_key``: obs [B_i, obs_dim]
        of one dtype) go through the model in one forward; one result per request, in order."""
        return unstack(self.execute(stack(requests)), leading_sizes(requests, "obs"))


class OwnPolicy(Entry):
    """Serves the ``TinyPolicy`` whose weights file ``plugin_args["weights"]`` names."""

    name = "own_policy"
    parallel_domains = frozenset()  # one rank per replica

    def __init__(self) -> None:
        self.config: TinyPolicyConfig | None = None

    def configure(self, plugin_args: Any) -> None:
        """Runs in the caller before any rank starts: the file must exist, be readable and hold
        ``TinyPolicy`` weights (header only; the tensors are read on each rank)."""
        self.config = read_config(weights_path(plugin_args))

    def validate_request(self, request: Any) -> None:
        """Runs in the caller. TypeError: not ``{"obs": tensor or ndarray}``. ValueError: other
        keys, a dtype that is not floating point, a shape other than [B >= 1, obs_dim], NaN or inf."""
        if not isinstance(request, dict):
            raise TypeError(f"OwnPolicy request must be a dict {{'obs': tensor}}, got {type(request).__name__}")
        if set(request) != {"obs"}:
            raise ValueError(f"OwnPolicy request must have exactly the key 'obs', got {sorted(map(str, request))}")
        obs = request["obs"]
        if not isinstance(obs, (torch.Tensor, np.ndarray)):
            raise TypeError(f"OwnPolicy obs must be a torch.Tensor or numpy array, got {type(obs).__name__}")
        if obs.dtype not in (_FLOATS if isinstance(obs, torch.Tensor) else _NP_FLOATS):
            raise ValueError(f"OwnPolicy obs must be float16, bfloat16, float32 or float64, got {obs.dtype}")
        obs_dim = self.config.obs_dim if self.config is not None else None
        if obs.ndim != 2 or obs.shape[0] == 0 or (obs_dim is not None and obs.shape[1] != obs_dim):
            raise ValueError(f"OwnPolicy obs must have shape [B >= 1, {obs_dim or 'obs_dim'}], got {list(obs.shape)}")
        finite = torch.isfinite(obs).all() if isinstance(obs, torch.Tensor) else np.isfinite(obs).all()
        if not bool(finite):
            raise ValueError("OwnPolicy obs contains NaN or inf")

    def build(self, ctx: BuildContext, plugin_args: Any) -> OwnPolicyRunner:
        return OwnPolicyRunner(ctx, weights_path(plugin_args))
