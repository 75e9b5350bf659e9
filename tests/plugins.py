"""Plugins used by the tests. Importable as ``tests.plugins:Name`` in any
interpreter started from the repository root (spawned ranks included)."""

from __future__ import annotations

import threading
import time
from typing import Any

from runtime import Entry

#: set by tests to hold the inline runner inside execute(); only meaningful inline
gate = threading.Event()
gate.set()
#: what ran, in order (inline only: the runner lives in the test's process)
log: list[Any] = []


class EchoRunner:
    def execute(self, request: Any) -> Any:
        log.append(request)
        if isinstance(request, dict):
            if request.get("wait_gate"):
                gate.wait(30)
            if "sleep" in request:
                time.sleep(request["sleep"])
            if "raise" in request:
                raise {"KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError,
                       "SystemExit": SystemExit}[request["raise"]](request.get("message", "boom"))
        return request


class Echo(Entry):
    """Returns the request; dict keys "sleep", "wait_gate" and "raise" steer it."""

    name = "echo"

    def validate_request(self, request: Any) -> None:
        if isinstance(request, dict) and request.get("invalid"):
            raise ValueError("request marked invalid")

    def build(self, ctx, plugin_args):
        if isinstance(plugin_args, dict) and plugin_args.get("fail_build"):
            raise RuntimeError("build failed on purpose")
        return EchoRunner()


class BatchingRunner:
    """A stepped runner: every request needs ``request`` steps; records batch sizes."""

    def __init__(self) -> None:
        self.remaining: dict[Any, int] = {}
        self.batches: list[int] = []

    def add(self, request_id: Any, request: int) -> None:
        if not isinstance(request, int) or request < 1:
            raise ValueError(f"steps must be a positive int, got {request!r}")
        self.remaining[request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.remaining)

    def step(self) -> list[tuple[Any, Any]]:
        gate.wait(30)
        self.batches.append(len(self.remaining))
        done = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            if self.remaining[request_id] == 0:
                del self.remaining[request_id]
                done.append((request_id, {"batches_seen": list(self.batches)}))
        return done


class Batching(Entry):
    name = "batching"

    def build(self, ctx, plugin_args):
        return BatchingRunner()


# --------------------------------------------------------------------------- local (multi-rank) probes


class TPProbeRunner:
    """One rank of ``TPProbe``: every rank of the replica runs each request, in order.

    ``request["op"]`` chooses what it does; "ranks" (a list of world ranks, default
    all) picks the ranks that misbehave in the failure ops, while the other ranks
    block in a world barrier that the misbehaving rank never joins, as real ranks
    would when one of them leaves a collective.
    """

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def execute(self, request: dict) -> Any:
        import os

        import torch

        from runtime import parallel as P

        op = request["op"]
        me = P.rank("world")
        chosen = me in (request.get("ranks") or range(P.size("world")))
        if op == "echo":
            return request["x"]
        if op == "unencodable":  # a result the wire cannot carry (a set)
            return {"fine": 1, "bad": {1, 2}}
        if op == "pid":
            return {"replica": self.ctx.replica_index, "pids": self._gather([os.getpid()])}
        if op == "groups":
            return self._groups()
        if op == "all_reduce":
            x = P.all_reduce(torch.tensor([float(me + 1)]), group=request["group"], op=request.get("reduce", "sum"))
            return P.all_gather(x, "world").tolist()
        if op == "sleep":
            time.sleep(request["s"])
            return {"replica": self.ctx.replica_index, "pid": os.getpid()}
        if op == "raise":
            if chosen:
                raise ZeroDivisionError(request.get("message", "boom"))
            P.barrier("world")
            return None
        if op == "exit":
            if chosen:
                os._exit(request["code"])
            P.barrier("world")
            return None
        if op == "send_raw":
            if chosen:  # frames on this rank's own control connection, then stay busy
                _control_socket(self.ctx).send_multipart(list(request["frames"]))
            time.sleep(request.get("then_sleep", 30.0))
            return None
        raise ValueError(f"unknown op {op!r}")

    def _gather(self, values: list[int]) -> list[list[int]]:
        import torch

        from runtime import parallel as P

        row = torch.tensor([values], dtype=torch.int64)
        return P.all_gather(row, "world").tolist()

    def _groups(self) -> dict:
        """What every world rank sees: its context, and each named group and its rank there."""
        import os

        from runtime import parallel as P

        world = P.size("world")
        row = [P.rank("world"), self.ctx.rank, self.ctx.world_size, self.ctx.replica_index, os.getpid()]
        for name in P.GROUP_NAMES:
            ranks = list(P.group_ranks(name))
            row += [P.rank(name)] + ranks + [-1] * (world - len(ranks))
        rows = self._gather(row)
        out: dict = {"world_rank": [], "ctx_rank": [], "ctx_world_size": [], "replica": [], "pid": [],
                     "groups": {name: [] for name in P.GROUP_NAMES},
                     "group_rank": {name: [] for name in P.GROUP_NAMES}}
        for r in rows:
            for key, value in zip(("world_rank", "ctx_rank", "ctx_world_size", "replica", "pid"), r[:5]):
                out[key].append(value)
            rest = r[5:]
            for name in P.GROUP_NAMES:
                chunk, rest = rest[:world + 1], rest[world + 1:]
                out["group_rank"][name].append(chunk[0])
                out["groups"][name].append([x for x in chunk[1:] if x >= 0])
        return out


def _control_socket(ctx) -> Any:
    """This rank's own control DEALER (identity c-REPLICA-RANK), found among live objects."""
    import gc

    import zmq

    identity = f"c-{ctx.replica_index}-{ctx.rank}".encode()
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Socket) and not obj.closed and obj.getsockopt(zmq.IDENTITY) == identity:
            return obj
    raise RuntimeError(f"no control socket with identity {identity!r} in this process")


class TPProbe(Entry):
    """Every parallel domain; ops: echo, unencodable, pid, groups, all_reduce, sleep, raise, exit, send_raw."""

    name = "tp-probe"
    parallel_domains = frozenset({"dense", "attention", "moe", "cfg", "pipeline"})
    OPS = frozenset({"echo", "unencodable", "pid", "groups", "all_reduce", "sleep", "raise", "exit", "send_raw"})

    def validate_request(self, request: Any) -> None:
        if not isinstance(request, dict) or request.get("op") not in self.OPS:
            raise ValueError(f"TPProbe request must be a dict with 'op' in {sorted(self.OPS)}, got {request!r}")

    def build(self, ctx, plugin_args):
        args = plugin_args if isinstance(plugin_args, dict) else {}
        if args.get("fail_build_rank") in (ctx.rank, "all"):
            raise KeyError(f"build failed on purpose on rank {ctx.rank}")
        if args.get("hold_gil_s"):
            _hold_gil(args["hold_gil_s"])
        return TPProbeRunner(ctx)


def _hold_gil(seconds: float) -> None:
    """Keep the GIL for about ``seconds`` in one C call, as a big extension import or
    a GIL-holding kernel does: no other thread of this process runs meanwhile."""
    n = 1 << 20
    started = time.perf_counter()
    sum(range(n))
    per_item = max(time.perf_counter() - started, 1e-6) / n
    sum(range(int(seconds / per_item)))
