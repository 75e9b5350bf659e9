"""The single-GPU path of the spec, on whatever this machine has.

One rank, one replica: the engine runs the ``policy`` demo plugin inline, on a
background thread of this process, with no supervisor and no rendezvous.

    python examples/inline_engine.py
"""

from __future__ import annotations

import time

import torch

from runtime import Engine, EngineArgs


def main() -> None:
    model_args = {"obs_dim": 32, "act_dim": 7, "horizon": 8, "seed": 0}
    request = {"obs": torch.randn(4, 32)}

    engine = Engine(EngineArgs(plugin="policy", plugin_args=model_args))
    try:
        result = engine.step(request)
        print(f"mode={engine.mode} actions {tuple(result['actions'].shape)} "
              f"{result['actions'].dtype} range [{result['actions'].min():.3f}, {result['actions'].max():.3f}]")

        # Many requests in flight: submit() returns futures at once.
        started = time.monotonic()
        futures = [engine.submit({"obs": torch.randn(1, 32)}) for _ in range(100)]
        chunks = [f.result() for f in futures]
        elapsed = time.monotonic() - started
        print(f"{len(chunks)} requests in {elapsed * 1e3:.1f} ms "
              f"({elapsed / len(chunks) * 1e6:.0f} us each); replicas: {engine.replicas}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
