"""Section "collectives": all-reduce between 2 CPU ranks of this host, shared memory against gloo.

Two spawned ranks (one torch thread each) make a gloo world through a FileStore and
``runtime.parallel.initialize`` it, which gives the world group its shared-memory segment
(``runtime.parallel.shm_collectives``). Then, per size (4 KiB and 4 MiB of float32),
the paths alternate in blocks of calls, back to back on both ranks:

    gloo          ``torch.distributed.all_reduce`` on the world group (loopback TCP)
    shm           ``P.all_reduce(x, "world")``: shared memory, the rank's spin budget
    shm, no spin  the same after re-initializing with ``PHYRT_SPIN_US=0`` (sleeps at once)

Rank 0's time per call is reported (p50, p99). Each path's result is checked against
gloo's on the same input, and the two ranks' results must be bitwise equal. Last, CPU
time of rank 0 while it waits 0.5 s in an all-reduce for a late peer: a busy wait
would burn the whole 0.5 s.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from bench.common import RunContext, Section, Table, fmt_us, p50, p99

SIZES = {"4 KiB": 4 << 10, "4 MiB": 4 << 20}
LATE_S = 0.5


def _timed(call: Any, x: Any, n: int) -> list[int]:
    out = []
    for _ in range(n):
        start = time.perf_counter_ns()
        call(x)
        out.append(time.perf_counter_ns() - start)
    return out


def _paths(P: Any, dist: Any) -> dict[str, Any]:
    return {"gloo": lambda x: dist.all_reduce(x, group=dist.group.WORLD),
            "shm": lambda x: P.all_reduce(x, "world")}


def _measure(P: Any, dist: Any, torch: Any, index: int, quick: bool, keys: tuple[str, ...]) -> dict[str, Any]:
    """Per size and path: rank 0's ns per call; and whether results agreed."""
    import hashlib

    paths = _paths(P, dist)
    out: dict[str, Any] = {}
    for label, nbytes in SIZES.items():
        calls, blocks = (50, 4) if quick else (200, 10)
        if nbytes > 1 << 20:
            calls //= 10
        gen = torch.Generator().manual_seed(index)
        x = torch.randn(nbytes // 4, generator=gen)
        want = x.clone()
        dist.all_reduce(want, group=dist.group.WORLD)
        for key in keys:
            got = paths[key](x.clone()) if key != "gloo" else want
            digest = torch.tensor(list(hashlib.sha256(got.numpy().tobytes()).digest()[:8]), dtype=torch.uint8)
            both = [torch.empty_like(digest) for _ in range(2)]
            dist.all_gather(both, digest)
            out.setdefault(label, {})[key] = {"ns": [], "close": bool(torch.allclose(got, want, rtol=1e-6, atol=1e-6)),
                                              "same_on_both": bool(torch.equal(both[0], both[1]))}
        for _ in range(blocks):
            for key in keys:
                buf = x.clone()
                out[label][key]["ns"] += _timed(paths[key], buf, calls)
    return out


def _late_peer_cpu(P: Any, dist: Any, torch: Any, index: int) -> float:
    """CPU seconds rank 0 spends in an all-reduce that its peer joins ``LATE_S`` late."""
    dist.barrier()
    if index == 1:
        time.sleep(LATE_S)
    cpu = time.process_time()
    P.all_reduce(torch.ones(1024), "world")
    return time.process_time() - cpu


def _rank(index: int, store: str, quick: bool, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from runtime import DenseParallelConfig, ParallelConfig
    from runtime import parallel as P

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=index, world_size=2)
    layout = ParallelConfig(dense=DenseParallelConfig(tp_size=2))
    try:
        P.initialize(layout, index)
        report: dict[str, Any] = {"shm": P.uses_shared_memory("world")}
        report["results"] = _measure(P, dist, torch, index, quick, ("gloo", "shm"))
        report["late_cpu_s"] = _late_peer_cpu(P, dist, torch, index)
        P.destroy()
        os.environ["PHYRT_SPIN_US"] = "0"
        P.initialize(layout, index)
        nospin = _measure(P, dist, torch, index, quick, ("shm",))
        for label, paths in nospin.items():
            report["results"][label]["shm, no spin"] = paths["shm"]
        report["late_cpu_nospin_s"] = _late_peer_cpu(P, dist, torch, index)
        if index == 0:
            queue.put(report)
        dist.barrier()
    finally:
        P.destroy()
        dist.destroy_process_group()


def run(ctx: RunContext) -> Section:
    import torch.multiprocessing as tmp

    section = Section("collectives", "All-reduce between 2 CPU ranks of one host: shared memory against gloo")
    queue = tmp.get_context("spawn").SimpleQueue()
    store = os.path.join(ctx.workdir, "collectives-store")
    ctx.progress("collectives: 2 ranks, gloo against shared memory, 4 KiB and 4 MiB")
    procs = tmp.start_processes(_rank, args=(store, ctx.quick, queue), nprocs=2, join=False, start_method="spawn")
    ctx.pids.update(p.pid for p in procs.processes)
    report = queue.get()
    while not procs.join(30):
        pass
    with contextlib.suppress(FileNotFoundError):  # the last rank's store removes it, unless it died first
        os.unlink(store)
    if not report["shm"]:
        raise RuntimeError("the 2 ranks of this host did not get a shared-memory group")
    rows, data = [], {}
    for label, paths in report["results"].items():
        gloo = p50(paths["gloo"]["ns"])
        for key, res in paths.items():
            ns = res["ns"]
            rows.append([label, key, fmt_us(p50(ns)), fmt_us(p99(ns)), f"{gloo / p50(ns):.1f}x",
                         "yes" if res["close"] else "NO", "yes" if res["same_on_both"] else "NO", str(len(ns))])
            data[f"{label} {key}"] = {"p50_ns": p50(ns), "p99_ns": p99(ns), "n": len(ns)}
    section.tables.append(Table(
        "float32 all-reduce (sum), 2 ranks, rank 0's time per call",
        ["size", "path", "p50 µs", "p99 µs", "gloo p50 / p50", "= gloo's (1e-6)", "bitwise same on both ranks",
         "n"], rows,
        ["Spawned ranks, one torch thread each, calls back to back, the paths alternating in blocks; "
         "`perf_counter_ns` around each call on rank 0. `shm, no spin`: re-initialized with PHYRT_SPIN_US=0. "
         f"CPU time of rank 0 in one all-reduce whose peer came {LATE_S:g} s late: "
         f"{report['late_cpu_s'] * 1e3:.1f} ms with the spin budget, {report['late_cpu_nospin_s'] * 1e3:.1f} ms "
         "without (a busy wait would take the whole wait)."]))
    data["late_cpu_s"], data["late_cpu_nospin_s"] = report["late_cpu_s"], report["late_cpu_nospin_s"]
    section.data = data
    return section
