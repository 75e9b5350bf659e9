"""What every section of ``python -m bench`` shares: clocks, statistics, result types, the machine.

Leaf module, torch-free at import: spawned children (ranks, echo servers) re-import
modules of this package, and should start fast.

A section returns a ``Section``: its tables (each with the text that says how its
numbers were measured), its targets (the figure measured and met / missed), notes
(a peer that was not available and why) and plot files. ``bench.report`` turns a
list of sections into Markdown; nothing here prints.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

MIB = 1 << 20
#: a ~100-byte request, the size of a robot's step message (the same as bench.transport's and bench.serving's)
SMALL_REQUEST = {"task": "pick-cube", "step": 1234, "obs": [0.125 * i for i in range(8)], "done": False}


# --------------------------------------------------------------------------- results


@dataclass
class Table:
    """One Markdown table. ``method``: how its numbers were measured (iterations,
    warm-up, what the clock covers), printed above it."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    method: list[str] = field(default_factory=list)


@dataclass
class Target:
    """A goal and what this run measured for it. ``met`` is None when it could not be measured."""

    name: str
    figure: str
    met: bool | None

    @property
    def verdict(self) -> str:
        return {True: "met", False: "**missed**", None: "not measured"}[self.met]


@dataclass
class Section:
    name: str
    title: str
    seconds: float = 0.0
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: (file name relative to the output directory, caption)
    plots: list[tuple[str, str]] = field(default_factory=list)
    #: raw figures for latest.json (plain data)
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# --------------------------------------------------------------------------- clocks and statistics


class Progress:
    """Progress lines on stderr, stamped with the seconds since the run began."""

    def __init__(self, stream: Any = None) -> None:
        self._start = time.monotonic()
        self._stream = stream

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self._start:6.1f} s] {message}", file=self._stream or sys.stderr, flush=True)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start


def timed(call: Callable[[Any], Any], request: Any, n: int, into: list[int] | None) -> None:
    """``n`` calls of ``call(request)``, each timed with ``perf_counter_ns`` into ``into`` (None: warm-up)."""
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        result = call(request)
        stop = clock()
        if into is not None:
            into.append(stop - start)
        del result  # a local result is a view of a rank's arena: drop it before the next call


def p50(samples: Iterable[float]) -> float:
    return statistics.median(samples)


def p99(samples: Iterable[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def fmt_us(ns: float) -> str:
    return f"{ns / 1e3:.1f}" if ns < 100e3 else f"{ns / 1e3:,.0f}"


def fmt_ms(ns: float) -> str:
    ms = ns / 1e6
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:,.0f}"


def fmt_s(seconds: float) -> str:
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.1f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "n/a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free (an engine with 2 replicas rendezvouses on base_port + i)."""
    for _ in range(50):
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


# --------------------------------------------------------------------------- the machine


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the report states about where it ran (call at the start; ``load_end`` is added at the end)."""
    import msgpack
    import psutil
    import zmq

    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "memory_available_gib": round(psutil.virtual_memory().available / 2**30, 1),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = (", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
                        if torch.cuda.is_available() else "none")
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = "not installed"
    from importlib import metadata

    for name in ("numpy", "ray", "websockets", "transformers", "matplotlib"):
        try:  # the installed version, without importing (ray takes seconds to import)
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = "not installed"
    return info


# --------------------------------------------------------------------------- child processes


def exit_with_parent() -> None:
    """In a spawned child: exit when the benchmark dies, however it died (EOF on the parent's sentinel)."""
    import multiprocessing
    import multiprocessing.connection
    import threading

    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch() -> None:
            multiprocessing.connection.wait([parent.sentinel])
            os._exit(70)

        threading.Thread(target=watch, name="bench-death-watch", daemon=True).start()


def join_or_kill(process: Any, timeout: float = 10.0) -> None:
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)


@dataclass
class RunContext:
    """What every section gets from ``python -m bench``."""

    quick: bool
    progress: Progress
    #: a private (0700) temporary directory: sockets, run directories, model files
    workdir: str
    out_dir: str
    #: pids of this run's processes (for the /dev/shm leftovers check)
    pids: set[int] = field(default_factory=set)

    def mp(self) -> Any:
        import multiprocessing

        return multiprocessing.get_context("spawn")


def run_alone(prefix: str, body: Callable[[str, str, set[int], contextlib.ExitStack], str]) -> int:
    """The shell of a benchmark run alone (not a section): ``body(workdir, logdir, pids, stack)``
    returns its Markdown report; ``workdir`` (mode 0700: ipc:// sockets) and ``logdir`` (servers'
    logs) are private temporary directories, removed after; ``stack`` closes what ``body``
    started. Prints the report and what was left behind; 1 if anything was, else 0."""
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix=prefix)
    logdir = tempfile.mkdtemp(prefix=prefix + "logs-")
    pids = {os.getpid()}
    try:
        with contextlib.ExitStack() as stack:
            report = body(workdir, logdir, pids, stack)
    finally:
        left = leftovers(workdir, pids)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(logdir, ignore_errors=True)
    print(report + "\n\n## Cleanup\n\n" + ("nothing left behind" if not left else "WARNING, left behind: "
                                           + "; ".join(left)))
    return 1 if left else 0


def leftovers(workdir: str, pids: set[int]) -> list[str]:
    """What a run left behind: child processes (then killed), /dev/shm names of ``pids``, files in
    ``workdir`` (torch's own compile cache, which torch puts in the temporary directory, aside)."""
    import re

    import psutil

    def tracker(proc: Any) -> bool:  # multiprocessing's helper: it exits with this interpreter
        try:
            return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
        except psutil.Error:
            return False

    found = []
    children = [p for p in psutil.Process().children(recursive=True) if not tracker(p)]
    _, alive = psutil.wait_procs(children, timeout=5)
    for proc in alive:
        found.append(f"child process {proc.pid} ({' '.join(proc.cmdline()[:3])}) still running (killed now)")
        with contextlib.suppress(psutil.Error):
            proc.kill()
    shm_name = re.compile(r"phyrt-[0-9a-f]+-([0-9]+)-[0-9]+")
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir("/dev/shm")):
            match = shm_name.fullmatch(name)
            if match and int(match.group(1)) in pids:
                found.append(f"/dev/shm/{name}")
    for name in sorted(os.listdir(workdir)):
        if not name.startswith("torchinductor_"):
            found.append(os.path.join(workdir, name))
    return found
