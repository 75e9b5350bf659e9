"""Section "latency": one round trip against payload size, on every transport, side by side.

    this process                                            other processes
    phyrt inline     engine.step -> serve thread -> Future  -
    phyrt local      engine.step -> wire (tensors in shm) ==> 1 rank: decode, echo, encode (shm)
    phyrt local tp=2 the same to a replica of 2 ranks ======> both decode and echo, rank 0 answers
                     (small request only: the cost of a replica's second rank on the request path)
    bare ZMQ         DEALER + msgpack  ===================> ROUTER echo (msgpack)          floor
    OS pipe          os.write / os.read ==================> pipe echo (raw bytes)           floor, small only
    pickle over ZMQ  DEALER + pickle   ===================> ROUTER echo (pickle)           baseline
    websocket        msgpack-numpy     ===================> asyncio websockets echo        peer
    Ray              ray.get(actor.echo.remote(x)) =======> Ray actor (object store)       peer
    memcpy           numpy.copyto into a preallocated array (one thread), in this process

Payloads: the ~100-byte robot step message, then ``{"x": float32 tensor}`` of 1, 16
and 64 MiB. Each path gets the payload in its own idiom: torch tensors for phyrt and
pickle (as ``bench.transport`` sends them), numpy arrays for the websocket and Ray
peers, a msgpack ``bin`` of the tensor's bytes for the bare ZMQ floor.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable

import numpy as np

from bench.common import (MIB, SMALL_REQUEST, RunContext, Section, Table, Target, fmt_ms, fmt_us, p50, p99,
                          ratio, timed)

ROUNDS = 5
SIZES_MIB = (1, 16, 64)
INLINE, LOCAL, LOCAL_TP2, ZMQ, PIPE, PICKLE, WS, RAY, MEMCPY = (
    "inline", "local", "local_tp2", "zmq", "pipe", "pickle", "websocket", "ray", "memcpy")
#: a tp=2 replica's small-request p50 against a 1-rank replica's (issue 33's target)
TARGET_TP2_RATIO = 1.15
LABELS = {
    INLINE: "phyrt inline engine",
    LOCAL: "phyrt local engine, 1 rank",
    LOCAL_TP2: "phyrt local engine, a tp=2 replica (2 ranks)",
    ZMQ: "bare ZMQ DEALER/ROUTER ipc:// + msgpack (floor)",
    PIPE: "OS pipe echo, raw bytes (floor)",
    PICKLE: "pickle over ZMQ DEALER/ROUTER ipc:// (baseline)",
    WS: "msgpack-numpy over websocket (peer)",
    RAY: "Ray actor (peer)",
    MEMCPY: "memcpy (numpy.copyto, one thread, in process)",
}


class Path:
    """One transport: ``call(request)`` is one round trip; ``request(size)`` its payload (None: not run);
    ``ranks``: a local engine's rank processes, rank 0 first (their CPU is counted)."""

    def __init__(self, key: str, call: Callable[[Any], Any], request: Callable[[Any], Any], slow: bool = False,
                 ranks: tuple[Any, ...] = ()):
        self.key, self.label, self.call, self.request, self.slow = key, LABELS[key], call, request, slow
        self.ranks = ranks


def _new_ranks(before: set[int]) -> tuple[Any, ...]:
    """The rank processes (``phyrt-r<replica>-<rank>``) this process started since ``before``, rank 0 first."""
    import psutil

    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    return tuple(sorted((c for c in new if c.name().startswith("phyrt-r")), key=lambda c: c.name()))


