"""Bench-only plugin: ``bench.plugins:BenchProbe`` (the tests have their own in tests/plugins.py).

Every rank of a replica runs each request; rank 0 answers. Requests are dicts with "op":

    echo         returns request["x"] (or None)
    work         request["n"] products of two fixed 256 x 256 float32 matrices, on this rank's
                 own torch threads (plugin_args {"threads": 1} pins them to one); returns a checksum
    sleep        writes this rank's pid to request["mark"] + f"-{rank}" (when given), then sleeps
                 request["s"] seconds: a request that is surely in flight, for failure timing
    cuda_result  a CUDA tensor of request["mib"] MiB that this rank keeps (allocated once,
                 filled with 1.0), returned as a CUDA-IPC result

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
