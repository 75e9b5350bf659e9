"""Bench-only plugin: ``bench.plugins:BenchProbe`` (the tests have their own in tests/plugins.py).

Every rank of a replica runs each request; rank 0 answers. Requests are dicts with "op":

    echo         returns request["x"] (or None)
    work         request["n"] products of two fixed 256 x 256 float32 matrices, on this rank's
                 own torch threads (plugin_args {"threads": 1} pins them to one); returns a checksum
    sleep        writes this rank's pid to request["mark"] + f"-{rank}" (when given), then sleeps
                 request["s"] seconds: a request that is surely in flight, for failure timing
    cuda_result  a CUDA tensor of request["mib"] MiB that this rank keeps (allocated once,
                 filled with 1.0), returned as a CUDA-IPC result

``bench.plugins:FixedCost`` models an accelerator kernel for the batching section: a forward
costs ``fixed_ms + per_sample_ms * samples`` of wall time (a sleep), and little CPU.

``bench.plugins:ImageMeanPolicy`` is a stand-in for a vision policy, cheap on purpose (the openpi
section measures the door, not a model): ``{"image": uint8 [B, H, W, 3]}`` -> ``{"actions":
float32 [B, 8, 7]}``, a fixed linear map of the per-channel mean of every 4th row and column.

The top level imports only the runtime's plugin base, so that ranks start as fast
as ranks of any plugin.
"""

from __future__ import annotations

import os
import time
from typing import Any

from runtime.core.plugins import Entry

OPS = frozenset({"echo", "work", "sleep", "cuda_result"})
#: one "work" unit: a 256 x 256 by 256 x 256 float32 matmul (33.5 MFLOP)
WORK_DIM = 256