def _cpu_s(process: Any) -> float:
    """CPU seconds of all of ``process``'s threads: the scheduler's ns counts (``/proc/PID/task/*/
    schedstat``) where Linux has them, else psutil's clock ticks (10 ms: too coarse for one round)."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{process.pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
                with open(f"/proc/{process.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        times = process.cpu_times()
        return times.user + times.system


def _payloads(mib: int) -> dict[str, Any]:
    import torch

    x = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(mib))
    return {"torch": {"x": x}, "numpy": {"x": x.numpy()}, "bytes": {"x": memoryview(x.numpy()).cast("B")}, "x": x}


def _same(result: Any, payload: dict, key: str) -> bool:
    import numpy as np
    import torch

    got = result["x"] if isinstance(result, dict) else None
    if isinstance(got, torch.Tensor):
        return torch.equal(got, payload["x"])
    if isinstance(got, np.ndarray):
        return np.array_equal(got, payload["x"].numpy())
    if isinstance(got, (bytes, bytearray, memoryview)):
        return bytes(got) == payload["x"].numpy().tobytes()
    return False


def start_paths(ctx: RunContext, stack: contextlib.ExitStack, section: Section) -> list[Path]:
    import msgpack
    import psutil
    import zmq

    from bench.echo import PipeEcho, ZmqEcho
    from bench.peers import PeerUnavailable, RayPeer, WebsocketPeer
    from bench.transport import PLUGIN, EngineEcho
    from runtime.core.config import (DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig,
                                     ParallelConfig)

    mp = ctx.mp()
    zctx = zmq.Context(1)
    stack.callback(zctx.term)  # runs last: every socket on it is closed by then
    progress = ctx.progress
    progress("latency: starting the echo servers (pipe, ZMQ+msgpack, ZMQ+pickle, websocket)")
    pipe = PipeEcho(mp)
    stack.callback(pipe.close)
    zmq_msgpack = ZmqEcho(mp, zctx, ctx.workdir, "msgpack")
    stack.callback(zmq_msgpack.close)
    zmq_pickle = ZmqEcho(mp, zctx, ctx.workdir, "pickle")
    stack.callback(zmq_pickle.close)
    paths = [Path(PIPE, pipe.call, lambda p: msgpack.packb(SMALL_REQUEST) if p is None else None),
             Path(ZMQ, zmq_msgpack.call, lambda p: SMALL_REQUEST if p is None else p["bytes"]),
             Path(PICKLE, zmq_pickle.call, lambda p: SMALL_REQUEST if p is None else p["torch"], slow=True)]
    try:
        ws = WebsocketPeer(mp)
        stack.callback(ws.close)
        paths.append(Path(WS, ws.call, lambda p: SMALL_REQUEST if p is None else p["numpy"], slow=True))
    except PeerUnavailable as exc:
        section.data.setdefault("unavailable", {})[WS] = str(exc)
        section.notes.append(f"{LABELS[WS]}: not available: {exc}")
    progress("latency: starting Ray (a local cluster and one actor)")
    try:
        ray = RayPeer()
        stack.callback(ray.close)
        paths.append(Path(RAY, ray.call, lambda p: SMALL_REQUEST if p is None else p["numpy"]))
    except PeerUnavailable as exc:
        section.data.setdefault("unavailable", {})[RAY] = str(exc)
        section.notes.append(f"{LABELS[RAY]}: not available: {exc}")
        progress(f"latency: Ray not available: {exc}")
    progress("latency: starting the phyrt engines (inline; local, 1 rank; local, a tp=2 replica)")
    inline = EngineEcho(LABELS[INLINE], EngineArgs(plugin=PLUGIN))
    stack.callback(inline.close)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    local = EngineEcho(LABELS[LOCAL], EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu"))),
                       DeploymentConfig.local(replica_count=1))
    stack.callback(local.close)
    local_ranks = _new_ranks(before)
    before |= {p.pid for p in local_ranks}
    tp2 = EngineEcho(LABELS[LOCAL_TP2], EngineArgs(plugin=PLUGIN, config=EngineConfig(
        device=DeviceConfig(target="cpu"), parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2)))),
        DeploymentConfig.local(replica_count=1))
    stack.callback(tp2.close)
    paths += [Path(INLINE, inline.call, lambda p: SMALL_REQUEST if p is None else p["torch"]),
              Path(LOCAL, local.call, lambda p: SMALL_REQUEST if p is None else p["torch"], ranks=local_ranks),
              Path(LOCAL_TP2, tp2.call, lambda p: SMALL_REQUEST if p is None else None, ranks=_new_ranks(before))]
    ctx.pids.update(p.pid for p in psutil.Process().children(recursive=True))
    return paths


def measure_small(paths: list[Path], iters: int, warmup: int, ctx: RunContext,
                  cpu: dict[str, list[float]]) -> dict[str, list[int]]:
    """``warmup`` untimed, then ``iters`` timed round trips per path in ROUNDS interleaved rounds.
    For a path with ranks, ``cpu[key]``: the CPU seconds this process and each rank spent in its
    timed rounds (while one path runs, the others' threads and processes are idle)."""
    import psutil

    me = psutil.Process()
    subjects = [(p, p.request(None)) for p in paths if p.request(None) is not None]
    for path, request in subjects:
        reply = path.call(request)
        if path.key != PIPE and reply != request:
            raise RuntimeError(f"{path.label} returned {reply!r} for {request!r}")
        timed(path.call, request, warmup, None)
    samples: dict[str, list[int]] = {p.key: [] for p, _ in subjects}
    per_round = math.ceil(iters / ROUNDS)
    for r in range(ROUNDS):
        ctx.progress(f"latency: small request, round {r + 1}/{ROUNDS} ({per_round} round trips per path)")
        for path, request in subjects:
            procs = (me, *path.ranks) if path.ranks else ()
            start = [_cpu_s(q) for q in procs]
            timed(path.call, request, per_round, samples[path.key])
            if procs:
                spent = [_cpu_s(q) - s for q, s in zip(procs, start)]
                cpu[path.key] = [a + b for a, b in zip(cpu.get(path.key, [0.0] * len(spent)), spent)]
    return samples


def measure_size(paths: list[Path], mib: int, counts: tuple[int, int], ctx: RunContext) -> dict[str, list[int]]:
    """One checked call and one untimed call per path, then round trips interleaved call by
    call: ``counts[0]`` per fast path, ``counts[1]`` per slow one (pickle, websocket)."""
    payload = _payloads(mib)
    dst = payload["x"].clone()
    # one plain memcpy (numpy copies on one thread; torch's copy_ splits it over OpenMP
    # threads that fight the other processes for 2 cores, which would flatter the ratios)
    memcpy = Path(MEMCPY, lambda p: np.copyto(dst.numpy(), p["x"].numpy()), lambda p: p["torch"])
    subjects = [(p, p.request(payload)) for p in [memcpy] + paths]
    subjects = [(p, r, counts[1] if p.slow else counts[0]) for p, r in subjects if r is not None]
    for path, request, _ in subjects:
        if path.key != MEMCPY:
            result = path.call(request)
            if not _same(result, payload, path.key):
                raise RuntimeError(f"{path.label} returned a different {mib} MiB tensor")
            del result
        if not path.slow:
            timed(path.call, request, 1, None)
    samples: dict[str, list[int]] = {p.key: [] for p, _, _ in subjects}
    for i in range(max(n for _, _, n in subjects)):
        for path, request, n in subjects:
            if i < n:
                timed(path.call, request, 1, samples[path.key])
    return samples


def run(ctx: RunContext) -> Section:
    import msgpack

    from bench import transport

    section = Section("latency", "Round-trip latency against payload size, per transport")
    iters = 600 if ctx.quick else 10000
    warmup = max(50, iters // 10)
    counts = {1: (20, 8), 16: (8, 3), 64: (5, 3)} if ctx.quick else {1: (200, 40), 16: (60, 12), 64: (20, 8)}
    with contextlib.ExitStack() as stack:
        paths = start_paths(ctx, stack, section)
        ctx.progress(f"latency: small request, {warmup} warm-up + {iters} timed round trips per path")
        cpu: dict[str, list[float]] = {}
        samples: dict[Any, dict[str, list[int]]] = {"small": measure_small(paths, iters, warmup, ctx, cpu)}
        for mib in SIZES_MIB:
            fast, slow = counts[mib]
            ctx.progress(f"latency: {mib} MiB tensor ({fast} round trips per path, {slow} for pickle and websocket)")
            samples[mib] = measure_size(paths, mib, counts[mib], ctx)
        ctx.progress("latency: closing engines, servers and Ray")

    small_bytes = len(msgpack.packb(SMALL_REQUEST))
    available = [p.key for p in paths]
    unavailable = section.data.get("unavailable", {})
    section.data = {
        "unavailable": unavailable,
        "small_request_bytes": small_bytes,
        "p50_ns": {str(size): {k: p50(v) for k, v in by.items()} for size, by in samples.items()},
        "p99_ns": {str(size): {k: p99(v) for k, v in by.items()} for size, by in samples.items()},
        "n": {str(size): {k: len(v) for k, v in by.items()} for size, by in samples.items()},
        "labels": {k: LABELS[k] for k in available + [MEMCPY]},
    }
    section.data["small_cpu_us_per_request"] = {k: [round(1e6 * c / len(samples["small"][k]), 1) for c in v]
                                                for k, v in cpu.items()}
    section.tables += [_small_table(samples["small"], iters, warmup, small_bytes), _cpu_table(samples["small"], cpu),
                       _size_table(samples, counts)]
    for table in section.tables:  # a peer that could not run still has its row, saying why
        for key, reason in unavailable.items():
            row = [LABELS[key], f"not available: {reason}"] + [""] * (len(table.headers) - 2)
            table.rows.append(row if table.headers[0] == "path" else ["all"] + row[:-1])
    section.targets += _targets(samples, transport)
    section.data["plot_sizes"] = {"small": small_bytes, **{str(m): m * MIB for m in SIZES_MIB}}
    return section


def _small_table(small: dict[str, list[int]], iters: int, warmup: int, nbytes: int) -> Table:
    floor = p50(small[ZMQ])
    rows = [[LABELS[k], fmt_us(p50(s)), fmt_us(p99(s)), ratio(p50(s), floor)] for k, s in small.items()]
    return Table(
        "Small request (~100 B) round trip", ["path", "p50 µs", "p99 µs", "p50 / bare ZMQ echo"], rows,
        [f"Request `{SMALL_REQUEST}` ({nbytes} bytes as msgpack), echoed. `time.perf_counter_ns` around one "
         "whole round trip in this process (client-side encode and decode included). "
         f"{warmup} untimed warm-up calls, then {iters} timed round trips per path in {ROUNDS} interleaved rounds "
         "(so that load from elsewhere lands on every path alike). p50 = median, p99 = nearest-rank 99th "
         "percentile. Baseline: the bare ZMQ+msgpack echo, measured in the same run.",
         "Engines: `engine.step(request)` with `bench.transport:EchoEntry`; local = "
         "`DeploymentConfig.local(replica_count=1)` on the CPU (tp=2: `ParallelConfig(dense=DenseParallelConfig("
         "tp_size=2))`, 2 ranks, rank 0 answers). Echo servers and peers are separate spawned "
         "processes; the Ray actor runs in a Ray worker of a local Ray cluster started by `ray.init`."])


def _cpu_table(small: dict[str, list[int]], cpu: dict[str, list[float]]) -> Table:
    from runtime.transport.spin import usable_cores

    rows = []
    for key, spent in cpu.items():
        n = len(small[key])
        ranks = [fmt_us(1e9 * s / n) for s in spent[1:]] + [""] * (3 - len(spent))
        rows.append([LABELS[key], fmt_us(p50(small[key])), fmt_us(1e9 * spent[0] / n), *ranks,
                     fmt_us(1e9 * sum(spent) / n)])
    return Table(
        "Small request on a local engine: where the CPU goes", ["path", "p50 µs", "this process µs/request",
                                                               "rank 0 µs/request", "rank 1 µs/request",
                                                               "all µs/request"], rows,
        [f"The timed rounds of the table above, on {usable_cores()} usable cores: the CPU time of all threads of "
         "this process (the caller and the supervisor's link thread) and of each rank process (the scheduler's "
         "counts, `/proc/PID/task/*/schedstat`), divided by the round trips. A process that polls for a message "
         "a moment before it sleeps (`runtime.transport.spin`) counts that time too. Where the processes of a "
         "path need more cores than there are, one's CPU time lands on the core another needs: rank 1 sends "
         "nothing per request, but its decode and echo of each request still take a core."])


def _size_table(samples: dict[Any, dict[str, list[int]]], counts: dict[int, tuple[int, int]]) -> Table:
    rows = []
    for mib in SIZES_MIB:
        by = samples[mib]
        memcpy, local = p50(by[MEMCPY]), p50(by[LOCAL])
        for key, s in by.items():
            gbps = 2 * mib * MIB / p50(s) if key != MEMCPY else mib * MIB / p50(s)
            rows.append([f"{mib} MiB", LABELS[key], fmt_ms(p50(s)), fmt_ms(p99(s)), f"{gbps:.2f}",
                         ratio(p50(s), memcpy), ratio(p50(s), local), str(len(s))])
    count_text = "; ".join(f"{m} MiB: {fast} per path, {slow} for pickle and websocket" for m, (fast, slow)
                           in counts.items())
    return Table(
        "Tensor round trip (in and out) against size", ["size", "path", "p50 ms", "p99 ms",
                                                        "GB/s (bytes moved / p50)", "p50 / memcpy",
                                                        "p50 / phyrt local", "n"], rows,
        ["Request `{\"x\": float32 tensor}` echoed (in and out): torch tensors to phyrt and pickle, numpy arrays "
         "to the websocket and Ray peers, the tensor's bytes as a msgpack `bin` to the bare ZMQ floor. Each "
         "result is checked equal to the request once; then one untimed call (not for the slow paths), then "
         f"round trips interleaved call by call ({count_text}). Baselines measured in the same run: memcpy "
         "(one single-threaded `numpy.copyto` into a preallocated array of the same size, in this process) and the phyrt local "
         "engine. GB/s counts the bytes moved: 2 × size for a round trip, 1 × size for memcpy. pickle: "
         "`pickle.dumps`/`loads` (protocol 5) of the torch tensor on both sides, zero-copy frames."])


def _targets(samples: dict[Any, dict[str, list[int]]], transport: Any) -> list[Target]:
    from runtime.transport.spin import usable_cores

    small, big = samples["small"], samples[64]
    local, floor = p50(small[LOCAL]), p50(small[ZMQ])
    med = {k: p50(big[k]) for k in (MEMCPY, INLINE, LOCAL, PICKLE)}
    small_ratio = local / floor
    tp2_ratio = p50(small[LOCAL_TP2]) / local
    extra = (med[LOCAL] - med[INLINE]) / med[MEMCPY]
    speedup = med[PICKLE] / med[LOCAL]
    targets = [
        Target(f"local 1-rank small-request p50 ≤ {transport.TARGET_SMALL_RATIO:g}× bare ZMQ echo p50",
               f"{small_ratio:.2f}× ({fmt_us(local)} µs / {fmt_us(floor)} µs)",
               small_ratio <= transport.TARGET_SMALL_RATIO),
        Target(f"local tp=2 replica's small-request p50 ≤ {TARGET_TP2_RATIO:g}× a 1-rank replica's "
               f"({usable_cores()} usable cores)",
               f"{tp2_ratio:.2f}× ({fmt_us(p50(small[LOCAL_TP2]))} µs / {fmt_us(local)} µs)",
               tp2_ratio <= TARGET_TP2_RATIO),
        Target(f"64 MiB in+out on a local rank ≤ {transport.TARGET_EXTRA_MEMCPYS:g} memcpys more than inline",
               f"{extra:.2f} memcpys (({fmt_ms(med[LOCAL])} − {fmt_ms(med[INLINE])}) ms / {fmt_ms(med[MEMCPY])} ms)",
               extra <= transport.TARGET_EXTRA_MEMCPYS),
        Target(f"64 MiB ≥ {transport.TARGET_PICKLE_SPEEDUP:g}× faster than pickle over ZMQ",
               f"{speedup:.1f}× ({fmt_ms(med[PICKLE])} ms / {fmt_ms(med[LOCAL])} ms)",
               speedup >= transport.TARGET_PICKLE_SPEEDUP),
    ]
    return targets
