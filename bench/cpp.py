"""Section "cpp": the C++ client (cpp/include/phyrt, examples/cpp) against the Python client and the floor.

    build/client_call --calls N   ===> python -m runtime.launch --address ipc://... (echo plugin, inline)
    runtime.client.Client         ===> the same server, the same request
    bare ZMQ DEALER + msgpack     ===> ROUTER echo (msgpack), bench.echo.ZmqEcho: the floor

One small request, ``{"obs": float32 [1, 32]}`` (128 bytes of tensor; the floor echoes the same
bytes as a msgpack ``bin``), timed call by call: the C++ program times its own calls with
``steady_clock`` and writes them to a file (``{"round_trip_ns": [...]}``); the Python paths use
``bench.common.timed``. The C++ examples are built here first (``cmake --build --target client_call``,
Release) into the run's work directory; without cmake, g++ or the Debian packages the section says so
and measures nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import numpy as np

from bench.common import RunContext, Section, Table, fmt_us, p50, p99, ratio, timed
from bench.echo import ZmqEcho

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = "apt-get install cmake g++ pkg-config libzmq3-dev cppzmq-dev libmsgpack-cxx-dev"
OBS_DIM = 32
LABELS = {"cpp": "phyrt C++ client (examples/cpp/client_call)", "python": "phyrt Python client (runtime.client)",
          "floor": "bare ZMQ DEALER/ROUTER ipc:// + msgpack echo (floor)"}


def _build(ctx: RunContext, build_dir: str) -> str | None:
    """Build client_call; its path, or None (a progress line says why)."""
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        ctx.progress(f"cpp: cmake or g++ is missing ({_PACKAGES})")
        return None
    for step in (["cmake", "-S", os.path.join(_ROOT, "examples", "cpp"), "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release"],
                 ["cmake", "--build", build_dir, "--target", "client_call", "-j2"]):
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            ctx.progress(f"cpp: {' '.join(step[:2])} failed ({_PACKAGES}): {done.stderr.strip()[-500:]}")
            return None
    return os.path.join(build_dir, "client_call")


def _cpp_samples(binary: str, address: str, iters: int, out: str) -> list[int]:
    done = subprocess.run([binary, "--address", address, "--print", "obs", "--calls", str(iters),
                           "--latency-out", out], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"client_call failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    with open(out) as f:
        return json.load(f)["round_trip_ns"]


def run(ctx: RunContext) -> Section:
    from bench import serving as sv

    section = Section("cpp", "C++ client: small-request round trip against the Python client and the floor")
    iters = 1000 if ctx.quick else 10000
    warmup = max(50, iters // 10)
    obs = (np.float32(0.01) * np.arange(OBS_DIM, dtype=np.float32))[None]
    build_dir = os.path.join(ctx.workdir, "cpp-build")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, build_dir, True)
        ctx.progress("cpp: building examples/cpp (client_call)")
        binary = _build(ctx, build_dir)
        if binary is None:
            section.notes.append(f"not available: examples/cpp did not build here ({_PACKAGES}); nothing measured")
            return section
        logdir = os.path.join(ctx.workdir, "cpp-logs")
        os.makedirs(logdir, exist_ok=True)
        stack.callback(shutil.rmtree, logdir, True)
        server = sv.LaunchedServer(f"ipc://{ctx.workdir}/cpp-phyrt.sock", logdir, "cpp-phyrt")
        stack.callback(server.close)
        ctx.pids.update(server.pids())
        import zmq

        zctx = zmq.Context(1)
        stack.callback(zctx.term)
        floor = ZmqEcho(ctx.mp(), zctx, ctx.workdir, "msgpack")
        stack.callback(floor.close)
        ctx.pids.add(floor.process.pid)
        python = sv.PhyrtPath(LABELS["python"], server.address)
        stack.callback(python.close)
        samples: dict[str, list[int]] = {"cpp": [], "python": [], "floor": []}
        ctx.progress(f"cpp: {iters} calls each (C++ client, Python client, floor)")
        samples["cpp"] = _cpp_samples(binary, server.address, warmup + iters, os.path.join(logdir, "cpp.json"))[warmup:]
        timed(python.call, {"obs": obs}, warmup, None)
        timed(python.call, {"obs": obs}, iters, samples["python"])
        floor.ready({"obs": obs.tobytes()})
        timed(floor.call, {"obs": obs.tobytes()}, warmup, None)
        timed(floor.call, {"obs": obs.tobytes()}, iters, samples["floor"])
    base = p50(samples["floor"])
    section.tables.append(Table(
        "Small request round trip (float32 [1, 32]), one caller",
        ["path", "p50 (µs)", "p99 (µs)", "p50 / floor"],
        [[LABELS[k], fmt_us(p50(s)), fmt_us(p99(s)), ratio(p50(s), base)] for k, s in samples.items()],
        [f"{iters} timed calls per path after {warmup} warm-up calls, one path after another against one "
         "`python -m runtime.launch --plugin bench.transport:EchoEntry` server on ipc:// (the floor: its own echo "
         "process); the C++ client times each `Client::call` with `std::chrono::steady_clock`, the Python paths "
         "with `time.perf_counter_ns`. Frames only on both clients (128 bytes is below the shared-memory threshold)."]))
    section.data = {k: {"p50_ns": p50(s), "p99_ns": p99(s), "n": len(s)} for k, s in samples.items()}
    section.notes.append("The C++ client hands each request to its I/O thread and back (two thread switches per "
                         "round trip); the Python client's lone caller reads the socket itself.")
    return section
