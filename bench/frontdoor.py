"""Section "serving": phyrt's front door (``python -m runtime.launch`` + ``runtime.client.Client``)
next to the servers robot-policy stacks are built from.

    Client ipc:// (shm)     ===> python -m runtime.launch --address ipc://... (echo plugin, inline)
    Client tcp://127.0.0.1  ===> python -m runtime.launch --address tcp://...
    DEALER + msgpack        ===> ROUTER echo                                      floor
    REQ + send_pyobj        ===> REP echo (pickle)                                baseline
    websockets + msgpack-numpy ===> asyncio websockets echo                       peer

The servers, clients, floor, pickle baseline and the measuring loops are
``bench.serving``'s (called, not copied); this module adds the websocket peer and
turns the samples into tables, targets and plot data.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import shutil
from typing import Any

from bench.common import RunContext, Section, Table, Target, fmt_ms, fmt_us, free_port, p50, p99, ratio

#: rounds of the throughput loads (the targets take the median of each round's ratios)
LOAD_ROUNDS = 3


def run(ctx: RunContext) -> Section:
    import numpy as np
    import zmq

    from bench import serving as sv
    from bench.peers import PeerUnavailable, WebsocketPeer

    section = Section("serving", "Serving front door: phyrt server and client against policy-server peers")
    iters = 1000 if ctx.quick else 10000
    warmup = max(50, iters // 10)
    n_image = 20 if ctx.quick else 100
    load_s = 1.0 if ctx.quick else 4.0
    mp = ctx.mp()
    logdir = os.path.join(ctx.workdir, "serving-logs")
    os.makedirs(logdir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, logdir, True)  # runs last: after every server closed its log
        zctx = zmq.Context(1)
        stack.callback(zctx.term)
        ctx.progress("serving: starting the phyrt servers (ipc://, tcp://), the echo servers and the websocket peer")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both servers start at once
            starting = [pool.submit(sv.LaunchedServer, f"ipc://{ctx.workdir}/phyrt.sock", logdir, "phyrt-ipc"),
                        pool.submit(sv.LaunchedServer, f"tcp://127.0.0.1:{free_port()}", logdir, "phyrt-tcp")]
            concurrent.futures.wait(starting)
        for future in starting:  # every server that started is stopped, whatever else failed
            if future.exception() is None:
                stack.callback(future.result().close)
        ipc, tcp = (future.result() for future in starting)  # raises a start failure
        ctx.pids.update(ipc.pids() | tcp.pids())
        floor_address, pickle_address = f"ipc://{ctx.workdir}/sv-msgpack", f"ipc://{ctx.workdir}/sv-pickle"
        procs = [mp.Process(target=sv._msgpack_echo_server, args=(floor_address,), name="bench-msgpack-echo",
                            daemon=True),
                 mp.Process(target=sv._pickle_echo_server, args=(pickle_address,), name="bench-pickle-echo",
                            daemon=True)]
        for proc in procs:
            proc.start()
            stack.callback(sv._join, proc)
            ctx.pids.add(proc.pid)
        for address in (floor_address, pickle_address):
            stack.callback(sv._unlink, address[len("ipc://"):])
        floor = sv.MsgpackEchoPath("bare ZMQ DEALER/ROUTER ipc:// + msgpack (floor)", zctx, floor_address)
        stack.callback(floor.close)
        stack.callback(floor.sock.send, b"")  # runs before close: the stop message
        pickled = sv.PickleReqPath("pickle over ZMQ REQ/REP ipc:// (baseline)", zctx, pickle_address)
        stack.callback(pickled.close)
        stack.callback(pickled.call, None)
        shm = sv.PhyrtPath("phyrt Client ipc:// (shared memory)", ipc.address)
        stack.callback(shm.close)
        phyrt_tcp = sv.PhyrtPath("phyrt Client tcp://127.0.0.1 (frames)", tcp.address)
        stack.callback(phyrt_tcp.close)
        paths = [floor, shm, phyrt_tcp, pickled]
        try:
            ws = WebsocketPeer(mp)
            stack.callback(ws.close)
            paths.append(ws)
        except PeerUnavailable as exc:
            ws = None
            unavailable = f"not available: {exc}"
            section.notes.append(f"{WebsocketPeer.label}: {unavailable}")
        for path in paths:
            path.call(sv.SMALL_REQUEST)
        ctx.progress(f"serving: small request, {warmup} warm-up + {iters} timed round trips per path")
        small = sv.measure_small(paths, iters, warmup, lambda m: ctx.progress(f"serving: {m}"))
        image_paths = [(sv.Memcpy(np.empty(sv.IMAGE_SHAPE, np.uint8)), n_image), (shm, n_image),
                       (phyrt_tcp, n_image), (pickled, n_image // 2)] + ([(ws, n_image // 2)] if ws else [])
        ctx.progress(f"serving: {math.prod(sv.IMAGE_SHAPE) / 2**20:.1f} MiB image, {n_image} round trips per "
                     f"phyrt path, {n_image // 2} for pickle and websocket")
        image = sv.measure_image(image_paths, lambda m: ctx.progress(f"serving: {m}"))
        paths = (("floor", floor.label, floor_address, {procs[0].pid}), ("phyrt", shm.label, ipc.address, ipc.pids()),
                 ("phyrt-no-lane", NO_LANE, ipc.address, ipc.pids()))
        loads = _interleaved_loads(ctx, mp, paths, load_s)
        load_rows = []  # (label, clients, requests/s, latencies, client CPU µs/request, server CPU µs/request)
        for (label, clients), runs in loads.items():
            load_rows.append((label, f"{clients} process{'es' if clients > 1 else ''}", p50([r.rate for r in runs]),
                              [x for r in runs for x in r.latencies], p50([r.client_us for r in runs]),
                              p50([r.server_us for r in runs])))
        ctx.progress(f"serving: throughput, phyrt, 1 client here, one at a time then {sv.PIPELINE_DEPTH} in "
                     f"flight, {load_s:g} s each")
        one_rate = sv.measure_one_at_a_time(shm.client, load_s)
        rate, lat = sv.measure_pipelined(shm.client, load_s)
        load_rows.append((shm.label, "1 here, one at a time (`call`)", one_rate, [], None, None))
        load_rows.append((shm.label, f"1 here, {sv.PIPELINE_DEPTH} in flight (`submit`)", rate, list(lat), None,
                          None))
        ctx.progress("serving: stopping servers and clients")

    image_mib = math.prod(sv.IMAGE_SHAPE) / 2**20
    if ws is None:  # the peer's rows say why it has no figures
        small_rows_extra = [[WebsocketPeer.label, unavailable, "", ""]]
    else:
        small_rows_extra = []
    section.data = {
        "small_p50_ns": {k: p50(v) for k, v in small.items()},
        "small_p99_ns": {k: p99(v) for k, v in small.items()},
        "image_p50_ns": {k: p50(v) for k, v in image.items()},
        "throughput": [{"path": label, "clients": clients, "requests_per_s": rate,
                        "p50_ns": p50(lat) if lat else None, "p99_ns": p99(lat) if lat else None,
                        "client_cpu_us": client_us, "server_cpu_us": server_us}
                       for label, clients, rate, lat, client_us, server_us in load_rows],
    }
    base = p50(small[floor.label])
    section.tables.append(Table(
        "Small request (~100 B), one client, sequential", ["path", "p50 µs", "p99 µs", "p50 / floor"],
        [[label, fmt_us(p50(s)), fmt_us(p99(s)), ratio(p50(s), base)] for label, s in small.items()]
        + small_rows_extra,
        [f"`bench.serving`'s method: `time.perf_counter_ns` around one whole `call` in the client; {warmup} "
         f"warm-up, then {iters} timed round trips per path in {sv.ROUNDS} interleaved rounds. Servers: "
         f"`python -m runtime.launch --plugin {sv.PLUGIN} --device cpu` on `ipc://` and on `tcp://127.0.0.1`, "
         "called with `runtime.client.Client`. Floor: ZMQ DEALER/ROUTER + msgpack echo. Baseline: ZMQ REQ/REP "
         "with `send_pyobj`/`recv_pyobj` (pickle). Peer: an asyncio `websockets` server that decodes and "
         "re-encodes msgpack-numpy, called with the `websockets.sync` client (`bench.peers`)."]))
    pickle_p50 = p50(image[pickled.label])
    rows = []
    for label, s in image.items():
        rows.append([label, fmt_ms(p50(s)), fmt_ms(p99(s)), f"{2 * math.prod(sv.IMAGE_SHAPE) / p50(s):.2f}",
                     ratio(pickle_p50, p50(s)), str(len(s))])
    section.tables.append(Table(
        f"{image_mib:.1f} MiB image (uint8 {list(sv.IMAGE_SHAPE)}), round trip",
        ["path", "p50 ms", "p99 ms", "GB/s (2 × size / p50)", "pickle p50 / this p50", "n"], rows,
        ["`{\"image\": uint8 array}` echoed; checked equal after 3 warm-up calls per path; then round trips "
         "interleaved call by call. phyrt over `ipc://` places the image in shared memory both ways; `tcp://` "
         "sends it as a raw frame; pickle sends it with `send_pyobj`; the websocket peer as msgpack `bin` "
         "(`tobytes`). memcpy: `np.copyto` into a preallocated array, in this process."]))
    section.tables.append(_throughput_table(load_rows, ctx.quick, load_s))
    phyrt, floor_p50 = p50(small[shm.label]), base
    small_ratio = phyrt / floor_p50
    speedup = pickle_p50 / p50(image[shm.label])
    section.targets += [
        Target(f"serving small-request p50 ≤ {sv.TARGET_SMALL_RATIO:g}× bare ZMQ echo (phyrt Client ipc://)",
               f"{small_ratio:.2f}× ({fmt_us(phyrt)} µs / {fmt_us(floor_p50)} µs)",
               small_ratio <= sv.TARGET_SMALL_RATIO),
        Target(f"{image_mib:.0f} MiB same-host image ≥ {sv.TARGET_IMAGE_SPEEDUP:g}× faster than pickle over ZMQ",
               f"{speedup:.1f}× ({fmt_ms(pickle_p50)} ms / {fmt_ms(p50(image[shm.label]))} ms)",
               speedup >= sv.TARGET_IMAGE_SPEEDUP),
    ] + _throughput_targets(load_rows, loads, floor.label, shm.label)
    return section


#: the same client with its plain submits by ZeroMQ, not by the same-host lane (runtime.link.lane)
NO_LANE = "phyrt Client ipc://, PHYRT_LANE=0 (no lane)"


def _interleaved_loads(ctx: RunContext, mp: Any, paths: tuple, load_s: float) -> dict[tuple[str, int], list]:
    """Closed-loop loads of every path at every client count, in ``LOAD_ROUNDS`` rounds (1 with
    --quick); within a round the paths take turns at each count, so that the floor and phyrt
    run minutes apart at most, not a whole section apart (this machine's speed drifts by 2x
    over minutes). The 1-process loads run in the first round only. ``bench.serving.Load``s
    by (label, clients), in the order they ran."""
    from bench import serving as sv

    counts = sv.LOAD_CLIENTS[1:] if ctx.quick else sv.LOAD_CLIENTS
    rounds = 1 if ctx.quick else LOAD_ROUNDS
    loads: dict[tuple[str, int], list] = {}
    for r in range(rounds):
        for clients in counts:
            if clients == 1 and r > 0:
                continue
            for kind, label, address, server_pids in paths:
                ctx.progress(f"serving: throughput, round {r + 1}/{rounds}, {label}, {clients} client process(es), "
                             f"{load_s:g} s")
                load = sv.measure_load(mp, kind, address, clients, load_s, ctx.pids, server_pids)
                loads.setdefault((label, clients), []).append(load)
    return loads


def _us_or_blank(us: float | None) -> str:
    return "" if us is None else f"{us:,.0f}"


def _throughput_table(load_rows: list, quick: bool, load_s: float) -> Table:
    from bench import serving as sv

    return Table(
        "Throughput, small requests",
        ["path", "clients", "requests/s", "p50 µs", "p99 µs", "client CPU µs/request", "server CPU µs/request"],
        [[label, clients, f"{rate:,.0f}", fmt_us(p50(lat)) if lat else "", fmt_us(p99(lat)) if lat else "",
          _us_or_blank(client_us), _us_or_blank(server_us)]
         for label, clients, rate, lat, client_us, server_us in load_rows],
        [("--quick: no 1-process rows. " if quick else "") +
         f"Closed loops of the small request for {load_s:g} s in N spawned client processes (each its own client "
         "and socket, started together after 50 warm-up calls each): requests/s = all completed / the longest "
         f"loop. {LOAD_ROUNDS} rounds (--quick: 1); in each, the floor, phyrt and phyrt without its lane take turns at 8 processes, then at "
         "24 (the 1-process loads run in the first round only); requests/s and CPU per request are medians over "
         "the rounds, latency percentiles over all their calls, and each target's ratio the median of the "
         "rounds' ratios. The no-lane rows: the same client and server with `PHYRT_LANE=0` in the client "
         "processes, whose plain submits and replies then go by ZeroMQ (as before `runtime.link.lane`). "
         "CPU per request: the user + system CPU time the "
         "client processes (all their threads) and the server's processes used during the loops, divided by the "
         "requests completed; on 2 cores their sum bounds the rate. The last two rows: one client in this "
         f"process, first calling one request at a time, then keeping {sv.PIPELINE_DEPTH} `submit` futures in "
         "flight, each for the same time."])


def _throughput_targets(load_rows: list, loads: dict, floor_label: str, phyrt_label: str) -> list[Target]:
    """The targets of issue 15; the load ratios are medians of each round's ratio (``_interleaved_loads``)."""
    from bench import serving as sv

    rate = {(label, clients): r for label, clients, r, *_ in load_rows}
    one, piped = rate[(phyrt_label, "1 here, one at a time (`call`)")], rate[
        (phyrt_label, f"1 here, {sv.PIPELINE_DEPTH} in flight (`submit`)")]
    targets = [Target(f"{sv.PIPELINE_DEPTH} `submit`s in flight ≥ {sv.TARGET_PIPELINED:g}× one at a time, one client",
                      f"{piped / one:.2f}× ({piped:,.0f} / {one:,.0f} requests/s)",
                      piped / one >= sv.TARGET_PIPELINED)]
    floor8, phyrt8, phyrt24 = (loads.get((floor_label, 8)), loads.get((phyrt_label, 8)), loads.get((phyrt_label, 24)))
    if floor8 and phyrt8:
        ratios = [p.rate / f.rate for p, f in zip(phyrt8, floor8)]
        targets.insert(0, Target(
            f"8 client processes ≥ {sv.TARGET_LOAD_VS_FLOOR:g}× the bare ZMQ echo's requests/s with 8",
            f"{p50(ratios):.2f}× (median of {_each(ratios)}, each round's phyrt / floor)",
            p50(ratios) >= sv.TARGET_LOAD_VS_FLOOR))
    if phyrt8:
        cpu = p50([r.client_us + r.server_us for r in phyrt8])
        cut = 1 - cpu / sv.CPU_PER_REQUEST_BEFORE_US
        targets.insert(1, Target(
            f"8 client processes: client + server CPU per request ≥ {sv.TARGET_CPU_CUT:.0%} below a991e40's report "
            f"({sv.CPU_PER_REQUEST_BEFORE_US} µs)",
            f"{cut:.0%} below ({cpu:.0f} µs: median over the rounds of client + server)", cut >= sv.TARGET_CPU_CUT))
    if phyrt8 and phyrt24:
        ratios = [b.rate / a.rate for a, b in zip(phyrt8, phyrt24)]
        targets.insert(1, Target(
            f"24 client processes hold ≥ {sv.TARGET_24_VS_8:g}× the requests/s of 8",
            f"{p50(ratios):.2f}× (median of {_each(ratios)}, each round's 24 / 8)", p50(ratios) >= sv.TARGET_24_VS_8))
    return targets


def _each(ratios: list[float]) -> str:
    return ", ".join(f"{r:.2f}×" for r in ratios)
