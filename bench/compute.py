"""Section "compute": 64 MiB in, a new 64 MiB tensor out, through a plugin that computes.

The latency section's tensor rows echo their request, so the result is the request's own
shared memory. A plugin that computes (``bench.plugins:Double``, ``y = 2 * x``) makes a new
tensor, which the rank must place in its result arena and the caller must map: this is the
case a user has. Each call also reads one float
per 4 KiB page of its result, as a caller that uses the result does. Paths, interleaved call
by call in one process:

    memcpy     one numpy.copyto of 64 MiB into a preallocated array (the unit)
    inline     engine.step on an inline engine (the plugin's own cost: one multiply)
    local      engine.step on a local 1-rank replica (the same multiply in a spawned rank)

Reported: p50/p99 per call, the extra cost of local over inline in memcpys (issue 15's
target: at most 3), and minor page faults per call in the calling process and in the rank
(``getrusage`` here; ``/proc/PID/stat`` for the rank), to see whether fresh mappings cost.
"""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Any

import psutil

from bench.common import RunContext, Section, Table, Target, fmt_ms, p50, p99

MIB = 1 << 20
SIZE_MIB = 64
#: the issue's goal: a computing plugin on a local rank costs at most this many memcpys more than inline
TARGET_EXTRA_MEMCPYS = 3.0
PLUGIN = "bench.plugins:Double"


def _rank_faults(pid: int | None) -> int:
    """Minor page faults of process ``pid`` so far (0 without /proc or a pid)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10: minflt
    except (OSError, IndexError, ValueError):
        return 0


def _own_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _measure(calls: dict[str, Any], rank_pid: int | None, n: int, x: Any) -> dict[str, dict[str, list[float]]]:
    """``n`` timed calls per path, interleaved call by call, with the page faults each took."""
    out = {k: {"ns": [], "faults": [], "rank_faults": []} for k in calls}
    for call in calls.values():  # warm-up: first mappings, arena growth
        for _ in range(2):
            call(x)
    for _ in range(n):
        for key, call in calls.items():
            own, rank = _own_faults(), _rank_faults(rank_pid)
            start = time.perf_counter_ns()
            result = call(x)
            stop = time.perf_counter_ns()
            del result
            out[key]["ns"].append(stop - start)
            out[key]["faults"].append(_own_faults() - own)
            out[key]["rank_faults"].append(_rank_faults(rank_pid) - rank if key == "local" else 0)
    return out


def run(ctx: RunContext) -> Section:
    import numpy as np
    import torch

    from runtime import Engine
    from runtime.core.config import DeploymentConfig, DeviceConfig, EngineArgs, EngineConfig

    section = Section("compute", "A plugin that computes: 64 MiB in, a new 64 MiB tensor out")
    n = 5 if ctx.quick else 20
    x = torch.randn(SIZE_MIB * MIB // 4)
    dst = np.empty_like(x.numpy())
    with contextlib.ExitStack() as stack:
        ctx.progress("compute: starting the engines (inline; local, 1 rank)")
        inline = stack.enter_context(Engine(EngineArgs(plugin=PLUGIN)))
        local = stack.enter_context(Engine(
            EngineArgs(plugin=PLUGIN, config=EngineConfig(device=DeviceConfig(target="cpu"))),
            DeploymentConfig.local(replica_count=1)))
        ranks = psutil.Process().children(recursive=True)
        ctx.pids.update(p.pid for p in ranks)
        rank_pid = next((p.pid for p in ranks if "resource_tracker" not in " ".join(p.cmdline())), None)
        request = {"x": x}
        for engine in (inline, local):
            if not torch.equal(engine.step(request, timeout=120)["y"], x * 2):
                raise RuntimeError("the Double plugin returned a wrong tensor")
        # each call reads one float of every 4 KiB page of its result, as a caller that uses it
        # does: a result in memory mapped afresh would fault here, in this process
        calls = {"memcpy": lambda r: float(np.copyto(dst, r["x"].numpy()) or dst[::1024].sum()),
                 "inline": lambda r: float(inline.step(r, timeout=120)["y"][::1024].sum()),
                 "local": lambda r: float(local.step(r, timeout=120)["y"][::1024].sum())}
        ctx.progress(f"compute: {n} calls per path, interleaved")
        samples = _measure(calls, rank_pid, n, request)
    memcpy, inline_ns, local_ns = (p50(samples[k]["ns"]) for k in ("memcpy", "inline", "local"))
    extra = (local_ns - inline_ns) / memcpy
    labels = {"memcpy": "memcpy (numpy.copyto, one thread)", "inline": "phyrt inline engine",
              "local": "phyrt local engine, 1 rank"}
    rows = [[labels[k], fmt_ms(p50(s["ns"])), fmt_ms(p99(s["ns"])), f"{p50(s['ns']) / memcpy:.2f}",
             f"{p50(s['faults']):,.0f}", f"{p50(s['rank_faults']):,.0f}" if k == "local" else "-", str(len(s["ns"]))]
            for k, s in samples.items()]
    section.tables.append(Table(
        f"{SIZE_MIB} MiB float32 in, y = 2 * x out (bench.plugins:Double)",
        ["path", "p50 ms", "p99 ms", "p50 / memcpy", "minor faults per call (this process)",
         "minor faults per call (rank)", "n"], rows,
        [f"`perf_counter_ns` around `engine.step`; 2 untimed calls per path, then {n} per path interleaved "
         "call by call. Minor faults: `getrusage(RUSAGE_SELF).ru_minflt` around each call here, field 10 of "
         "`/proc/PID/stat` for the rank; medians. A 64 MiB tensor is 16,384 pages of 4 KiB: a path that "
         "touches fresh memory for its result pays about that many faults per call."]))
    section.targets.append(Target(
        f"{SIZE_MIB} MiB in, new {SIZE_MIB} MiB out, local 1-rank ≤ {TARGET_EXTRA_MEMCPYS:g} memcpys more than inline",
        f"{extra:.2f} memcpys (({fmt_ms(local_ns)} − {fmt_ms(inline_ns)}) ms / {fmt_ms(memcpy)} ms)",
        extra <= TARGET_EXTRA_MEMCPYS))
    section.data = {k: {"p50_ns": p50(s["ns"]), "p99_ns": p99(s["ns"]), "faults_p50": p50(s["faults"]),
                        "rank_faults_p50": p50(s["rank_faults"]), "n": len(s["ns"])} for k, s in samples.items()}
    section.data["extra_memcpys"] = extra
    return section
