"""Sections "scaling" (throughput against replicas) and "lifecycle" (start-up time, failure detection).

scaling     ``bench.plugins:BenchProbe`` "work" requests (a fixed number of 256 x 256 float32
            matmuls, one torch thread per rank) through local engines of 1 and 2 one-rank
            replicas, with a window of requests in flight; next to the same work done
            right here on one thread (no runtime at all)
lifecycle   start-up: ``Engine(...)`` construct to the first ``step`` answered, for one
            2-rank (tp=2, gloo) local replica, against a bare ``torch.multiprocessing``
            spawn of 2 ranks that ``init_process_group("gloo")``, all-reduce once and report
            to the parent; each engine is then used for one failure: a rank is SIGKILLed
            (or SIGSTOPped) while a request is surely inside the plugin, and the clock runs
            from the signal to the moment the request's future fails

The top level imports no torch: ``torch.multiprocessing`` children re-import this
module to find ``_bare_rank``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from bench.common import (RunContext, Section, Table, Target, fmt_ms, fmt_s, free_port, p50, ratio)

PLUGIN = "bench.plugins:BenchProbe"
#: matmuls per "work" request (about 10-20 ms on one idle thread of a 2020s x86 core)
WORK_N = 48
TARGET_SCALING = 1.8
TARGET_STARTUP_RATIO = 1.3
TARGET_KILL_S = 0.100
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.0
TARGET_STOP_SLACK_S = 0.100
FAIL_WAIT_S = 30.0


# --------------------------------------------------------------------------- scaling


def _closed_loop(submit: Any, n: int, window: int, served_by: dict[int, int] | None = None) -> float:
    """Requests per second of ``n`` requests with at most ``window`` in flight; counts per rank pid
    into ``served_by``."""
    from collections import deque

    request = {"op": "work", "n": WORK_N}
    in_flight: deque = deque()
    start = time.perf_counter()
    sent = 0
    while sent < n or in_flight:
        while sent < n and len(in_flight) < window:
            in_flight.append(submit(request))
            sent += 1
        pid = in_flight.popleft().result(FAIL_WAIT_S)["pid"]
        if served_by is not None:
            served_by[pid] = served_by.get(pid, 0) + 1
    return n / (time.perf_counter() - start)


def _bare_rate(n: int) -> float:
    """The same work right here, on one torch thread, without any runtime."""
    import torch

    from bench.plugins import BenchProbeRunner

    saved = torch.get_num_threads()
    runner = BenchProbeRunner(None, {"threads": 1})
    try:
        request = {"op": "work", "n": WORK_N}
        runner.execute(request)
        start = time.perf_counter()
        for _ in range(n):
            runner.execute(request)
        return n / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)


_POOL_RUNNER: Any = None


def _pool_work(request: dict) -> dict:
    """In a ProcessPoolExecutor worker: the plugin's work, on one torch thread, without any runtime."""
    global _POOL_RUNNER
    if _POOL_RUNNER is None:
        from bench.plugins import BenchProbeRunner

        _POOL_RUNNER = BenchProbeRunner(None, {"threads": 1})
    return _POOL_RUNNER.execute(request)


