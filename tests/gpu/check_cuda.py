"""The CUDA path in one go, for a machine with at least one GPU (two for NCCL).

    python tests/gpu/check_cuda.py          # prints one line per check, exits 1 on a failure

Checks: the qwen3 plugin on CUDA (greedy tokens equal to ``transformers.generate``
on a tiny random checkpoint, inline and, with two GPUs, tp=2 over NCCL), device
pinning and NCCL (a tp=2 policy replica on devices 0 and 1 gives the
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
    check_qwen3(count)
    print("failures:", FAILURES or "none")
    return 1 if FAILURES else 0


def check_qwen3(count: int) -> None:
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    prompts = [[7], [3, 1, 4, 1, 5], [(11 * i) % 250 for i in range(17)]]
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=256, initializer_range=0.1)
        model = Qwen3ForCausalLM(config).eval()
        model.save_pretrained(model_dir)
        reference = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0)
            reference.append(out[0, len(prompt):].tolist())
        request = {"prompt_token_ids": prompts, "max_tokens": 16}
        cuda = EngineConfig(device=DeviceConfig(target="cuda"))
        with Engine(EngineArgs("qwen3", {"model": model_dir}, cuda)) as inline:
            tokens = inline.step(request)["token_ids"]
        check("qwen3 inline on cuda equals transformers", tokens == reference)
        if count >= 2:
            args = EngineArgs("qwen3", {"model": model_dir}, EngineConfig(
                device=DeviceConfig(target="cuda"),
                parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2),
                                        attention=AttentionParallelConfig(tp_size=2))))
            with Engine(args, DeploymentConfig.local(devices=(0, 1),
                                                     process_config=WorkerSupervisorConfig(base_port=29670))) as tp:
                tokens = tp.step(request)["token_ids"]
            check("qwen3 tp=2 over NCCL equals transformers", tokens == reference)


if __name__ == "__main__":
    sys.exit(main())