class BenchProbeRunner:
    def __init__(self, ctx: Any, plugin_args: dict) -> None:
        import torch

        self.ctx = ctx
        threads = plugin_args.get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        gen = torch.Generator().manual_seed(0)
        self._a = torch.randn(WORK_DIM, WORK_DIM, generator=gen)
        self._b = torch.randn(WORK_DIM, WORK_DIM, generator=gen) / WORK_DIM ** 0.5
        self._kept: dict[int, Any] = {}

    def execute(self, request: dict) -> Any:
        import torch

        op = request["op"]
        if op == "echo":
            return request.get("x")
        if op == "work":
            x = self._a
            for _ in range(int(request["n"])):
                x = torch.tanh(x @ self._b)
            return {"checksum": float(x.sum()), "rank": getattr(self.ctx, "rank", 0), "pid": os.getpid()}
        if op == "sleep":
            if request.get("mark"):
                path = f"{request['mark']}-{self.ctx.rank}"
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(path + ".tmp", path)  # the reader sees the whole pid or nothing
            time.sleep(float(request["s"]))
            return {"slept": request["s"]}
        if op == "cuda_result":
            mib = int(request["mib"])
            if mib not in self._kept:
                self._kept[mib] = torch.ones(mib * (1 << 20) // 4, device=self.ctx.device)
                if self._kept[mib].is_cuda:
                    torch.cuda.synchronize(self.ctx.device)
            return {"x": self._kept[mib]}
        raise ValueError(f"unknown op {op!r}")


class BenchProbe(Entry):
    """See the module docstring. Declares "dense" so that a tp=2 replica may run it."""

    name = "bench-probe"
    parallel_domains = frozenset({"dense"})

    def configure(self, plugin_args: Any) -> None:
        if plugin_args is not None and not isinstance(plugin_args, dict):
            raise TypeError(f"BenchProbe takes a dict of plugin_args or None, got {plugin_args!r}")

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or request.get("op") not in OPS:
            raise ValueError(f"BenchProbe requests are dicts with 'op' in {sorted(OPS)}, got {request!r}")

    def build(self, ctx: Any, plugin_args: Any) -> BenchProbeRunner:
        return BenchProbeRunner(ctx, plugin_args or {})


#: ImageMeanPolicy's action chunk: 8 steps of 7 joints (the policy demo's default shape)
IMAGE_HORIZON, IMAGE_ACT_DIM = 8, 7


class ImageMeanRunner:
    def __init__(self) -> None:
        import torch

        gen = torch.Generator().manual_seed(0)
        self._weight = torch.randn(3, IMAGE_HORIZON * IMAGE_ACT_DIM, generator=gen)

    def execute(self, request: dict) -> dict:
        import torch

        image = torch.as_tensor(request["image"])
        with torch.inference_mode():
            means = image[:, ::4, ::4].float().mean(dim=(1, 2)) / 255.0  # [B, 3]
            actions = torch.tanh(means @ self._weight).reshape(-1, IMAGE_HORIZON, IMAGE_ACT_DIM)
        return {"actions": actions.clone()}  # an ordinary tensor, not an inference-mode one


class ImageMeanPolicy(Entry):
    """See the module docstring. Single rank only."""

    name = "bench-image-mean"

    def configure(self, plugin_args: Any) -> None:
        if plugin_args is not None:
            raise TypeError(f"ImageMeanPolicy takes no plugin_args, got {plugin_args!r}")

    def validate_request(self, request: Any) -> None:
        import numpy as np
        import torch

        image = request.get("image") if isinstance(request, dict) else None
        if set(request if isinstance(request, dict) else ()) != {"image"} or not isinstance(
                image, (torch.Tensor, np.ndarray)):
            raise ValueError("ImageMeanPolicy requests are {'image': uint8 tensor or array [B, H, W, 3]}, got "
                             f"{type(request).__name__} {list(request) if isinstance(request, dict) else ''}")
        image = torch.as_tensor(image)
        if image.dtype != torch.uint8 or image.dim() != 4 or image.shape[0] == 0 or image.shape[3] != 3:
            raise ValueError(f"ImageMeanPolicy image must be uint8 [B >= 1, H, W, 3], got {image.dtype} "
                             f"{list(image.shape)}")

    def build(self, ctx: Any, plugin_args: Any) -> ImageMeanRunner:
        return ImageMeanRunner()


class DoubleRunner:
    def execute(self, request: dict) -> dict:
        import torch

        with torch.inference_mode():
            y = torch.mul(request["x"], 2)  # a new tensor, as a plugin that computes makes
        return {"y": y}


class Double(Entry):
    """``{"x": tensor}`` -> ``{"y": 2 * x}``: a plugin that computes a new tensor as large as its
    input (``bench.compute``), where an echo would hand back the request's own memory."""

    name = "bench-double"

    def build(self, ctx: Any, plugin_args: Any) -> DoubleRunner:
        return DoubleRunner()


class FixedCostRunner:
    def __init__(self, fixed_ms: float, per_sample_ms: float) -> None:
        self.fixed_s, self.per_sample_s = fixed_ms / 1e3, per_sample_ms / 1e3

    def _forward(self, samples: int) -> None:
        time.sleep(self.fixed_s + self.per_sample_s * samples)

    def execute(self, request: dict) -> dict:
        self._forward(int(request["obs"].shape[0]))
        return {"y": request["obs"] * 2}

    def execute_batch(self, requests: list[dict]) -> list[dict]:
        """One forward (one sleep) for the whole batch, then each request's result."""
        self._forward(sum(int(r["obs"].shape[0]) for r in requests))
        return [{"y": r["obs"] * 2} for r in requests]


class FixedCost(Entry):
    """A model of an accelerator kernel: ``{"obs": float32 [B, 32]}`` -> ``{"y": 2 * obs}``, and
    each forward costs ``time.sleep(fixed_ms + per_sample_ms * samples)``: wall time while the
    device works, little CPU (the host only waits), so that batching B requests costs about one
    fixed part instead of B of them. ``samples``: the leading sizes of the forward's requests,
    summed; ``execute_batch`` sleeps once for the batch. ``plugin_args``: None or a dict with
    ``fixed_ms`` (10) and ``per_sample_ms`` (0.2). Single rank only."""

    name = "bench-fixed-cost"
    DEFAULTS = {"fixed_ms": 10.0, "per_sample_ms": 0.2}

    def configure(self, plugin_args: Any) -> None:
        self._args(plugin_args)

    def _args(self, plugin_args: Any) -> dict[str, float]:
        if plugin_args is None:
            return dict(self.DEFAULTS)
        unknown = sorted(set(plugin_args) - set(self.DEFAULTS)) if isinstance(plugin_args, dict) else None
        if unknown is None or unknown:
            raise TypeError(f"FixedCost takes None or a dict with {sorted(self.DEFAULTS)}, got {plugin_args!r}")
        args = {**self.DEFAULTS, **plugin_args}
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in args.values()):
            raise ValueError(f"FixedCost plugin_args must be numbers >= 0, got {plugin_args!r}")
        return {k: float(v) for k, v in args.items()}

    def validate_request(self, request: Any) -> None:
        obs = request.get("obs") if isinstance(request, dict) else None
        if getattr(obs, "ndim", 0) != 2:
            raise ValueError(f"FixedCost requests are {{'obs': float32 [B, 32]}}, got {type(request).__name__}")

    def build(self, ctx: Any, plugin_args: Any) -> FixedCostRunner:
        args = self._args(plugin_args)
        return FixedCostRunner(args["fixed_ms"], args["per_sample_ms"])
