"""Section "batching": dynamic batching and request priority of ``python -m runtime.launch`` (issue 34).

    N client processes (a pool, spawned once)                 server processes (inline, CPU)
    Client.call in closed loops  =======================>    --plugin bench.plugins:FixedCost  --max-batch-size 1
                                 =======================>    --plugin bench.plugins:FixedCost  --max-batch-size 16
                                                                                               --max-batch-delay-ms 2
                                 =======================>    --plugin policy, the same two settings
    8 low-priority loops + one client at 100 Hz ========>    FixedCost, batching off: priority 10 against 0

``bench.plugins:FixedCost`` models an accelerator kernel: each forward sleeps 10 ms + 0.2 ms per
sample, wall time with little CPU, so that batching shows what it saves on a device even on a
2-core machine. The ``policy`` demo is a small MLP on the CPU: there a batch saves little, and its
rows show what the batch delay costs. Every load runs in the client processes of one pool
(spawned once: on 2 cores a spawn costs about a second), each with its own ``Client``, started
together at one ``time.monotonic`` instant (system-wide on Linux). This module's top level
imports no torch, so the pool starts fast.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import sys
import time
import traceback
from array import array
from typing import Any

from bench import serving as sv
from bench.common import RunContext, Section, Table, Target, exit_with_parent, fmt_ms, join_or_kill, p50, p99

MAX_BATCH, MAX_DELAY_MS = 16, 2.0
CLIENT_COUNTS = (1, 8, 16)
#: the priority table: low-priority loops that saturate the server, the high-priority client's period
LOW_CLIENTS, HIGH_PERIOD_S, HIGH_PRIORITY = 8, 0.010, 10
#: issue 34's targets
TARGET_BATCH_SPEEDUP = 3.0
TARGET_PRIORITY_VS_IDLE = 3.0
TARGET_PRIORITY_VS_OFF = 3.0
FIXED = "bench.plugins:FixedCost"
PLUGINS = {"FixedCost": FIXED, "policy": "policy"}
MODES = {"off": ["--max-batch-size", "1"],
         "on": ["--max-batch-size", str(MAX_BATCH), "--max-batch-delay-ms", f"{MAX_DELAY_MS:g}"]}
REPLY_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------- servers


class BatchServer(sv.LaunchedServer):
    """``python -m runtime.launch --plugin PLUGIN --device cpu`` with ``extra`` arguments (the
    batching flags), and ``--metrics-port 0`` where prometheus-client is installed: ``metrics``
    is then the page's URL (else None). ``pids`` and ``close`` are ``LaunchedServer``'s."""

    def __init__(self, address: str, log_dir: str, name: str, plugin: str, extra: list[str]) -> None:
        try:
            import prometheus_client  # noqa: F401 - only whether the server can serve its metrics
            metrics = ["--metrics-port", "0"]
        except ImportError:
            metrics = []
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "--plugin", plugin, "--device", "cpu",
                                      "--address", address, "--log-level", "warning", *extra, *metrics],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        fields = self._ready_fields()
        self.address, self.metrics = fields["address"], fields.get("metrics")

    def batch_counts(self) -> tuple[float, float]:
        """(batches, requests in them) so far, from the ``phyrt_batch_size`` histogram; (0, 0) without it."""
        if not self.metrics:
            return 0.0, 0.0
        import urllib.request

        with urllib.request.urlopen(self.metrics, timeout=10) as page:
            text = page.read().decode()
        found = {"phyrt_batch_size_count": 0.0, "phyrt_batch_size_sum": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return found["phyrt_batch_size_count"], found["phyrt_batch_size_sum"]


def _start_servers(ctx: RunContext, stack: contextlib.ExitStack, logdir: str) -> dict[tuple[str, str], BatchServer]:
    """The four servers (plugin x batching off/on), started at once; each stopped by ``stack``."""
    specs = [(name, mode) for name in PLUGINS for mode in MODES]
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        starting = {spec: pool.submit(BatchServer, f"ipc://{ctx.workdir}/batching-{spec[0]}-{spec[1]}.sock", logdir,
                                      f"batching-{spec[0]}-{spec[1]}", PLUGINS[spec[0]], MODES[spec[1]])
                    for spec in specs}
        concurrent.futures.wait(starting.values())
    for future in starting.values():  # every server that started is stopped, whatever else failed
        if future.exception() is None:
            stack.callback(future.result().close)
    servers = {spec: future.result() for spec, future in starting.items()}  # raises a start failure
    for server in servers.values():
        ctx.pids.update(server.pids())
    return servers


# --------------------------------------------------------------------------- client processes


def _loop(client: Any, request: dict, start: float, duration_s: float, priority: int, period_s: float) -> array:
    """Calls from ``start`` (``time.monotonic``) for ``duration_s``: back to back (``period_s`` 0), or
    one every ``period_s`` (at once when the previous answer came later); latencies in ns."""
    samples = array("q")
    clock = time.perf_counter_ns
    delay = start - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    end, due = start + duration_s, start
    while time.monotonic() < end:
        if period_s:
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            due = max(due + period_s, time.monotonic())
        sent = clock()
        client.call(request, timeout=REPLY_TIMEOUT_S, priority=priority)
        samples.append(clock() - sent)
    return samples


def _client_worker(conn: Any) -> None:
    """One pool process: per job (address, duration, priority, period), a new ``Client``, 2 warm-up
    calls, "ready"; then, on ("go", start), the loop; sends back ("done", latencies as bytes) or
    ("error", traceback). ``None`` ends it."""
    import numpy as np

    from runtime.client import Client

    exit_with_parent()
    request = {"obs": np.ones((1, 32), np.float32)}
    while (job := conn.recv()) is not None:
        address, duration_s, priority, period_s = job
        try:
            with contextlib.closing(Client(address)) as client:
                for _ in range(2):
                    client.call(request, timeout=REPLY_TIMEOUT_S)
                conn.send(("ready", None))
                _, start = conn.recv()
                samples = _loop(client, request, start, duration_s, priority, period_s)
            conn.send(("done", samples.tobytes()))
        except Exception:  # noqa: BLE001 - the parent raises it
            conn.send(("error", traceback.format_exc(limit=6)))


class ClientPool:
    """``size`` spawned client processes; ``load`` runs jobs on the first of them at one instant."""

    def __init__(self, ctx: RunContext, size: int) -> None:
        mp = ctx.mp()
        self.procs, self.pipes = [], []
        try:
            for i in range(size):
                here, there = mp.Pipe()
                proc = mp.Process(target=_client_worker, args=(there,), name=f"bench-batching-{i}", daemon=True)
                proc.start()
                there.close()
                ctx.pids.add(proc.pid)
                self.procs.append(proc)
                self.pipes.append(here)
        except BaseException:
            self.close()
            raise

    def _answer(self, i: int, timeout: float) -> Any:
        if not self.pipes[i].poll(timeout):
            raise RuntimeError(f"{self.procs[i].name} did not answer in {timeout:g} s (exit code "
                               f"{self.procs[i].exitcode})")
        kind, value = self.pipes[i].recv()
        if kind == "error":
            raise RuntimeError(f"{self.procs[i].name} failed:\n{value}")
        return value

    def load(self, jobs: list[tuple[str, float, int, float]]) -> list[array]:
        """Each job (address, seconds, priority, period) on a process of its own, started together;
        each job's latencies (ns)."""
        for pipe, job in zip(self.pipes, jobs):
            pipe.send(job)
        for i in range(len(jobs)):
            self._answer(i, 120)
        start = time.monotonic() + 0.05
        for pipe in self.pipes[:len(jobs)]:
            pipe.send(("go", start))
        out = []
        for i, job in enumerate(jobs):
            chunk = array("q")
            chunk.frombytes(self._answer(i, job[1] + 120))
            out.append(chunk)
        return out

    def close(self) -> None:
        for pipe in self.pipes:  # None ends an idle process; a closed pipe one in the middle of a job
            with contextlib.suppress(OSError):
                pipe.send(None)
            pipe.close()
        for proc in self.procs:
            join_or_kill(proc, 10)


