"""Section "gpu": the CUDA paths, in one go on a machine with a CUDA device; skipped (with a line
saying so) where ``torch.cuda.is_available()`` is False.

    CUDA-IPC result   a local engine, 1 rank on cuda:0, returns a 1 GiB CUDA tensor it keeps
                      (``bench.plugins:BenchProbe`` "cuda_result"): the result crosses as a CUDA-IPC
                      handle, so the round trip should cost a small multiple of nothing next to
                      copying 1 GiB on the device (``Tensor.copy_``, synchronized)
    CUDA-IPC echo     the same engine echoes a 1 GiB CUDA tensor of this process: in by IPC, out as
                      one device copy (torch shares no memory a process received by IPC) sent by IPC
    qwen3 decode      ``bench.llm``'s random Qwen3 on cuda: tokens/s of the inline qwen3 engine at
                      concurrency 1 and 16 against ``transformers.generate`` on the same device
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import RunContext, Section, Table, fmt_ms, free_port, p50, p99, ratio

IPC_MIB = 1024
PLUGIN = "bench.plugins:BenchProbe"


def _timed_cuda(call: Any, n: int) -> list[int]:
    import torch

    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        result = call()
        torch.cuda.synchronize()
        samples.append(time.perf_counter_ns() - start)
        del result
    return samples


def _ipc(ctx: RunContext, section: Section) -> None:
    import torch

    from runtime.core.config import DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig, WorkerSupervisorConfig
    from runtime.engine import Engine

    n = 10 if ctx.quick else 50
    numel = IPC_MIB * (1 << 20) // 4
    src = torch.ones(numel, device="cuda:0")
    dst = torch.empty_like(src)
    args = EngineArgs(PLUGIN, None, EngineConfig(device=DeviceConfig(target="cuda")))
    samples: dict[str, list[int]] = {}
    errors: list[str] = []
    with Engine(args, DeploymentConfig.local(devices=(0,), process_config=WorkerSupervisorConfig(
            base_port=free_port()))) as engine:
        request = {"op": "cuda_result", "mib": IPC_MIB}
        first = engine.step(request, timeout=120)["x"]
        ok = first.is_cuda and first.numel() == numel and bool((first == 1).all())
        del first
        if not ok:
            raise RuntimeError("the CUDA-IPC result is not the rank's 1 GiB tensor of ones")
        _timed_cuda(lambda: engine.step(request, timeout=120), 2)
        _timed_cuda(lambda: dst.copy_(src), 2)
        samples["memcpy"] = []
        samples["result"] = []
        for _ in range(n):  # interleaved call by call
            samples["memcpy"] += _timed_cuda(lambda: dst.copy_(src), 1)
            samples["result"] += _timed_cuda(lambda: engine.step(request, timeout=120), 1)
        try:
            echo = {"op": "echo", "x": src}
            back = engine.step(echo, timeout=120)
            if not (back.is_cuda and back.numel() == numel):
                raise RuntimeError(f"echo returned {type(back).__name__} {getattr(back, 'shape', '')}")
            del back
            samples["echo"] = _timed_cuda(lambda: engine.step(echo, timeout=120), n)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other rows stand
            errors.append(f"CUDA-IPC echo (a CUDA tensor of this process, in and out): failed: "
                          f"{type(exc).__name__}: {str(exc)[:200]}")
    memcpy = p50(samples["memcpy"])
    size = "1 GiB" if IPC_MIB == 1024 else f"{IPC_MIB} MiB"
    labels = {"memcpy": f"device memcpy (`Tensor.copy_`, {size}, synchronized; baseline)",
              "result": f"local rank returns its {size} CUDA tensor (CUDA-IPC result)",
              "echo": f"local rank echoes a {size} CUDA tensor of this process (CUDA-IPC in; out: one device copy "
                      "by CUDA-IPC)"}
    rows = [[labels[k], fmt_ms(p50(s)), fmt_ms(p99(s)), ratio(p50(s), memcpy), str(len(s))]
            for k, s in samples.items()]
    section.tables.append(Table(
        f"CUDA-IPC, {IPC_MIB} MiB on {torch.cuda.get_device_name(0)}", ["path", "p50 ms", "p99 ms",
                                                                       "p50 / device memcpy", "n"], rows,
        [f"Engine: `DeploymentConfig.local(devices=(0,))`, `DeviceConfig(target=\"cuda\")`, plugin `{PLUGIN}`. "
         "`time.perf_counter_ns` around `engine.step(...)` with `torch.cuda.synchronize()` before and after; "
         f"the result is a CUDA tensor opened from the rank's IPC handle (checked once: on cuda, {size} of ones). "
         f"Two untimed calls each, then {n} round trips interleaved call by call with the device memcpy."]
        + errors))
    section.data["ipc_p50_ns"] = {k: p50(s) for k, s in samples.items()}


def _decode(ctx: RunContext, section: Section) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from bench import llm
    from bench.generation import HF_BATCH, build_paths, engine_generate, hf_generate, measure, tables
    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig

    levels = (1, 16)
    new_tokens, rounds, singles = (32, 1, 2) if ctx.quick else (llm.NEW_TOKENS, 3, 4)
    batch = llm.prompts(max(levels))
    path = Path(ctx.workdir) / "qwen3-58m-gpu"
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, path, True)
        params = llm.make_checkpoint(path)
        hf_model = Qwen3ForCausalLM.from_pretrained(path).eval().to("cuda")
        plugin_args = {"model": str(path), "max_num_seqs": max(levels), "kv_cache_blocks": 256}
        engine = stack.enter_context(Engine(EngineArgs("qwen3", plugin_args,
                                                       EngineConfig(device=DeviceConfig(target="cuda")))))
        engines = {"qwen3 tp=1 (inline engine, cuda)": engine}
        engine_generate(engine, batch[:1], new_tokens)  # warm-up
        hf_generate(hf_model, batch[:1], new_tokens)
        paths = build_paths(hf_model, engines, batch, levels, singles, new_tokens)
        rates, mismatched = measure(paths, (HF_BATCH, max(levels)), rounds,
                                    lambda m: ctx.progress(f"gpu: qwen3 {m}"))
    method = [f"As the CPU table ({params / 1e6:.0f}M-parameter random Qwen3, fp32, {new_tokens} new greedy "
              f"tokens per request, {rounds} round(s)), on {torch.cuda.get_device_name(0)}: the inline qwen3 engine "
              "with `DeviceConfig(target=\"cuda\")`, transformers' model `.to(\"cuda\")`. Greedy tokens may "
              "differ from transformers' on a GPU where kernels differ (reported, not a failure)."]
    table, data = tables(rates, mismatched, levels, method, "qwen3 decode on CUDA: tokens per second")
    section.tables.append(table)
    section.data["decode"] = data


def run(ctx: RunContext) -> Section:
    import torch

    section = Section("gpu", "GPU rows: CUDA-IPC and qwen3 decode")
    if not torch.cuda.is_available():
        section.notes.append(f"Skipped: `torch.cuda.is_available()` is False on this machine (torch "
                             f"{torch.__version__}). On a CUDA machine, `python -m bench --only gpu` runs these rows "
                             "in one go: a 1 GiB CUDA-IPC result from a local rank against a device memcpy, and "
                             "qwen3 decode tokens/s against transformers.")
        return section
    for name, part in (("CUDA-IPC", _ipc), ("qwen3 decode", _decode)):
        ctx.progress(f"gpu: {name}")
        try:
            part(ctx, section)
        except Exception as exc:  # noqa: BLE001 - one part failing leaves the other's rows
            section.notes.append(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
    return section
