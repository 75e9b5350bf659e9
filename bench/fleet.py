"""Section "fleet": one client over several servers (``Client([address, ...])``), issue 20.

    this process / N client processes                        server processes
    Client(a)            (plain, one server)  ==============> python -m runtime.launch  a (ipc://, echo)
    Client([a])          (routing, one server) =============> a
    Client([a, b])       (routing, two servers) ============> a, b  (each request whole to one)

Both servers serve ``bench.transport:EchoEntry`` inline on the CPU, as in the serving
section. Measured: the small request's round trip from one client here, sequential, the
three clients interleaved call by call (the routing client's own cost per request); and
requests/s from N client processes in closed loops (each process its own client, as
separate robots would be) with each client kind. On 2 cores a second server adds no
CPU: the 2-server row shows what routing costs and how load spreads, not scaling.
This module's top level imports no torch, so spawned client processes start fast.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import time
from array import array
from typing import Any

from bench.common import RunContext, Section, Table, Target, exit_with_parent, fmt_us, p50, p99, ratio

#: the routing client over one server costs at most this much more per sequential round trip
TARGET_ROUTING_P50_RATIO = 1.3
REPLY_TIMEOUT_S = 60.0


def _client(kind: str, addresses: list[str]) -> Any:
    from runtime.client import Client

    return Client(addresses[0]) if kind == "plain" else Client(list(addresses))


def _ready(client: Any, timeout: float = 30.0) -> None:
    """Until every server of a routing client is in its rotation (a plain client: one call)."""
    deadline = time.monotonic() + timeout
    while hasattr(client, "addresses") and time.monotonic() < deadline:
        if all(s["state"] == "up" for s in client.info(timeout=5)["servers"]):
            return
        time.sleep(0.05)


def _load_worker(kind: str, addresses: list[str], duration_s: float, barrier: Any, conn: Any) -> None:
    """One client process: warm up, wait for the others, a closed loop for ``duration_s``;
    sends back (elapsed ns, latencies in ns, requests per server address)."""
    from bench.serving import SMALL_REQUEST

    exit_with_parent()
    client = _client(kind, addresses)
    try:
        _ready(client)
        for _ in range(50):
            client.call(SMALL_REQUEST, timeout=REPLY_TIMEOUT_S)
        barrier.wait(120)
        samples = array("q")
        clock = time.perf_counter_ns
        start = clock()
        end = start + int(duration_s * 1e9)
        while clock() < end:
            sent = clock()
            client.call(SMALL_REQUEST, timeout=REPLY_TIMEOUT_S)
            samples.append(clock() - sent)
        elapsed = clock() - start
        served = ({s["address"]: s["served"] for s in client.info(timeout=5)["servers"]}
                  if hasattr(client, "addresses") else {addresses[0]: len(samples) + 50})
        conn.send((elapsed, samples.tobytes(), served))
    finally:
        client.close()
        conn.close()


def _measure_load(ctx: RunContext, kind: str, addresses: list[str], clients: int,
                  duration_s: float) -> tuple[float, array, dict[str, int]]:
    """requests/s over ``clients`` processes, their latencies, and requests per server."""
    mp = ctx.mp()
    barrier = mp.Barrier(clients + 1)
    pipes, procs = [], []
    try:
        for i in range(clients):
            here, there = mp.Pipe(duplex=False)
            proc = mp.Process(target=_load_worker, args=(kind, addresses, duration_s, barrier, there),
                              name=f"bench-fleet-{kind}-{i}", daemon=True)
            proc.start()
            ctx.pids.add(proc.pid)
            there.close()
            pipes.append(here)
            procs.append(proc)
        barrier.wait(180)
        latencies, elapsed, served = array("q"), [], {}
        for here, proc in zip(pipes, procs):
            if not here.poll(180 + duration_s):
                raise RuntimeError(f"{proc.name} sent no result (exit code {proc.exitcode})")
            took, raw, counts = here.recv()
            elapsed.append(took)
            chunk = array("q")
            chunk.frombytes(raw)
            latencies.extend(chunk)
            for address, n in counts.items():
                served[address] = served.get(address, 0) + n
        return len(latencies) / (max(elapsed) / 1e9), latencies, served
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for here in pipes:
            here.close()


def _sequential(clients: dict[str, Any], n: int, rounds: int = 5) -> dict[str, list[int]]:
    """``n`` round trips per client, interleaved call by call in ``rounds`` rounds."""
    from bench.serving import SMALL_REQUEST

    samples: dict[str, list[int]] = {label: [] for label in clients}
    for client in clients.values():
        for _ in range(100):
            client.call(SMALL_REQUEST, timeout=REPLY_TIMEOUT_S)
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for _ in range(n // rounds):
            for label, client in clients.items():
                start = clock()
                client.call(SMALL_REQUEST, timeout=REPLY_TIMEOUT_S)
                samples[label].append(clock() - start)
    return samples


def run(ctx: RunContext) -> Section:
    from bench import serving as sv

    section = Section("fleet", "One client over several servers: routing cost and requests/s with 1 and 2 servers")
    iters = 1000 if ctx.quick else 5000
    load_s = 1.0 if ctx.quick else 4.0
    counts = (8,) if ctx.quick else (1, 8)
    logdir = os.path.join(ctx.workdir, "fleet-logs")
    os.makedirs(logdir, exist_ok=True)
    kinds = {"plain": "Client(a)", "routing-1": "Client([a])", "routing-2": "Client([a, b])"}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, logdir, True)
        ctx.progress("fleet: starting two phyrt servers (ipc://, echo plugin)")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(sv.LaunchedServer, f"ipc://{ctx.workdir}/fleet-{name}.sock", logdir, f"fleet-{name}")
                        for name in ("a", "b")]
            concurrent.futures.wait(starting)
        for future in starting:
            if future.exception() is None:
                stack.callback(future.result().close)
        a, b = (future.result() for future in starting)
        ctx.pids.update(a.pids() | b.pids())
        servers = {"plain": [a.address], "routing-1": [a.address], "routing-2": [a.address, b.address]}
        here = {}
        for kind, addresses in servers.items():
            here[kind] = client = _client("plain" if kind == "plain" else "routing", addresses)
            stack.callback(client.close)
            _ready(client)
        ctx.progress(f"fleet: sequential small request, {iters} round trips per client, interleaved")
        small = _sequential(here, iters)
        load_rows = []
        for clients in counts:
            for kind, addresses in servers.items():
                ctx.progress(f"fleet: {kinds[kind]}, {clients} client process(es), {load_s:g} s")
                rate, lat, served = _measure_load(ctx, "plain" if kind == "plain" else "routing", addresses,
                                                  clients, load_s)
                share = " / ".join(f"{served.get(x, 0) / max(1, sum(served.values())):.0%}" for x in addresses)
                load_rows.append((kinds[kind], clients, rate, lat, share))
        ctx.progress("fleet: stopping servers and clients")
    _report(section, small, kinds, load_rows, iters, load_s, ctx.quick)
    return section


def _report(section: Section, small: dict[str, list[int]], kinds: dict[str, str], load_rows: list,
            iters: int, load_s: float, quick: bool) -> None:
    base = p50(small["plain"])
    section.tables.append(Table(
        "Small request (~100 B), one client here, sequential",
        ["client", "servers", "p50 µs", "p99 µs", "p50 / plain"],
        [[kinds[k], "2" if k == "routing-2" else "1", fmt_us(p50(s)), fmt_us(p99(s)), ratio(p50(s), base)]
         for k, s in small.items()],
        [f"`time.perf_counter_ns` around one `call`; 100 warm-up calls per client, then {iters} timed calls per "
         "client, interleaved call by call in 5 rounds. Servers: `python -m runtime.launch --plugin "
         "bench.transport:EchoEntry --device cpu` on `ipc://`. a and b are two such servers; `Client([a])` is "
         "the routing client over a alone (its bookkeeping per request: the choice, in-flight counts)."]))
    plain_rate = {c: r for label, c, r, *_ in load_rows if label == kinds["plain"]}
    section.tables.append(Table(
        "Throughput, small requests, N client processes",
        ["client", "processes", "requests/s", "/ plain, same N", "p50 µs", "p99 µs", "share a / b"],
        [[label, str(c), f"{r:,.0f}", ratio(r, plain_rate[c]), fmt_us(p50(lat)), fmt_us(p99(lat)), share]
         for label, c, r, lat, share in load_rows],
        [("--quick: 8 processes only. " if quick else "") +
         f"Closed loops of the small request for {load_s:g} s in N spawned client processes (each its own client, "
         "started together after 50 warm-up calls each): requests/s = all completed / the longest loop. share: "
         "the requests each server answered. On 2 cores the servers and the clients share the CPUs, so a second "
         "server cannot double the rate here; on machines of their own each would add its own."]))
    section.data = {"small_p50_ns": {k: p50(s) for k, s in small.items()},
                    "small_p99_ns": {k: p99(s) for k, s in small.items()},
                    "throughput": [{"client": label, "processes": c, "requests_per_s": r, "share": share}
                                   for label, c, r, lat, share in load_rows]}
    routed = p50(small["routing-1"]) / base
    section.targets.append(Target(
        f"routing client over one server: sequential p50 ≤ {TARGET_ROUTING_P50_RATIO:g}× the plain client's",
        f"{routed:.2f}× ({fmt_us(p50(small['routing-1']))} µs / {fmt_us(base)} µs)",
        routed <= TARGET_ROUTING_P50_RATIO))