# --------------------------------------------------------------------------- measurements


def _throughput(ctx: RunContext, pool: ClientPool, servers: dict, rounds: int, load_s: float) -> dict:
    """{(plugin, clients, mode): [(requests/s, latencies, mean batch or None) per round]}; within a
    round the two modes take turns at each count, so drift lands on both alike."""
    out: dict[tuple[str, int, str], list] = {}
    for r in range(rounds):
        for name in PLUGINS:
            for clients in CLIENT_COUNTS:
                for mode in MODES:
                    ctx.progress(f"batching: round {r + 1}/{rounds}, {name}, batching {mode}, {clients} client "
                                 f"process(es), {load_s:g} s")
                    server = servers[(name, mode)]
                    before = server.batch_counts()
                    lats = pool.load([(server.address, load_s, 0, 0.0)] * clients)
                    after = server.batch_counts()
                    batches, batched = after[0] - before[0], after[1] - before[1]
                    calls = sum(len(x) for x in lats)
                    out.setdefault((name, clients, mode), []).append(
                        (calls / load_s, [v for x in lats for v in x], batched / batches if batches else None))
    return out


def _priority(ctx: RunContext, pool: ClientPool, server: BatchServer, rounds: int, seconds: float) -> dict:
    """{case: [(high-priority latencies, low-priority requests/s) per round]}: "idle", "on", "off"."""
    cases = {"idle": (0, HIGH_PRIORITY), "on": (LOW_CLIENTS, HIGH_PRIORITY), "off": (LOW_CLIENTS, 0)}
    out: dict[str, list] = {}
    for r in range(rounds):
        for case, (low, priority) in cases.items():
            ctx.progress(f"batching: priority, round {r + 1}/{rounds}, {case}: {low} low-priority loop(s), one "
                         f"client at {1 / HIGH_PERIOD_S:g} Hz with priority={priority}, {seconds:g} s")
            jobs = [(server.address, seconds, priority, HIGH_PERIOD_S)] + [(server.address, seconds, 0, 0.0)] * low
            lats = pool.load(jobs)
            out.setdefault(case, []).append((lats[0], sum(len(x) for x in lats[1:]) / seconds))
    return out


