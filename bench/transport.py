"""Transport benchmark: what one request costs on each phyrt path, next to its floors.

    python -m bench.transport [--quick] [--iters N]

    this process (the client)                                    other processes
    inline engine   step() -> serve thread -> Future              -
    local engine    step(): wire encode (tensors into shm), ring ==> every rank: decode, echo, encode
                    step() reads its own answer: ROUTER <====== rank 0 answers (shm views)
                    (polls up to 100 µs first when a core is spare; runtime.transport.spin)
    floor           os.write / os.read  ===================> pipe echo (raw bytes)
    floor           DEALER + msgpack    ===================> ROUTER echo (msgpack)
    baseline        DEALER + pickle     ===================> ROUTER echo (pickle)
    memcpy          numpy.copyto into a preallocated array (one thread), in this process

Every path runs in this one run, side by side: the small-request paths in
interleaved rounds, the tensor paths call by call, so that load from anything
else on the machine lands on all of them alike. Read the ratios, not the
absolute times.

pickle appears only in the "pickle over ZMQ" baseline, between this benchmark's
own two processes; phyrt never pickles on a socket.

The echo servers live in ``bench.echo`` (torch-free: they start in a fraction of
a second); ranks re-import this module for its plugin, so its top level only
defines things. ``python -m bench`` measures the same paths with more peers. Cleanup: engines are closed
and servers joined in one ExitStack; the engines' run directories and the echo
sockets live in one private temporary directory; at the end the benchmark
checks that no child process (multiprocessing's resource tracker, which exits
with this interpreter, aside), no /dev/shm name of its processes and no file in
that directory is left, and warns (exit status 1) if one is.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import platform
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import msgpack
import numpy as np
import psutil
import torch
import zmq

from bench.echo import PipeEcho, ZmqEcho
from runtime.transport import wire
from runtime.core.config import (DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig,
                            ParallelConfig, WorkerSupervisorConfig)
from runtime.engine import Engine
from runtime.core.plugins import Entry
from runtime.transport.arena import ShmArena, ShmMapper, new_run_id
from runtime.transport.spin import budget_ns

PLUGIN = "bench.transport:EchoEntry"
MIB = 1 << 20
TENSOR_MIB = (1, 16, 64)
#: a ~100-byte request, the size of a robot's step message
SMALL_REQUEST = {"task": "pick-cube", "step": 1234, "obs": [0.125 * i for i in range(8)], "done": False}
#: a reply that does not come this long after its request is an error (first replies include startup)
REPLY_TIMEOUT_S = 120.0
ROUNDS = 5
TARGET_SMALL_RATIO = 1.5
TARGET_EXTRA_MEMCPYS = 4.0
TARGET_PICKLE_SPEEDUP = 10.0
_SHM_NAME = re.compile(r"phyrt-[0-9a-f]+-([0-9]+)-[0-9]+")


# --------------------------------------------------------------------------- the echo plugin


class _EchoRunner:
    def execute(self, request: Any) -> Any:
        return request


class EchoEntry(Entry):
    """Returns its request. Declares "dense" so that a tp=2 group may run it:
    every rank echoes, rank 0 answers."""

    name = "bench-echo"
    parallel_domains = frozenset({"dense"})

    def build(self, ctx: Any, plugin_args: Any) -> _EchoRunner:
        return _EchoRunner()


# --------------------------------------------------------------------------- subjects: one call = one round trip


class EngineEcho:
    def __init__(self, label: str, args: EngineArgs, deployment: DeploymentConfig | None = None) -> None:
        self.label = label
        self.engine = Engine(args, deployment)

    def ready(self, request: Any) -> None:
        self.call(request)

    def call(self, request: Any) -> Any:
        return self.engine.step(request, timeout=REPLY_TIMEOUT_S)

    def close(self) -> None:
        self.engine.close()


class Memcpy:
    label = "memcpy (numpy.copyto into a preallocated array, one thread)"

    def __init__(self, like: torch.Tensor) -> None:
        self._dst = torch.empty_like(like)

    def ready(self, request: dict) -> None:
        self.call(request)

    def call(self, request: dict) -> None:
        np.copyto(self._dst.numpy(), request["x"].numpy())  # one memcpy, not OpenMP's split


# --------------------------------------------------------------------------- measuring


class Progress:
    def __init__(self) -> None:
        self._start = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self._start:6.1f} s] {message}", file=sys.stderr, flush=True)


def _timed(call: Callable[[Any], Any], request: Any, n: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        result = call(request)
        into.append(clock() - start)
        del result  # a local result is a view of a rank's arena: drop it before the next call


def _p50(samples: list[int]) -> float:
    return statistics.median(samples)


def _p99(samples: list[int]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_small(subjects: list[tuple[Any, Any]], iters: int, warmup: int, progress: Progress) -> dict[str, list[int]]:
    """``iters`` timed round trips per subject, in ROUNDS interleaved rounds."""
    samples: dict[str, list[int]] = {s.label: [] for s, _ in subjects}
    for subject, request in subjects:
        _timed(subject.call, request, warmup, [])
    per_round = math.ceil(iters / ROUNDS)
    for r in range(ROUNDS):
        progress(f"small requests: round {r + 1}/{ROUNDS} ({per_round} round trips per path)")
        for subject, request in subjects:
            _timed(subject.call, request, per_round, samples[subject.label])
    return samples


def measure_tensor(mib: int, subjects: list[tuple[Any, int]], progress: Progress) -> dict[str, list[int]]:
    """Round trips of {"x": float32 tensor of ``mib`` MiB}, interleaved call by call."""
    x = torch.randn(mib * MIB // 4)
    request = {"x": x}
    memcpy = Memcpy(x)
    subjects = [(memcpy, max(n for _, n in subjects))] + subjects
    for subject, _ in subjects:
        result = subject.call(request)  # warm-up: arenas grow, segments get mapped, pages fault in
        if result is not None and not torch.equal(result["x"], x):
            raise RuntimeError(f"{subject.label} returned a different {mib} MiB tensor")
        del result
        _timed(subject.call, request, 1, [])
    samples: dict[str, list[int]] = {s.label: [] for s, _ in subjects}
    for i in range(max(n for _, n in subjects)):
        for subject, n in subjects:
            if i < n:
                _timed(subject.call, request, 1, samples[subject.label])
    progress(f"tensors: {mib} MiB done")
    return samples


def _spins() -> bool:
    """Whether a one-rank local engine's caller polls before sleeping on this machine."""
    return budget_ns("caller") > 0


