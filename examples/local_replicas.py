"""The spec's local multi-GPU deployment: 4 devices, 2 replicas, tensor parallel 2.

By default (``--device cpu``) the layout runs as 4 CPU ranks with gloo, on any machine;
``--device cuda`` (or ``auto`` where CUDA is visible) needs 4 CUDA devices and runs NCCL.
The actions match the inline engine's, on the same device, because every rank of a
replica loads its slice of the same seeded weights.

    python examples/local_replicas.py [--device cpu|cuda|auto]
"""

from __future__ import annotations

import argparse
import time

import torch

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                     Engine, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--base-port", type=int, default=None,
                        help="pin replica i to 127.0.0.1:base_port + i (default: a free rendezvous)")
    opts = parser.parse_args(argv)

    model_args = {"obs_dim": 32, "seed": 0}
    device = DeviceConfig(target=opts.device)  # the local ranks and the inline reference alike
    obs = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    started = time.monotonic()
    engine = Engine(
        EngineArgs(
            plugin="policy",
            plugin_args=model_args,
            config=EngineConfig(
                device=device,
                parallel=ParallelConfig(
                    dense=DenseParallelConfig(tp_size=2),
                    attention=AttentionParallelConfig(tp_size=2),
                ),
            ),
        ),
        deployment=DeploymentConfig.local(
            devices=(0, 1, 2, 3),
            replica_count=2,
            process_config=WorkerSupervisorConfig(base_port=opts.base_port),
        ),
    )
    try:
        print(f"ready in {time.monotonic() - started:.1f} s: mode={engine.mode}, "
              f"{len(engine.replicas)} replicas x {engine.ranks_per_replica} ranks on {device.resolve_target()}")
        futures = [engine.submit({"obs": obs}) for _ in range(4)]  # spread over both replicas
        actions = [f.result()["actions"].cpu() for f in futures]
    finally:
        engine.close()

    with Engine(EngineArgs(plugin="policy", plugin_args=model_args, config=EngineConfig(device=device))) as inline:
        reference = inline.step({"obs": obs})["actions"].cpu()  # compared on the CPU, as the actions above
    worst = max(float((a - reference).abs().max()) for a in actions)
    print(f"max |local - inline| = {worst:.2e} over {len(actions)} requests")
    if worst > 1e-5:
        raise SystemExit("local actions differ from inline")


if __name__ == "__main__":
    main()