def run(ctx: RunContext) -> Section:
    section = Section("batching", "Dynamic batching and request priority: requests/s and latency")
    rounds = 1 if ctx.quick else 3
    load_s, priority_s = (1.0, 2.0) if ctx.quick else (1.5, 3.0)
    logdir = os.path.join(ctx.workdir, "batching-logs")
    os.makedirs(logdir, exist_ok=True)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, logdir, True)  # runs last: after every server closed its log
        ctx.progress("batching: starting 4 servers (FixedCost and policy, batching off and on) and "
                     f"{max(CLIENT_COUNTS)} client processes")
        servers = _start_servers(ctx, stack, logdir)
        pool = ClientPool(ctx, max(max(CLIENT_COUNTS), LOW_CLIENTS + 1))
        stack.callback(pool.close)  # runs before the servers stop
        loads = _throughput(ctx, pool, servers, rounds, load_s)
        prio = _priority(ctx, pool, servers[("FixedCost", "off")], rounds, priority_s)
        ctx.progress("batching: stopping servers and clients")
    _report(section, loads, prio, rounds, load_s, priority_s)
    return section


# --------------------------------------------------------------------------- report


def _throughput_table(loads: dict, rounds: int, load_s: float) -> Table:
    rows = []
    for (name, clients, mode), runs in loads.items():
        rate = p50([r[0] for r in runs])
        lat = [v for r in runs for v in r[1]]
        sizes = [r[2] for r in runs if r[2] is not None]
        off = p50([r[0] for r in loads[(name, clients, "off")]])
        rows.append([name, mode, str(clients), f"{rate:,.0f}", f"{rate / off:.2f}×", fmt_ms(p50(lat)),
                     fmt_ms(p99(lat)), f"{p50(sizes):.1f}" if sizes else "—"])
    return Table(
        "Throughput, batching off and on, N client processes",
        ["plugin", "batching", "processes", "requests/s", "/ off", "p50 ms", "p99 ms", "mean batch"], rows,
        [f"Servers: `python -m runtime.launch --plugin {FIXED}` (a 10 ms + 0.2 ms/sample sleep per forward: an "
         "accelerator kernel's wall time, little CPU) and `--plugin policy` (its default MLP on the CPU), each "
         f"`--device cpu` (inline), batching off (`--max-batch-size 1`) and on (`--max-batch-size {MAX_BATCH} "
         f"--max-batch-delay-ms {MAX_DELAY_MS:g}`). Requests `{{\"obs\": float32 [1, 32]}}`. N spawned client "
         f"processes, each its own `Client` (2 warm-up calls), run closed loops of `Client.call` for {load_s:g} s, "
         "started together: requests/s = calls completed / the loop time. "
         f"{rounds} round(s); in each, off and on take turns at every N. requests/s: median of the rounds; "
         "latency percentiles over all the rounds' calls; mean batch: requests per runner batch (the server's "
         "`phyrt_batch_size` histogram, across the load, a request the idle runner took at once counting as a "
         "batch of one), median of the rounds."])