def codec_costs(n: int) -> tuple[float, float]:
    """In-process µs (p50) of the codec passes one small round trip makes: phyrt's four
    (request encode and decode, answer encode and decode, with the shared-memory
    encoder and decoder a local replica uses) against the bare echo's four msgpack calls."""
    run_id = new_run_id()
    with ShmArena(run_id, MIB) as arena, ShmMapper(run_id) as mapper:
        encoder = wire.TensorEncoder(allocator=arena)
        decoder = wire.TensorDecoder(mapper=mapper)

        def phyrt_passes() -> None:
            request = wire.pack_message("request", 1, payload=SMALL_REQUEST, tensor_encoder=encoder)
            payload = wire.unpack_message(request, expected_types={"request"}, tensor_decoder=decoder)["payload"]
            answer = wire.pack_message("done", 1, ok=True, result=payload, tensor_encoder=encoder)
            wire.unpack_message(answer, expected_types={"done"}, tensor_decoder=decoder)

        def msgpack_passes() -> None:
            msgpack.unpackb(msgpack.packb(msgpack.unpackb(msgpack.packb(SMALL_REQUEST))))

        out = []
        for passes in (phyrt_passes, msgpack_passes):
            samples: list[int] = []
            _timed(lambda _: passes(), None, n // 10, [])
            _timed(lambda _: passes(), None, n, samples)
            out.append(_p50(samples) / 1e3)
    return out[0], out[1]


# --------------------------------------------------------------------------- report


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}" if ns < 100e3 else f"{ns / 1e3:.0f}"


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}" if ns < 10e6 else f"{ns / 1e6:.1f}"


def _counts(per_size: dict[int, int]) -> str:
    return ", ".join(f"{n} at {mib} MiB" for mib, n in per_size.items())


