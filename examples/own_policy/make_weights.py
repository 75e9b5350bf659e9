"""Train a ``TinyPolicy`` for a few seconds on a toy target and write its weights file.

    python -m examples.own_policy.make_weights --out policy.safetensors    # from the repository root

The target is a fixed (seeded) smooth map from observation to action chunk, so the
written weights are trained, not random: with the defaults the printed loss falls from
about 0.4 to under 0.01. The sizes go into the file's metadata, where ``OwnPolicy`` reads them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run by path (python examples/own_policy/make_weights.py): import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from examples.own_policy.model import TinyPolicy, TinyPolicyConfig, save_policy  # noqa: E402


def train(config: TinyPolicyConfig, steps: int, seed: int) -> tuple[TinyPolicy, float, float]:
    """A ``TinyPolicy`` fitted to ``tanh(obs @ W)`` for a seeded ``W``; returns it, the first and last loss."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the module's own initialisation
    target = torch.randn(config.obs_dim, config.horizon * config.action_dim, generator=gen) / config.obs_dim**0.5
    model = TinyPolicy(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = last = float("nan")
    for step in range(steps):
        obs = torch.randn(256, config.obs_dim, generator=gen)
        wanted = torch.tanh(obs @ target).reshape(-1, config.horizon, config.action_dim)
        loss = torch.nn.functional.mse_loss(model(obs), wanted)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    return model.eval(), first, last


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("policy.safetensors"), help="the weights file to write")
    defaults = TinyPolicyConfig()
    for key in ("obs_dim", "horizon", "action_dim", "hidden"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(defaults, key))
    parser.add_argument("--steps", type=int, default=300, help="training steps (0: the random initialisation)")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    config = TinyPolicyConfig(obs_dim=opts.obs_dim, horizon=opts.horizon, action_dim=opts.action_dim,
                              hidden=opts.hidden)
    model, first, last = train(config, opts.steps, opts.seed)
    save_policy(model, opts.out)
    trained = f"{opts.steps} training steps, loss {first:.4f} -> {last:.4f}" if opts.steps > 0 else "untrained"
    print(f"wrote {opts.out}: {config}, {trained}")


if __name__ == "__main__":
    main()
