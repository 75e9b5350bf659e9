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


def touch(path: str, text: str = "") -> None:
    """Create ``path`` (a mark a test waits for: "this request is inside the plugin now")."""
    with open(path, "w") as f:
        f.write(text)


class EchoRunner:
    def execute(self, request: Any) -> Any:
        log.append(request)
        if isinstance(request, dict):
            if request.get("mark"):
                touch(request["mark"])
            if request.get("wait_gate"):
                gate.wait(30)
            if "sleep" in request:
                time.sleep(request["sleep"])
            if "raise" in request:
                raise {"KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError,
                       "SystemExit": SystemExit}[request["raise"]](request.get("message", "boom"))
            if request.get("thread"):
                return {**request, "thread": threading.current_thread().name}
        return request


class Echo(Entry):
    """Returns the request; dict keys "sleep", "wait_gate" and "raise" steer it ("mark": a file
    created as the request starts; "thread": the result names the thread that ran it)."""

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


class CountingRunner:
    """Counts the requests it ran and says so in ``info()`` (with one non-number, which metrics skip);
    ``{"break_info": True}`` makes every later ``info()`` raise."""

    def __init__(self, rank: int) -> None:
        self.requests, self.rank, self.broken = 0, rank, False

    def execute(self, request: Any) -> Any:
        self.requests += 1
        self.broken = self.broken or (isinstance(request, dict) and request.get("break_info") is True)
        return request

    def info(self) -> dict[str, Any]:
        if self.broken:
            raise RuntimeError("info() broke on purpose")
        return {"requests": self.requests, "rank": self.rank, "kind": "counting"}


class Counting(Entry):
    name = "counting"

    def build(self, ctx, plugin_args):
        return CountingRunner(ctx.rank)


# --------------------------------------------------------------------------- local (multi-rank) probes


class TPProbeRunner:
    """One rank of ``TPProbe``: every rank of the replica runs each request, in order.

    ``request["op"]`` chooses what it does; "ranks" (a list of world ranks, default
    all) picks the ranks that misbehave in the failure ops, while the other ranks
    block in a world barrier that the misbehaving rank never joins, as real ranks
    would when one of them leaves a collective. "mark" (any op): each rank creates the
    file ``MARK.REPLICA.RANK`` as it starts the request (``mark_files`` lists them).
    """

    def __init__(self, ctx) -> None:
        self.ctx = ctx

    def execute(self, request: dict) -> Any:
        import os

        import torch

        from runtime import parallel as P

        op = request["op"]
        _mark(request, self.ctx)
        me = P.rank("world")
        chosen = me in (request.get("ranks") or range(P.size("world")))
        if op == "echo":
            return request["x"]
        if op == "unencodable":  # a result the wire cannot carry (a set)
            return {"fine": 1, "bad": {1, 2}}
        if op == "pid":
            return {"replica": self.ctx.replica_index, "pids": self._gather([os.getpid()])}
        if op == "threads":  # each rank's torch intra-op threads
            return {"replica": self.ctx.replica_index, "threads": self._gather([torch.get_num_threads()])}
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


def _mark(request: dict, ctx) -> None:
    if request.get("mark"):
        touch(f"{request['mark']}.{ctx.replica_index}.{ctx.rank}")


def mark_files(mark: str) -> list[str]:
    """The ``MARK.REPLICA.RANK`` files created so far for ``mark``, sorted."""
    import glob

    return sorted(glob.glob(glob.escape(mark) + ".*.*"))


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
    """Every parallel domain; ops: echo, unencodable, pid, threads, groups, all_reduce, sleep, raise, exit, send_raw."""

    name = "tp-probe"
    parallel_domains = frozenset({"dense", "attention", "moe", "cfg", "pipeline"})
    OPS = frozenset({"echo", "unencodable", "pid", "threads", "groups", "all_reduce", "sleep", "raise", "exit",
                     "send_raw"})

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


# --------------------------------------------------------------------------- fault injection (test_kill_matrix)

#: the ways a rank dies in the kill matrix
DEATHS = ("sigkill", "sigterm", "segv", "exit", "sigstop")
#: where a rank is when it dies
STAGES = ("decode", "plugin", "collective", "encode", "idle")


def die(how: str) -> None:
    """End this process now, the way ``how`` says; never returns.

    "segv" dereferences NULL (core dumps off first: a 300 MB core per case would
    swamp the disk); "sigstop" stops the whole process, which the supervisor can
    only notice by the missing heartbeats.
    """
    import os
    import signal

    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "segv":
        import ctypes
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        ctypes.string_at(0)
    elif how == "exit":
        os._exit(1)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"unknown way of dying {how!r}; ways: {DEATHS}")
    while True:  # a signal sent to ourselves may land a moment later; a stopped one never resumes here
        time.sleep(60)


def _die_later(how: str, after_s: float, when: str | None = None) -> None:
    """Die ``after_s`` from now or, given ``when`` (a path), ``after_s`` after that file appears."""
    def run() -> None:
        import os

        while when is not None and not os.path.exists(when):
            time.sleep(0.005)
        time.sleep(after_s)
        die(how)

    threading.Thread(target=run, name="phyrt-test-die", daemon=True).start()


def _arm_reply_encoding(how: str) -> None:
    """The next "done" this rank encodes kills it (the serve loop calls wire.pack_message)."""
    from runtime.transport import wire

    original = wire.pack_message

    def pack_message(*args: Any, **kwargs: Any) -> bytes:
        if args and args[0] == "done":
            die(how)
        return original(*args, **kwargs)

    wire.pack_message = pack_message