def header(args: argparse.Namespace, iters: int, warmup: int, tensor_iters: dict[int, int],
           pickle_iters: dict[int, int]) -> str:
    mem = psutil.virtual_memory()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        "# phyrt transport benchmark",
        "",
        f"- machine: {os.cpu_count()} logical cores ({psutil.cpu_count(logical=False)} physical), "
        f"{mem.total / 2**30:.1f} GiB memory ({mem.available / 2**30:.1f} GiB available), "
        f"load average {load} at start; {platform.platform()}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} intra-op threads here), pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
        f"msgpack {'.'.join(map(str, msgpack.version))}",
        f"- run: `python -m bench.transport{' --quick' if args.quick else ''}"
        f"{f' --iters {args.iters}' if args.iters else ''}`",
        "",
        "How each figure was measured: `time.perf_counter_ns` around one whole round trip, in this process "
        "(client-side encode and decode included; results dropped before the next call).",
        f"- Small request: `{SMALL_REQUEST}` ({len(msgpack.packb(SMALL_REQUEST))} bytes as msgpack), echoed. "
        f"{warmup} warm-up then {iters} timed round trips per path, in {ROUNDS} interleaved rounds; "
        "p50 is the median, p99 the nearest-rank 99th percentile.",
        "- Engines: `engine.step(request)` with the plugin `bench.transport:EchoEntry` (returns its request). "
        "inline: `Engine(EngineArgs(...))`; local: `DeploymentConfig.local(replica_count=1)`, "
        "`DeviceConfig(target=\"cpu\")`; tp=2: `ParallelConfig(dense=DenseParallelConfig(tp_size=2))`, "
        "both ranks echo, rank 0 answers.",
        "- Floors, in separate spawned processes: an OS pipe echo of the request's msgpack bytes (raw `os.write`/"
        "`os.read`, no codec) and a ZMQ DEALER (here) / ROUTER (echo process) pair over `ipc://` that "
        "`msgpack`-decodes and re-encodes on both sides.",
        f"- Tensors: request `{{\"x\": torch.randn(n)}}` (float32, {', '.join(f'{m} MiB' for m in TENSOR_MIB)}), "
        "echoed; results checked equal once, then medians of round trips interleaved call by call "
        f"(engines and memcpy: {_counts(tensor_iters)}; pickle: {_counts(pickle_iters)}). memcpy: one single-threaded `numpy.copyto` "
        "into a preallocated tensor of the same size, in this process. Baseline: pickle over ZMQ, "
        "`pickle.dumps`/`pickle.loads` (protocol 5) on both sides of a DEALER/ROUTER `ipc://` pair "
        "(zero-copy frames).",
    ])


def small_table(small: dict[str, list[int]], floor_label: str) -> str:
    floor = _p50(small[floor_label])
    lines = ["## Small-request round trip", "", "| path | p50 µs | p99 µs | p50 / bare ZMQ echo |",
             "|---|---:|---:|---:|"]
    for label, samples in small.items():
        lines.append(f"| {label} | {_us(_p50(samples))} | {_us(_p99(samples))} | {_p50(samples) / floor:.2f}× |")
    return "\n".join(lines)