def run_scaling(ctx: RunContext) -> Section:
    from runtime.core.config import DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig
    from runtime.engine import Engine

    section = Section("scaling", "Throughput against replicas (compute-bound plugin)")
    rounds, n, window = (2, 30, 4) if ctx.quick else (5, 150, 4)
    args = EngineArgs(PLUGIN, {"threads": 1}, EngineConfig(device=DeviceConfig(target="cpu")))
    rates: dict[str, list[float]] = {"bare": [], "pool1": [], "pool2": [], "1": [], "2": []}
    served: dict[str, dict[int, int]] = {"pool1": {}, "pool2": {}, "1": {}, "2": {}}
    with contextlib.ExitStack() as stack:
        import concurrent.futures

        import psutil

        engines = {}
        for replicas in (1, 2):
            ctx.progress(f"scaling: starting a local engine of {replicas} one-rank replica(s), and a process pool "
                         f"of {replicas}")
            engines[str(replicas)] = stack.enter_context(
                Engine(args, DeploymentConfig.local(replica_count=replicas))).submit
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(replicas, mp_context=ctx.mp()))
            engines[f"pool{replicas}"] = lambda request, pool=pool: pool.submit(_pool_work, request)
        ctx.pids.update(p.pid for p in psutil.Process().children(recursive=True))
        for key, submit in engines.items():  # warm-up: every replica and worker runs the work
            _closed_loop(submit, 4 * window, window)
        for r in range(rounds):
            ctx.progress(f"scaling: round {r + 1}/{rounds}: {n} requests each on 1 and 2 replicas, 1 and 2 pool "
                         "processes, and right here")
            for key in ("pool1", "1", "pool2", "2"):
                rates[key].append(_closed_loop(engines[key], n, window, served[key]))
            rates["bare"].append(_bare_rate(max(10, n // 4)))
    med = {k: p50(v) for k, v in rates.items()}
    speedup = med["2"] / med["1"]
    machine_speedup = med["pool2"] / med["pool1"]
    section.data = {"rates": rates, "median": med, "work_n": WORK_N, "rounds": rounds, "n": n, "window": window,
                    "requests_per_rank": {k: sorted(v.values()) for k, v in served.items()}}
    names = {"pool1": "bare pool of 1", "pool2": "bare pool of 2", "1": "1 replica", "2": "2 replicas"}
    for key, want in (("2", 2), ("pool2", 2)):
        if len(served[key]) != want:
            section.notes.append(f"{names[key]}: the requests ran on {len(served[key])} process(es), not {want}")
    rows = [["this process, 1 torch thread, no runtime", "-", f"{med['bare']:.1f}", f"{1e3 / med['bare']:.1f}",
             "-", "-"]]
    for key, label in (("pool1", "bare process pool (baseline), 1 process"),
                       ("pool2", "bare process pool (baseline), 2 processes"),
                       ("1", "phyrt local, 1 one-rank replica"), ("2", "phyrt local, 2 one-rank replicas")):
        one = "pool1" if key.startswith("pool") else "1"
        rows.append([label, key[-1], f"{med[key]:.1f}", f"{1e3 / med[key]:.1f}", ratio(med[key], med[one]),
                     ratio(med[key], med["pool" + key[-1]])])
    section.tables.append(Table(
        "Requests per second against replicas", ["path", "processes", "requests/s (median of rounds)",
                                                 "ms of wall time per request (1 / rate)", "× 1 process of its kind",
                                                 "× bare pool of as many processes"], rows,
        [f"Plugin `{PLUGIN}`, request `{{\"op\": \"work\", \"n\": {WORK_N}}}`: {WORK_N} products of two "
         "256 × 256 float32 matrices (each followed by tanh) on the rank's one torch thread "
         "(`torch.set_num_threads(1)` in the plugin's build). Engines: `DeploymentConfig.local(replica_count=1 "
         "or 2)`, CPU, both started before any timing and warmed up (every replica runs the work). Each round: "
         f"{n} requests per engine in a closed loop with {window} in flight (`engine.submit`; the dispatcher "
         f"sends each to the replica with the fewest in flight), rate = {n} / wall time; {rounds} rounds, "
         "paths interleaved within each round; the table gives the median of rounds. Baseline, in each round "
         "too: the same closed loop on a `concurrent.futures.ProcessPoolExecutor` of 1 and of 2 spawned "
         "processes that run the plugin's runner on one torch thread each (no phyrt; what the machine itself "
         "gives for 2 processes at that moment), and "
         f"{max(10, n // 4)} requests executed right here on one thread.",
         "Requests served per process over the timed rounds (to show both replicas and both pool processes "
         "worked): " + "; ".join(f"{names[k]}: {sorted(v.values())}" for k, v in served.items())]))
    section.targets.append(Target(f"2 replicas ≥ {TARGET_SCALING:g}× the throughput of 1 (compute-bound, "
                                  "1 thread per rank)",
                                  f"{speedup:.2f}× ({med['2']:.1f} / {med['1']:.1f} requests/s; a bare pool of "
                                  f"2 processes got {machine_speedup:.2f}× in the same rounds)",
                                  speedup >= TARGET_SCALING))
    return section


# --------------------------------------------------------------------------- lifecycle


def _bare_rank(index: int, port: int, queue: Any) -> None:
    """One rank of the bare baseline: gloo process group, one all-reduce, rank 0 reports."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    x = torch.ones(1)
    dist.all_reduce(x)
    if index == 0:
        queue.put(float(x))
    dist.barrier()
    dist.destroy_process_group()


def _bare_start(ctx: RunContext) -> float:
    """Seconds from ``torch.multiprocessing.start_processes`` to rank 0's report (ranks joined after)."""
    import torch.multiprocessing as tmp

    queue = tmp.get_context("spawn").SimpleQueue()
    start = time.perf_counter()
    procs = tmp.start_processes(_bare_rank, args=(free_port(), queue), nprocs=2, join=False, start_method="spawn")
    ctx.pids.update(p.pid for p in procs.processes)
    value = queue.get()
    seconds = time.perf_counter() - start
    deadline = time.monotonic() + FAIL_WAIT_S
    while not procs.join(1.0):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise RuntimeError(f"the bare ranks did not exit within {FAIL_WAIT_S} s of their report")
    if value != 2.0:
        raise RuntimeError(f"the bare ranks all-reduced 1 + 1 to {value}")
    return seconds


def _wait_marks(mark: str, ranks: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    paths = [f"{mark}-{rank}" for rank in range(ranks)]
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sleep request did not reach every rank's plugin in {timeout} s")
        time.sleep(0.001)
    pids = []
    for p in paths:
        with open(p) as f:
            pids.append(int(f.read()))
        os.unlink(p)
    return pids


def _engine_trial(ctx: RunContext, index: int, how: str, victim: int) -> dict[str, Any]:
    """Start a tp=2 engine (timed to its first answer), then fail a rank the way ``how`` says."""
    import psutil

    from runtime.core.config import (DenseParallelConfig, DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig,
                                ParallelConfig, WorkerSupervisorConfig)
    from runtime.engine import Engine
    from runtime.core.errors import EngineUnavailableError

    args = EngineArgs(PLUGIN, None, EngineConfig(device=DeviceConfig(target="cpu"),
                                                 parallel=ParallelConfig(dense=DenseParallelConfig(tp_size=2))))
    deployment = DeploymentConfig.local(process_config=WorkerSupervisorConfig(
        base_port=free_port(), heartbeat_interval_s=HEARTBEAT_INTERVAL_S, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))
    pids: list[int] = []
    start = time.perf_counter()
    engine = Engine(args, deployment)
    try:
        engine.step({"op": "echo", "x": 1}, timeout=FAIL_WAIT_S)
        startup = time.perf_counter() - start
        mark = os.path.join(ctx.workdir, f"mark-{index}")
        future = engine.submit({"op": "sleep", "s": 60.0, "mark": mark})
        pids += _wait_marks(mark, 2, FAIL_WAIT_S)
        ctx.pids.update(pids)
        failed_at: list[float] = []
        future.add_done_callback(lambda f: failed_at.append(time.perf_counter()))
        sig = signal.SIGKILL if how == "sigkill" else signal.SIGSTOP
        signalled = time.perf_counter()
        os.kill(pids[victim], sig)
        error = future.exception(FAIL_WAIT_S + HEARTBEAT_TIMEOUT_S)
        if how == "sigstop":
            os.kill(pids[victim], signal.SIGCONT)  # let the reaper's SIGTERM land at once
        if not isinstance(error, EngineUnavailableError):
            raise RuntimeError(f"{how} of rank {victim}: the future ended with {error!r}, "
                               "not EngineUnavailableError")
        return {"startup_s": startup, "how": how, "victim": victim, "detect_s": failed_at[0] - signalled,
                "message": str(error)}
    finally:
        engine.close()
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
        psutil.wait_procs(procs, timeout=10)  # the next start-up must not share the cores with a dying group


def run_lifecycle(ctx: RunContext) -> Section:
    section = Section("lifecycle", "Engine start-up and failure detection")
    per_way = 2 if ctx.quick else 5
    trials = [(how, victim) for i in range(per_way) for how, victim in
              (("sigkill", 1 - i % 2), ("sigstop", 1 - i % 2))]
    bare: list[float] = []
    results: list[dict[str, Any]] = []
    for i, (how, victim) in enumerate(trials):
        if i % 2 == 0:
            ctx.progress(f"lifecycle: bare torch.multiprocessing spawn + gloo, start {len(bare) + 1}/{per_way}")
            bare.append(_bare_start(ctx))
        ctx.progress(f"lifecycle: engine start {i + 1}/{len(trials)}, then {how.upper()} of rank {victim} "
                     "with a request inside the plugin")
        results.append(_engine_trial(ctx, i, how, victim))
    engine_starts = [r["startup_s"] for r in results]
    kills = [r["detect_s"] for r in results if r["how"] == "sigkill"]
    stops = [r["detect_s"] for r in results if r["how"] == "sigstop"]
    start_ratio = p50(engine_starts) / p50(bare)
    section.data = {"bare_start_s": bare, "trials": results}
    section.tables.append(Table(
        "Start-up to ready, 2 ranks", ["path", "median s", "min s", "max s", "n", "median / bare"],
        [["bare `torch.multiprocessing` spawn + `init_process_group(\"gloo\")` + 1 all-reduce (baseline)",
          fmt_s(p50(bare)), fmt_s(min(bare)), fmt_s(max(bare)), str(len(bare)), "1.00×"],
         ["phyrt `Engine(...)` local, 1 replica tp=2, to the first `step` answered", fmt_s(p50(engine_starts)),
          fmt_s(min(engine_starts)), fmt_s(max(engine_starts)), str(len(engine_starts)),
          f"{start_ratio:.2f}×"]],
        ["phyrt: `time.perf_counter()` from before `Engine(EngineArgs(\"bench.plugins:BenchProbe\", "
         "config=EngineConfig(cpu, dense tp=2)), DeploymentConfig.local(...))` to the return of its first "
         "`engine.step({\"op\": \"echo\"})`: spawning both ranks, importing torch and phyrt there, the gloo "
         "rendezvous, the plugin's build and one request. Baseline: from before "
         "`torch.multiprocessing.start_processes(nprocs=2, start_method=\"spawn\")` to rank 0's report on a "
         "queue after `init_process_group(\"gloo\")` and one `all_reduce` on both ranks. Both spawn fresh "
         "interpreters that re-import this benchmark's main module. Interleaved: one bare start before every "
         "two engine starts; each start waits until the previous one's processes are gone. No warm-up (a "
         "start is a cold start; the OS file cache is warm after the first)."]))
    rows = []
    for how, values, bound in (("SIGKILL", kills, TARGET_KILL_S),
                               ("SIGSTOP", stops, HEARTBEAT_TIMEOUT_S + TARGET_STOP_SLACK_S)):
        rows.append([how, fmt_ms(p50(values) * 1e9), fmt_ms(min(values) * 1e9), fmt_ms(max(values) * 1e9),
                     str(len(values)), fmt_ms(bound * 1e9)])
    section.tables.append(Table(
        "Failure detection: signal to failed future", ["signal to one rank", "median ms", "min ms", "max ms", "n",
                                                       "target ms"], rows,
        ["Each start-up engine above, once it answered, gets `{\"op\": \"sleep\", \"s\": 60}`; every rank "
         "writes its pid to a file from inside the plugin, and once both files exist this process sends the "
         "signal to one rank (rank 1 and rank 0 in turn) and takes `time.perf_counter()`; a done-callback on "
         "the request's future takes the time it fails (it must fail with `EngineUnavailableError`). "
         f"Heartbeats: `WorkerSupervisorConfig(heartbeat_interval_s={HEARTBEAT_INTERVAL_S}, "
         f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S})`, so a stopped rank is noticed only when its heartbeats "
         "lapse. The stopped rank gets SIGCONT once its future failed, so that the reaper's SIGTERM ends it.",
         "Errors as the caller saw them: " + "; ".join(
             f"{r['how']} rank {r['victim']}: \"{r['message'][:160]}\"" for r in results[:2])]))
    section.targets += [
        Target(f"engine start-up (2-rank local replica, to first answer) ≤ {TARGET_STARTUP_RATIO:g}× bare "
               "spawn + gloo init", f"{start_ratio:.2f}× ({fmt_s(p50(engine_starts))} s / {fmt_s(p50(bare))} s)",
               start_ratio <= TARGET_STARTUP_RATIO),
        Target(f"SIGKILL of a rank with a request in flight → future fails, median ≤ {TARGET_KILL_S * 1e3:.0f} ms",
               f"{p50(kills) * 1e3:.1f} ms (max {max(kills) * 1e3:.1f} ms, n={len(kills)})",
               p50(kills) <= TARGET_KILL_S),
        Target(f"SIGSTOP of a rank → future fails, median ≤ heartbeat_timeout_s + {TARGET_STOP_SLACK_S * 1e3:.0f} ms "
               f"({(HEARTBEAT_TIMEOUT_S + TARGET_STOP_SLACK_S) * 1e3:.0f} ms)",
               f"{p50(stops) * 1e3:.0f} ms (max {max(stops) * 1e3:.0f} ms, n={len(stops)})",
               p50(stops) <= HEARTBEAT_TIMEOUT_S + TARGET_STOP_SLACK_S),
    ]
    return section
