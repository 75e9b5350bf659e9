"""Plugins of the batching tests (``tests.batch_plugins:Name``; spawned ranks import them too)."""

from __future__ import annotations

import threading
import time
from typing import Any

from runtime import Entry

#: batches run inline, in order: each a list of the requests' "x" (the test's process only)
batches: list[list[Any]] = []
#: set by tests to hold the inline runner inside the current batch
gate = threading.Event()
gate.set()


class BatchEchoRunner:
    """``execute_batch``: each request {"x": a tensor [1] (an int id; 13 raises), "sleep"?: s, "raise"?: text,
    "short"?: True, "wait_gate"?: True} gets {"x", "batch": the batch's xs, "rank", "agree"}; with 2+
    ranks every rank checks that all ranks run the same batch (an all_gather of the batch's xs).
    Requests batch together when their other fields agree (``runtime.batching.batch_key``)."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.count = 0  # batches run

    def execute_batch(self, requests: list) -> list:
        xs = [int(r["x"][0]) for r in requests]
        batches.append(xs)
        if any(r.get("wait_gate") for r in requests):
            gate.wait(30)
        time.sleep(max([r.get("sleep", 0.0) for r in requests]))
        agree = True
        if self.ctx.world_size > 1:
            import torch.distributed as dist

            seen: list[Any] = [None] * self.ctx.world_size
            dist.all_gather_object(seen, xs)
            agree = all(s == xs for s in seen)
        for r in requests:
            if "raise" in r:
                raise ValueError(r["raise"])
        if 13 in xs:  # a value, not a field: it spoils the batch it lands in
            raise ValueError("13 is unlucky")
        self.count += 1
        results = [{"x": x, "batch": xs, "n": self.count, "rank": self.ctx.rank, "agree": agree} for x in xs]
        return results[:-1] if any(r.get("short") for r in requests) else results


class BatchEcho(Entry):
    name = "batch-echo"
    parallel_domains = frozenset({"dense"})

    def build(self, ctx, plugin_args):
        return BatchEchoRunner(ctx)


class SlowEchoRunner:
    """``execute`` only: sleeps ``sleep`` seconds, returns {"x", "n": requests run so far}."""

    count = 0

    def execute(self, request: dict) -> Any:
        batches.append([int(request["x"][0])])
        if request.get("wait_gate"):
            gate.wait(30)
        time.sleep(request.get("sleep", 0.0))
        self.count += 1
        return {"x": int(request["x"][0]), "n": self.count}


class BatchOnlyRunner:
    """``execute_batch`` only, no ``execute``: {"x", "size": the batch's size}."""

    def execute_batch(self, requests: list) -> list:
        return [{"x": int(r["x"][0]), "size": len(requests)} for r in requests]


class BatchOnly(Entry):
    name = "batch-only"

    def build(self, ctx, plugin_args):
        return BatchOnlyRunner()


class SlowEcho(Entry):
    name = "slow-echo"
    parallel_domains = frozenset({"dense"})

    def build(self, ctx, plugin_args):
        return SlowEchoRunner()