def tensor_table(tensors: dict[int, dict[str, list[int]]], labels: dict[str, str]) -> str:
    lines = ["## Tensors in and out (median ms)", "",
             "| size | memcpy | inline | local 1 rank | pickle over ZMQ (baseline) | "
             "extra memcpys (local − inline) / memcpy | pickle / local |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mib, samples in tensors.items():
        med = {key: _p50(samples[label]) for key, label in labels.items()}
        extra = (med["local"] - med["inline"]) / med["memcpy"]
        lines.append(f"| {mib} MiB | {_ms(med['memcpy'])} | {_ms(med['inline'])} | {_ms(med['local'])} | "
                     f"{_ms(med['pickle'])} | {extra:.2f} | {med['pickle'] / med['local']:.1f}× |")
    return "\n".join(lines)


def targets_table(small: dict[str, list[int]], big: dict[str, list[int]], labels: dict[str, str],
                  local_small: str, zmq_small: str) -> str:
    local, floor = _p50(small[local_small]), _p50(small[zmq_small])
    med = {key: _p50(big[label]) for key, label in labels.items()}
    ratio = local / floor
    extra = (med["local"] - med["inline"]) / med["memcpy"]
    speedup = med["pickle"] / med["local"]
    rows = [
        (f"local 1-rank small p50 ≤ {TARGET_SMALL_RATIO}× bare ZMQ echo p50",
         f"{ratio:.2f}× ({_us(local)} µs / {_us(floor)} µs)", ratio <= TARGET_SMALL_RATIO),
        (f"64 MiB in+out ≤ {TARGET_EXTRA_MEMCPYS:g} memcpys more than inline",
         f"{extra:.2f} memcpys (({_ms(med['local'])} − {_ms(med['inline'])}) ms / {_ms(med['memcpy'])} ms)",
         extra <= TARGET_EXTRA_MEMCPYS),
        (f"64 MiB ≥ {TARGET_PICKLE_SPEEDUP:g}× faster than pickle over ZMQ",
         f"{speedup:.1f}× ({_ms(med['pickle'])} ms / {_ms(med['local'])} ms)", speedup >= TARGET_PICKLE_SPEEDUP),
    ]
    lines = ["## Targets", "", "| target | figure | |", "|---|---|---|"]
    lines += [f"| {name} | {figure} | {'met' if ok else '**not met**'} |" for name, figure, ok in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- cleanup check


def leftovers(workdir: str, pids: set[int]) -> list[str]:
    """What this run left behind: child processes (then killed), /dev/shm names, files in workdir."""
    found = []
    children = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    _, alive = psutil.wait_procs(children, timeout=5)
    for proc in alive:
        found.append(f"child process {proc.pid} still running (killed now)")
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir("/dev/shm")):
            match = _SHM_NAME.fullmatch(name)
            if match and int(match.group(1)) in pids:
                found.append(f"/dev/shm/{name}")
    for root, dirs, files in os.walk(workdir):
        found += [os.path.join(root, name) for name in dirs + files]
    return found


def _is_resource_tracker(proc: psutil.Process) -> bool:
    """multiprocessing's own helper: the spawn start method starts it, and it exits with this interpreter."""
    try:
        return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace, progress: Progress, workdir: str, pids: set[int], stack: contextlib.ExitStack) -> str:
    iters = args.iters or (2000 if args.quick else 20000)
    warmup = max(50, iters // 10)
    tensor_iters = {1: 60, 16: 20, 64: 10} if args.quick else {1: 400, 16: 100, 64: 40}
    pickle_iters = {1: 10, 16: 4, 64: 3} if args.quick else {1: 50, 16: 15, 64: 8}
    report = [header(args, iters, warmup, tensor_iters, pickle_iters)]

    mp = multiprocessing.get_context("spawn")
    zctx = zmq.Context(1)
    stack.callback(zctx.term)  # runs last: every socket on it is closed by then
    # what only the small-request runs need; closed before the tensor runs, so that
    # idle peers do not share the cores with them
    small_only = stack.enter_context(contextlib.ExitStack())
    progress("starting the echo servers (pipe, ZMQ+msgpack, ZMQ+pickle)")
    pipe = PipeEcho(mp)
    small_only.callback(pipe.close)
    zmq_msgpack = ZmqEcho(mp, zctx, workdir, "msgpack")
    small_only.callback(zmq_msgpack.close)
    zmq_pickle = ZmqEcho(mp, zctx, workdir, "pickle")
    stack.callback(zmq_pickle.close)

    cpu = EngineConfig(device=DeviceConfig(target="cpu"))
    progress("starting the inline engine")
    inline = EngineEcho("inline engine", EngineArgs(plugin=PLUGIN))
    stack.callback(inline.close)
    progress("starting the local engine, 1 rank")
    local = EngineEcho("local engine, 1 rank", EngineArgs(plugin=PLUGIN, config=cpu),
                       DeploymentConfig.local(replica_count=1))
    stack.callback(local.close)
    progress("starting the local engine, tp=2")
    tp2_config = EngineConfig(device=DeviceConfig(target="cpu"),
                              parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2)))
    tp2 = EngineEcho("local engine, tp=2 (2 ranks, rank 0 answers)", EngineArgs(plugin=PLUGIN, config=tp2_config),
                     DeploymentConfig.local(replica_count=1,
                                            process_config=WorkerSupervisorConfig(base_port=_free_port())))
    small_only.callback(tp2.close)
    pids.update(p.pid for p in psutil.Process().children(recursive=True))

    packed = msgpack.packb(SMALL_REQUEST)
    pipe.ready(packed)
    for subject in (zmq_msgpack, zmq_pickle, inline, local, tp2):
        subject.ready(SMALL_REQUEST)
    progress(f"everything answers; small requests: {warmup} warm-up + {iters} timed round trips per path")
    small = measure_small([(pipe, packed), (zmq_msgpack, SMALL_REQUEST), (inline, SMALL_REQUEST),
                           (local, SMALL_REQUEST), (tp2, SMALL_REQUEST)], iters, warmup, progress)
    small_only.close()

    tensors = {}
    for mib in TENSOR_MIB:
        progress(f"tensors: {mib} MiB")
        tensors[mib] = measure_tensor(mib, [(inline, tensor_iters[mib]), (local, tensor_iters[mib]),
                                            (zmq_pickle, pickle_iters[mib])], progress)
    labels = {"memcpy": Memcpy.label, "inline": inline.label, "local": local.label, "pickle": zmq_pickle.label}

    progress("codec costs, in process")
    wire_us, msgpack_us = codec_costs(max(1000, iters // 2))
    report += ["", small_table(small, zmq_msgpack.label), "",
               f"Codec share, in process (p50, no I/O): the four codec passes of one local round trip "
               f"(`runtime.transport.wire` encode and decode of the request, then of the answer, with the "
               f"shared-memory encoder and decoder) take {wire_us:.1f} µs; the bare echo's four msgpack "
               f"calls take {msgpack_us:.1f} µs. The rest of the gap to the bare echo lies outside the codec: "
               "the caller's engine layers (dispatcher, executor, future) and the rank's serve loop. The "
               "caller in `step()` reads its own answer (no supervisor thread involved) and, with a core "
               f"to spare (here: {'yes' if _spins() else 'no'}), polls up to "
               f"{budget_ns('caller') / 1e3:.0f} µs before it sleeps; the bare echo's client sleeps "
               "in `recv` at once.",
               "", tensor_table(tensors, labels), "",
               targets_table(small, tensors[64], labels, local.label, zmq_msgpack.label)]
    return "\n".join(report)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transport",
        description="Round-trip cost of phyrt's inline and local (1 rank, tp=2) engines next to an OS pipe "
                    "echo, a bare ZMQ+msgpack echo, memcpy and pickle over ZMQ, measured side by side in one "
                    "run. Prints a Markdown table to stdout (progress to stderr) and says whether the "
                    "transport targets are met. Exit status 1 if anything (process, /dev/shm name, socket "
                    "file) was left behind.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations: about half a minute on 2 cores (the default run takes about a minute)")
    parser.add_argument("--iters", type=int, metavar="N",
                        help="timed small-request round trips per path (default 20000, 2000 with --quick); "
                             "tensor iteration counts follow --quick")
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < ROUNDS:
        parser.error(f"--iters must be at least {ROUNDS} (one per round), got {args.iters}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Progress()
    workdir = tempfile.mkdtemp(prefix="phyrt-bench-")  # mode 0700
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, workdir  # the engines' run directories go here
    pids = {os.getpid()}
    try:
        with contextlib.ExitStack() as stack:
            report = run(args, progress, workdir, pids, stack)
            progress("closing engines and servers")
    finally:
        tempfile.tempdir = saved_tempdir
        left = leftovers(workdir, pids)
        shutil.rmtree(workdir, ignore_errors=True)
    cleanup = ("no child process, no /dev/shm name of this run, no socket file or run directory left"
               if not left else "WARNING, left behind: " + "; ".join(left))
    print(report + "\n\n## Cleanup\n\n" + cleanup)
    if left:
        print(f"bench.transport: {cleanup}", file=sys.stderr)
    progress("done")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