def _priority_table(prio: dict, rounds: int, seconds: float) -> Table:
    labels = {"idle": f"idle server, priority={HIGH_PRIORITY}",
              "on": f"{LOW_CLIENTS} low-priority loops, priority={HIGH_PRIORITY} (priority on)",
              "off": f"{LOW_CLIENTS} low-priority loops, priority=0 (priority off)"}
    rows = []
    for case, runs in prio.items():
        lat = [v for r in runs for v in r[0]]
        low = p50([r[1] for r in runs]) if case != "idle" else None
        rows.append([labels[case], fmt_ms(p50(lat)), fmt_ms(p99(lat)), str(len(lat)),
                     f"{low:,.0f}" if low is not None else "—"])
    return Table(
        "Priority: one client at 100 Hz against a saturated server",
        ["high-priority client", "p50 ms", "p99 ms", "calls", "low-priority requests/s"], rows,
        [f"Server: `--plugin {FIXED} --device cpu`, batching off. {LOW_CLIENTS} client processes call in closed "
         "loops with priority 0 (the server's queue is never empty); one more calls once every "
         f"{HIGH_PERIOD_S * 1e3:g} ms (at once when its previous answer came later) with `priority=` as in the "
         f"row. {seconds:g} s per case, {rounds} round(s), the cases taking turns; percentiles over all the "
         "rounds' calls of the 100 Hz client. A replica never preempts a running request: a high-priority "
         "request waits for the running one, then runs next."])


def _targets(loads: dict, prio: dict) -> list[Target]:
    top = max(CLIENT_COUNTS)
    speedups = [on[0] / off[0] for on, off in zip(loads[("FixedCost", top, "on")], loads[("FixedCost", top, "off")])]
    one_off = p50([v for r in loads[("FixedCost", 1, "off")] for v in r[1]])
    one_on = p50([v for r in loads[("FixedCost", 1, "on")] for v in r[1]])
    bound = one_off * 1.1 + MAX_DELAY_MS * 1e6
    idle, on, off = (p99([v for r in prio[case] for v in r[0]]) for case in ("idle", "on", "off"))
    each = ", ".join(f"{s:.2f}×" for s in speedups)
    return [
        Target(f"FixedCost, {top} client processes: batching on ≥ {TARGET_BATCH_SPEEDUP:g}× the requests/s of off",
               f"{p50(speedups):.2f}× (median of {each}, each round's on / off)",
               p50(speedups) >= TARGET_BATCH_SPEEDUP),
        Target(f"FixedCost, 1 client: p50 with batching on ≤ p50 off + {MAX_DELAY_MS:g} ms (max delay) + 10 % of "
               "p50 off", f"{fmt_ms(one_on)} ms against ≤ {fmt_ms(bound)} ms (p50 off {fmt_ms(one_off)} ms)",
               one_on <= bound),
        Target(f"high-priority p99 under saturation (priority on) ≤ {TARGET_PRIORITY_VS_IDLE:g}× its p99 on the "
               "idle server", f"{on / idle:.2f}× ({fmt_ms(on)} ms / {fmt_ms(idle)} ms)",
               on <= TARGET_PRIORITY_VS_IDLE * idle),
        Target(f"high-priority p99 under saturation: priority on ≥ {TARGET_PRIORITY_VS_OFF:g}× lower than off",
               f"{off / on:.2f}× ({fmt_ms(off)} ms / {fmt_ms(on)} ms)", off >= TARGET_PRIORITY_VS_OFF * on),
    ]


def _report(section: Section, loads: dict, prio: dict, rounds: int, load_s: float, priority_s: float) -> None:
    section.tables += [_throughput_table(loads, rounds, load_s), _priority_table(prio, rounds, priority_s)]
    section.targets += _targets(loads, prio)
    section.data = {
        "throughput": [{"plugin": name, "clients": clients, "batching": mode,
                        "requests_per_s": [r[0] for r in runs], "mean_batch": [r[2] for r in runs],
                        "p50_ns": p50([v for r in runs for v in r[1]]), "p99_ns": p99([v for r in runs for v in r[1]])}
                       for (name, clients, mode), runs in loads.items()],
        "priority": {case: {"p50_ns": p50([v for r in runs for v in r[0]]),
                            "p99_ns": p99([v for r in runs for v in r[0]]),
                            "low_requests_per_s": [r[1] for r in runs]} for case, runs in prio.items()},
    }
