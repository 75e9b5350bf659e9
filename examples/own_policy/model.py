"""``TinyPolicy``: an ordinary ``nn.Module``, and its weights in a safetensors file.

The network maps an observation to an action chunk::

    obs [B, obs_dim] -> Linear -> gelu -> Linear -> gelu -> Linear -> tanh -> actions [B, horizon, action_dim]

Nothing here knows about phyrt. The file keeps the network's sizes next to its
tensors, in the safetensors header's string metadata (``obs_dim``, ``horizon``,
``action_dim``, ``hidden``), so a weights file is all a loader needs.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

#: the sizes a weights file must carry in its metadata
SIZE_KEYS = ("obs_dim", "horizon", "action_dim", "hidden")


@dataclass(frozen=True)
class TinyPolicyConfig:
    obs_dim: int = 10
    horizon: int = 4
    action_dim: int = 3
    hidden: int = 64

    def __post_init__(self) -> None:
        for key in SIZE_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise ValueError(f"TinyPolicyConfig.{key} must be an int in [1, 65536], got {value!r}")

    def to_metadata(self) -> dict[str, str]:
        """The safetensors header metadata (string to string) that records these sizes."""
        return {"format": "pt", **{key: str(value) for key, value in asdict(self).items()}}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, source: str) -> "TinyPolicyConfig":
        """The sizes recorded by ``to_metadata``; ValueError naming ``source`` if any is missing or bad."""
        metadata = metadata or {}
        missing = [key for key in SIZE_KEYS if key not in metadata]
        if missing:
            raise ValueError(f"{source}: the safetensors metadata lacks {missing}; "
                             "write the file with examples.own_policy.model.save_policy")
        try:
            return cls(**{key: int(metadata[key]) for key in SIZE_KEYS})
        except ValueError as exc:
            raise ValueError(f"{source}: bad sizes in the safetensors metadata: {exc}") from None


class TinyPolicy(nn.Module):
    """obs [B, obs_dim] -> actions [B, horizon, action_dim], each action in [-1, 1]."""

    def __init__(self, config: TinyPolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.inp = nn.Linear(config.obs_dim, config.hidden)
        self.mid = nn.Linear(config.hidden, config.hidden)
        self.out = nn.Linear(config.hidden, config.horizon * config.action_dim)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.inp(obs))
        x = F.gelu(self.mid(x))
        x = torch.tanh(self.out(x))
        return x.reshape(obs.shape[0], self.config.horizon, self.config.action_dim)


def save_policy(model: TinyPolicy, path: str | os.PathLike) -> None:
    """Write the module's weights and its sizes to ``path`` (a .safetensors file)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata=model.config.to_metadata())


def read_config(path: str | os.PathLike) -> TinyPolicyConfig:
    """The sizes in a weights file's header, after checking that its tensors fit them.

    Reads the header only, not the tensors. FileNotFoundError / PermissionError /
    IsADirectoryError for a path that cannot be read; ValueError for a file that is
    not safetensors, lacks the sizes, or whose tensors do not match ``TinyPolicy``.
    """
    source = str(path)
    _check_readable(Path(path))
    try:
        with safe_open(source, framework="pt") as f:
            config = TinyPolicyConfig.from_metadata(f.metadata(), source)
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except SafetensorError as exc:
        raise ValueError(f"{source} is not a readable safetensors file: {exc}") from None
    with torch.device("meta"):  # the expected shapes, without allocating anything
        expected = {key: tuple(t.shape) for key, t in TinyPolicy(config).state_dict().items()}
    if shapes != expected:
        missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
        problems = ([f"missing tensors {missing}"] if missing else []) + (
            [f"unexpected tensors {unexpected}"] if unexpected else [])
        problems += [f"{key} is {list(shapes[key])}, expected {list(expected[key])}"
                     for key in sorted(set(shapes) & set(expected)) if shapes[key] != expected[key]]
        raise ValueError(f"{source} does not hold TinyPolicy({config}) weights: {'; '.join(problems)}")
    return config


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu") -> TinyPolicy:
    """A ``TinyPolicy`` in eval mode with the weights of ``path`` (strict: every tensor must fit)."""
    config = read_config(path)
    model = TinyPolicy(config).to(device)
    model.load_state_dict(load_file(str(path), device=str(device)), strict=True)
    return model.eval()


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"weights file {str(path)!r} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"weights file {str(path)!r} is a directory, not a .safetensors file")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"weights file {str(path)!r} is not readable by this user")
