"""The CUDA path in one go, for a machine with at least one GPU (two for NCCL).

    python tests/gpu/check_cuda.py          # prints one line per check, exits 1 on a failure

Checks: device pinning and NCCL (a tp=2 policy replica on devices 0 and 1 gives the
inline actions), CUDA-IPC requests and results (a CUDA result of the local engine
is a CUDA tensor on the rank's device, readable here, zero-copy). Skips the two-GPU checks when one GPU is visible.
"""

from __future__ import annotations

import sys
import time

import torch

from runtime import (AttentionParallelConfig, DenseParallelConfig, DeploymentConfig, DeviceConfig,
                     Engine, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    count = torch.cuda.device_count()
    print(f"{count} CUDA device(s): {[torch.cuda.get_device_name(i) for i in range(count)]}")
    obs = torch.randn(8, 32, device="cuda:0")
    cuda_cfg = EngineConfig(device=DeviceConfig(target="cuda"))
    with Engine(EngineArgs("policy", {"obs_dim": 32}, cuda_cfg)) as inline:
        reference = inline.step({"obs": obs})["actions"].cpu()
    check("inline on cuda", reference.shape == (8, 8, 7))

    started = time.monotonic()
    with Engine(EngineArgs("policy", {"obs_dim": 32}, cuda_cfg),
                DeploymentConfig.local(devices=(0,), process_config=WorkerSupervisorConfig(base_port=29650))) as one:
        check("local 1 rank start", True, f"{time.monotonic() - started:.1f} s")
        out = one.step({"obs": obs})["actions"]
        check("CUDA-IPC result is a cuda tensor", out.is_cuda, str(out.device))
        check("local 1 rank equals inline", torch.allclose(out.cpu(), reference, atol=1e-5))

    if count >= 2:
        args = EngineArgs("policy", {"obs_dim": 32}, EngineConfig(
            device=DeviceConfig(target="cuda"),
            parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2), attention=AttentionParallelConfig(tp_size=2))))
        with Engine(args, DeploymentConfig.local(devices=(0, 1),
                                                 process_config=WorkerSupervisorConfig(base_port=29660))) as tp:
            out = tp.step({"obs": obs})["actions"]
            check("NCCL tp=2 equals inline", torch.allclose(out.cpu(), reference, atol=1e-4),
                  f"max diff {(out.cpu() - reference).abs().max():.2e}")
    else:
        print("skip tp=2 over NCCL: one GPU visible")
    print("failures:", FAILURES or "none")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
