"""What ``PHYRT_IO_BATCH=1`` buys and costs: ZeroMQ I/O threads as SCHED_BATCH threads, against ordinary ones.

    python -m bench.io_batch [--quick]

    client processes (PHYRT_IO_BATCH=0) ===> python -m runtime.launch (PHYRT_IO_BATCH=0, echo plugin)
    client processes (PHYRT_IO_BATCH=1) ===> python -m runtime.launch (PHYRT_IO_BATCH=1, echo plugin)
    one client here of each, alone, then next to one CPU-bound process per core

Both servers run ``bench.transport:EchoEntry`` inline on ``ipc://``, each with its own
setting, and each is loaded by clients of the same setting (``runtime.transport.zmq_context``
explains the mechanism). Throughput: closed loops in 8 and 24 spawned client processes
(``bench.serving.measure_load``), the two settings taking turns in every round; the ratio
is the median of each round's. Latency: one client of each setting in this process, calls
timed in interleaved blocks, first on an otherwise idle machine, then with a
``while True: pass`` process on every core (a robot's computer busy with other work).
Prints Markdown tables; exit status 1 if a process, a /dev/shm name or a socket file is
left behind. Not a section of ``python -m bench``: run it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from typing import Iterator

from bench import serving as sv
from bench.common import Progress, Table, run_alone
from bench.report import table_lines
from runtime.client import Client

SETTINGS = ("0", "1")
LATENCY_BLOCK = 200


@contextlib.contextmanager
def io_batch(value: str) -> Iterator[None]:
    """``PHYRT_IO_BATCH=value`` in this process (and so in what it starts) within the block."""
    before = os.environ.get("PHYRT_IO_BATCH")
    os.environ["PHYRT_IO_BATCH"] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ["PHYRT_IO_BATCH"]
        else:
            os.environ["PHYRT_IO_BATCH"] = before


def throughput(mp: object, servers: dict, rounds: int, load_s: float, pids: set[int],
               progress: Progress) -> list[list[str]]:
    """Rows: clients, requests/s and CPU per request of each setting (medians), and the ratio."""
    loads: dict[tuple[int, str], list[sv.Load]] = {}
    for r in range(rounds):
        for clients in (8, 24):
            for value in SETTINGS:
                progress(f"round {r + 1}/{rounds}: {clients} client processes, PHYRT_IO_BATCH={value}")
                with io_batch(value):
                    server = servers[value]
                    loads.setdefault((clients, value), []).append(
                        sv.measure_load(mp, "phyrt", server.address, clients, load_s, pids, server.pids()))
    rows = []
    for clients in (8, 24):
        off, on = loads[(clients, "0")], loads[(clients, "1")]
        ratios = [b.rate / a.rate for a, b in zip(off, on)]
        rows.append([str(clients)] + [f"{statistics.median(x.rate for x in runs):,.0f} "
                                      f"({statistics.median(x.client_us for x in runs):.0f} / "
                                      f"{statistics.median(x.server_us for x in runs):.0f})" for runs in (off, on)]
                    + [f"{statistics.median(ratios):.2f}× ({', '.join(f'{x:.2f}' for x in ratios)})"])
    return rows


def latency(clients: dict[str, Client], blocks: int) -> dict[str, list[int]]:
    """Round trips of the small request, in interleaved blocks of ``LATENCY_BLOCK`` per setting."""
    samples: dict[str, list[int]] = {value: [] for value in clients}
    for b in range(blocks):
        for value in SETTINGS if b % 2 == 0 else SETTINGS[::-1]:
            call, into = clients[value].call, samples[value]
            for _ in range(LATENCY_BLOCK):
                start = time.perf_counter_ns()
                call(sv.SMALL_REQUEST, timeout=sv.REPLY_TIMEOUT_S)
                into.append(time.perf_counter_ns() - start)
    return samples


def latency_rows(label: str, samples: dict[str, list[int]]) -> list[list[str]]:
    """p50, p90 and p99 (nearest rank) in µs of each setting's samples."""
    rows = []
    for value, s in samples.items():
        s = sorted(s)
        rows.append([label, value] + [f"{s[min(len(s) - 1, int(q * len(s)))] / 1e3:,.0f}" for q in (0.5, 0.9, 0.99)]
                    + [str(len(s))])
    return rows


def run(args: argparse.Namespace, workdir: str, logdir: str, pids: set[int], stack: contextlib.ExitStack) -> str:
    progress = Progress()
    rounds, load_s, blocks = (1, 2.0, 4) if args.quick else (3, 4.0, 10)
    servers = {}
    for value in SETTINGS:
        with io_batch(value):
            servers[value] = sv.LaunchedServer(f"ipc://{workdir}/batch-{value}.sock", logdir, f"batch-{value}")
        stack.callback(servers[value].close)
        pids |= servers[value].pids()
    mp = multiprocessing.get_context("spawn")
    load_rows = throughput(mp, servers, rounds, load_s, pids, progress)
    clients = {}
    for value in SETTINGS:
        with io_batch(value):
            clients[value] = Client(servers[value].address)
        stack.callback(clients[value].close)
        for _ in range(300):
            clients[value].call(sv.SMALL_REQUEST, timeout=sv.REPLY_TIMEOUT_S)
    progress(f"latency: one client of each setting, {blocks} blocks of {LATENCY_BLOCK} calls, idle machine")
    rows = latency_rows("idle", latency(clients, blocks))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        progress(f"latency: the same next to {len(hogs)} CPU-bound process(es)")
        rows += latency_rows(f"next to {len(hogs)} CPU-bound processes", latency(clients, blocks))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    tables = [
        Table(f"Throughput, small requests ({rounds} rounds of {load_s:g} s loads, the settings taking turns)",
              ["client processes", "PHYRT_IO_BATCH=0: requests/s (client / server CPU µs per request)",
               "PHYRT_IO_BATCH=1: requests/s (client / server CPU µs per request)", "1 / 0 (median of the rounds')"],
              load_rows),
        Table("One caller alone, round trip µs", ["machine", "PHYRT_IO_BATCH", "p50", "p90", "p99", "n"], rows),
    ]
    return "\n".join([
        "# PHYRT_IO_BATCH: ZeroMQ I/O threads as SCHED_BATCH threads (1) against ordinary ones (0)", "",
        f"`python -m bench.io_batch{' --quick' if args.quick else ''}`, {os.cpu_count()} cores, "
        f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.", "",
    ] + [line for table in tables for line in table_lines(table)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.io_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, shorter loads: about a minute")
    args = parser.parse_args(argv)
    return run_alone("phyrt-io-batch-", lambda workdir, logdir, pids, stack: run(args, workdir, logdir, pids, stack))


if __name__ == "__main__":
    sys.exit(main())