def _arm_request_decoding(how: str, when: str | None = None) -> None:
    """The next request this rank decodes kills it, once its frame is decoded (shared
    memory mapped and all) and before the plugin sees it; given ``when`` (a path), only
    once that file exists (the rank waits for it there)."""
    import os

    from runtime.transport import wire

    original = wire.unpack_message

    def unpack_message(data: Any, **kwargs: Any) -> Any:
        msg = original(data, **kwargs)
        if "request" in (kwargs.get("expected_types") or ()):
            while when is not None and not os.path.exists(when):
                time.sleep(0.005)
            die(how)
        return msg

    wire.unpack_message = unpack_message


def _arm_arena_placement(how: str, mark: str | None = None) -> None:
    """The next block this rank places in its result arena kills it right after the
    placement (a large result grows the arena by a fresh, still-linked segment first);
    given ``mark`` (a path), the placed block's segment name is written there first."""
    import gc
    import warnings

    from runtime.transport.arena import ShmArena

    with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        arenas = [obj for obj in gc.get_objects() if isinstance(obj, ShmArena)]
    for arena in arenas:
        original = arena.place

        def place(nbytes: int, _original=original) -> Any:
            placed = _original(nbytes)
            if mark:
                touch(mark, placed[0])
            die(how)
            return placed

        arena.place = place


import numpy as _np  # noqa: E402 - this section's own import, kept with it


class LethalArray(_np.ndarray):
    """A result whose encoding kills the rank: the wire codec reads ``nbytes`` while it encodes."""

    how = "sigkill"

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        die(self.how)
        return 0


class KillProbeRunner(TPProbeRunner):
    """TPProbe plus "die", "reduce" and "hold_gil".

    ``{"op": "die", "stage": S, "how": H, "ranks": [r]}``: the chosen ranks die the
    way H says (``die``) at stage S; the others behave as real ranks would:

    plugin      in execute; the others wait in a world barrier the chosen never joins
    collective  every rank loops world all_reduces of 1 MiB for up to ``for_s``; a thread
                of the chosen rank kills it ``after_s`` into the loop (or ``after_s`` after
                the file ``die_when`` appears), i.e. inside a collective
    encode      the output rank returns a ``LethalArray`` (dies while its reply is encoded);
                a non-output rank encodes no reply, so the case does not apply to it
    decode      arms the chosen rank: it dies while decoding the NEXT request (once the
                file ``die_when`` exists, if given)
    idle        arms a thread of the chosen rank that kills it ``after_s`` after this
                request returned, while its serve loop waits for work
    reply_shm   arms the chosen (output) rank: the next result-arena placement kills it
                right after it was made (large results grow the arena first); the placed
                segment's name goes to the file ``placed_mark`` first, if given

    ``{"op": "reduce", "x": tensor}``: the world sum of ``x`` (needs every rank).
    ``{"op": "hold_gil", "s": seconds}``: keep the GIL that long in one C call (no other
    thread of the rank runs meanwhile, its heartbeat and death watch included).
    """

    def execute(self, request: dict) -> Any:
        import torch

        from runtime import parallel as P

        op = request["op"]
        _mark(request, self.ctx)
        if op == "reduce":
            y = request["x"].clone()
            P.all_reduce(y, group="world")
            return {"sum": float(y.sum()), "replica": self.ctx.replica_index}
        if op == "hold_gil":
            _hold_gil(request["s"])
            return {"held": request["s"]}
        if op != "die":
            return super().execute(request)
        stage, how = request["stage"], request["how"]
        chosen = P.rank("world") in request["ranks"]
        if stage == "plugin":
            if chosen:
                die(how)
            P.barrier("world")
            return None
        if stage == "collective":
            if chosen:
                _die_later(how, request.get("after_s", 0.3), request.get("die_when"))
            x = torch.ones(1 << 18)
            deadline = time.monotonic() + request.get("for_s", 30.0)
            while time.monotonic() < deadline:
                P.all_reduce(x, group="world", op="max")
            return None
        if stage == "encode":
            if chosen and P.is_output_rank():
                lethal = _np.zeros(4, _np.float32).view(LethalArray)
                lethal.how = how
                return {"x": lethal}
            if chosen:
                _arm_reply_encoding(how)
            return {"encoded": True}
        if stage == "decode":
            if chosen:
                _arm_request_decoding(how, request.get("die_when"))
            return {"armed": list(request["ranks"]), "replica": self.ctx.replica_index}
        if stage == "idle":
            if chosen:
                _die_later(how, request.get("after_s", 0.5))
            return {"armed": list(request["ranks"]), "replica": self.ctx.replica_index}
        if stage == "reply_shm":
            if chosen:
                _arm_arena_placement(how, request.get("placed_mark"))
            return {"armed": list(request["ranks"]), "replica": self.ctx.replica_index}
        raise ValueError(f"unknown stage {stage!r}; stages: {STAGES}")


class KillProbe(TPProbe):
    """TPProbe whose ranks can be made to die at a chosen stage (see ``KillProbeRunner``)."""

    name = "kill-probe"
    OPS = TPProbe.OPS | {"die", "reduce", "hold_gil"}

    def build(self, ctx, plugin_args):
        super().build(ctx, plugin_args)  # the same build-time switches
        return KillProbeRunner(ctx)
