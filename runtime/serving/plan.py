"""What ``python -m runtime.launch`` is asked to start, checked before anything starts.

    command line --> build_engine_config(opts) --> check_plugin(args) --> Engine(args, deployment)
                     layout, device, dtype           plugin resolves,
                     (torch: CUDA devices seen)      accepts its arguments and layout

A request that cannot work raises ``BadArguments``; launch answers it with one line and
exit status 2 (a process manager must not restart it), in about the time torch takes to
import: nothing is spawned and no CUDA context is made, except to ask a GPU whether it runs
bfloat16. ``--dtype auto`` is float32 on the CPU and, on CUDA, the checkpoint's own dtype
for ``--model`` (``torch_dtype`` in its config.json) or bfloat16 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from runtime.serving.cli import DTYPES

__all__ = ["BadArguments", "build_engine_config", "check_plugin", "choose_dtype", "plugin_and_args"]

_CPU_HINT = "--device cpu runs the same layout on CPU ranks"


class BadArguments(ValueError):
    """The command line asks for something this machine or the plugin cannot do (exit status 2)."""


def plugin_and_args(opts: argparse.Namespace) -> tuple[str, Any]:
    if opts.model is None:
        return opts.plugin, opts.plugin_args
    if opts.plugin != "policy":
        raise BadArguments(f"--model is shorthand for --plugin qwen3; it cannot go with --plugin {opts.plugin}")
    if opts.plugin_args is not None and not isinstance(opts.plugin_args, dict):
        raise BadArguments("--plugin-args must be a JSON object when --model is given")
    return "qwen3", {**(opts.plugin_args or {}), "model": opts.model}


def build_engine_config(opts: argparse.Namespace) -> tuple[Any, Any]:
    """EngineArgs and DeploymentConfig from the command line; BadArguments for a combination that
    cannot run here (uneven --devices, more CUDA devices than torch sees, a dtype the device lacks)."""
    plugin, plugin_args = plugin_and_args(opts)
    slots = len(opts.devices) if opts.devices is not None else opts.replicas
    if slots % opts.replicas:  # before torch is imported
        raise BadArguments(f"--devices has {slots} entries, which {opts.replicas} replicas cannot share evenly")
    from runtime.core.config import (AttentionParallelConfig, BatchingConfig, DenseParallelConfig, DeploymentConfig,
                                     DeviceConfig, EngineArgs, EngineConfig, ParallelConfig, WorkerSupervisorConfig)

    tp = slots // opts.replicas
    parallel = ParallelConfig(dense=DenseParallelConfig(tp_size=tp), attention=AttentionParallelConfig(tp_size=tp))
    entries = opts.devices or tuple(range(slots))  # the devices the layout takes
    target = _target(opts.device, entries)
    dtype = choose_dtype(opts.dtype, target, plugin, plugin_args)
    _check_dtype_runs(dtype, target, entries)
    device = DeviceConfig(target=opts.device, params_dtype=dtype)
    batching = BatchingConfig(max_batch_size=opts.max_batch_size, max_delay_ms=opts.max_batch_delay_ms)
    args = EngineArgs(plugin, plugin_args, EngineConfig(device=device, parallel=parallel, batching=batching))
    deployment = DeploymentConfig(
        replica_count=opts.replicas, devices=opts.devices,
        replica_restarts=opts.replica_restarts, restart_backoff_s=opts.restart_backoff_s,
        process_config=WorkerSupervisorConfig(
            base_port=opts.base_port, execution_timeout_s=opts.execution_timeout_s,
            heartbeat_interval_s=opts.heartbeat_interval_s, heartbeat_timeout_s=opts.heartbeat_timeout_s,
            startup_timeout_s=opts.startup_timeout_s))
    return args, deployment


def check_plugin(args: Any) -> None:
    """BadArguments unless the plugin resolves and accepts its arguments and layout (what the
    engine checks first, asked before it starts: an unknown plugin is a bad argument, not a failed start)."""
    from runtime.core.plugins import resolve_plugin

    try:
        entry = resolve_plugin(args.plugin)()
        entry.configure(args.plugin_args)
        entry.validate_parallel(args.config.parallel)
    except (ValueError, TypeError, ImportError) as exc:  # a file it cannot read is a failed start (1)
        raise BadArguments(f"{type(exc).__name__}: {exc}") from exc


def choose_dtype(asked: str, target: str, plugin: str, plugin_args: Any) -> str:
    """The dtype ``asked`` for, or what "auto" means on ``target`` (see the module docstring)."""
    if asked != "auto":
        return asked
    if target == "cpu":
        return "float32"
    model = plugin_args.get("model") if plugin == "qwen3" and isinstance(plugin_args, dict) else None
    return checkpoint_dtype(model) or "bfloat16"


def checkpoint_dtype(model_dir: Any) -> str | None:
    """The dtype a Hugging Face checkpoint's config.json names, when it is one of ours."""
    if not isinstance(model_dir, str):
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None  # the plugin's own check names what is wrong with the checkpoint
    named = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return named if named in DTYPES[1:] else None


def _target(asked: str, entries: tuple[int, ...]) -> str:
    """"cuda" or "cpu" for --device ``asked``; BadArguments when CUDA is asked for (or found by
    "auto") but the --devices ``entries`` go beyond the devices torch sees."""
    import torch

    seen = torch.cuda.device_count()
    if asked == "cpu" or (asked == "auto" and seen == 0):
        return "cpu"
    if max(entries) >= seen:
        build = "" if torch.version.cuda else f"; torch {torch.__version__} is a CPU-only build"
        raise BadArguments(
            f"--device {asked}: the layout needs {len(entries)} CUDA device entr{'y' if len(entries) == 1 else 'ies'} "
            f"({','.join(map(str, entries))}) but torch sees {seen} CUDA device(s) (CUDA_VISIBLE_DEVICES "
            f"applies{build}); {_CPU_HINT}")
    return "cuda"


def _check_dtype_runs(dtype: str, target: str, entries: tuple[int, ...]) -> None:
    """BadArguments when the device cannot run ``dtype``: bfloat16 on a GPU older than Ampere, or a
    CPU build whose kernels refuse it."""
    if dtype == "float32":  # every device runs it: nothing to ask
        return
    import torch

    if target == "cuda":
        if dtype != "bfloat16":
            return
        for index in sorted(set(entries)):
            major, minor = torch.cuda.get_device_capability(index)
            if major < 8:
                raise BadArguments(
                    f"--dtype bfloat16: CUDA device {index} ({torch.cuda.get_device_name(index)}, compute capability "
                    f"{major}.{minor}) has no bfloat16 kernels (8.0 and newer do); use --dtype float16 or float32")
        return
    try:
        x = torch.ones(2, 2, dtype=getattr(torch, dtype))
        (x @ x).sum().item()
    except RuntimeError as exc:
        raise BadArguments(f"--dtype {dtype}: this CPU build of torch cannot run it ({exc})") from None
