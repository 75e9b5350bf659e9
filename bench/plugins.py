"""Bench-only plugin: ``bench.plugins:BenchProbe`` (the tests have their own in tests/plugins.py).

Every rank of a replica runs each request; rank 0 answers. Requests are dicts with "op":

    echo         returns request["x"] (or None)
    work         request["n"] products of two fixed 256 x 256 float32 matrices, on this rank's
                 own torch threads (plugin_args {"threads": 1} pins them to one); returns a checksum
    sleep        writes this rank's pid to request["mark"] + f"-{rank}" (when given), then sleeps
                 request["s"] seconds: a request that is surely in flight, for failure timing
    cuda_result  a CUDA tensor of request["mib"] MiB that this rank keeps (allocated once,
                 filled with 1.0), returned as a CUDA-IPC result

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
