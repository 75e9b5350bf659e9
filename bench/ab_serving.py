"""A/B of two checkouts' request paths under load, both loaded at the same moments.

    python -m bench.ab_serving A_ROOT B_ROOT [--rounds 6] [--seconds 5] [--clients 4]

    client processes importing A_ROOT's runtime.client ===> A_ROOT's python -m runtime.launch (echo)
    client processes importing B_ROOT's runtime.client ===> B_ROOT's python -m runtime.launch (echo)
                     all of them released by one start signal, every round

Why: on a shared 2-core VM a server's requests/s swings by +-10 % from one round to the
next (the machine's speed drifts), as much as a whole optimisation step is worth; rounds
that take turns (``bench.serving``) cannot tell such a step from the drift. Here both
checkouts run under the same load at the same time, so the drift lands on both: the table
gives, per round, each side's requests/s and the CPU each side's clients and server spent
per request (user + system, all threads: ``getrusage`` in each client, psutil for the
server), and B / A. Which checkout starts its clients first alternates by round.

Each checkout serves ``bench.transport:EchoEntry`` inline (``--device cpu``) from its own
code (``PYTHONPATH`` = that root) on ``ipc://`` in a private directory; each client is a
``python -c`` process of that checkout calling ``Client.call`` in a closed loop, so any
checkout with ``runtime.client.Client`` and ``bench.transport`` can be compared (a git
worktree of an older commit, say). Run it with this checkout's Python environment. Exit
status 1 if a process or a file of the run is left behind. Not a section of
``python -m bench``: a tool for the one who changes the request path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import statistics
import subprocess
import sys

import psutil

from bench.common import Progress, Table, run_alone
from bench.report import table_lines
from bench.serving import LaunchedServer

START_TIMEOUT_S = 120.0
#: a client process: connects, warms up, says "ready", waits for "go", loops, prints its figures
CLIENT = """
import json, resource, sys, time
from runtime.client import Client
address, seconds = sys.argv[1], float(sys.argv[2])
request = {"task": "pick-cube", "step": 1234, "obs": [0.125 * i for i in range(8)], "done": False}
with Client(address) as client:
    for _ in range(50):
        client.call(request, timeout=60.0)
    print("ready", flush=True)
    sys.stdin.readline()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime
    start = time.perf_counter()
    end, calls = start + seconds, 0
    while time.perf_counter() < end:
        client.call(request, timeout=60.0)
        calls += 1
    elapsed = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"calls": calls, "elapsed": elapsed, "cpu": usage.ru_utime + usage.ru_stime - cpu}), flush=True)
"""


def _env(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": root}


class Side:
    """One checkout: its server, and its client processes of the round under way."""

    def __init__(self, name: str, root: str, workdir: str, logdir: str) -> None:
        self.name, self.root = name, os.path.abspath(root)
        self.server = LaunchedServer(f"ipc://{workdir}/{name}.sock", logdir, name, self.root)
        self.address = self.server.address
        self.clients: list[subprocess.Popen] = []

    def spawn_clients(self, n: int, seconds: float) -> None:
        self.clients = [subprocess.Popen([sys.executable, "-c", CLIENT, self.address, str(seconds)], cwd=self.root,
                                         env=_env(self.root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True) for _ in range(n)]
        for proc in self.clients:
            if _line(proc, START_TIMEOUT_S).strip() != "ready":
                raise RuntimeError(f"a client of {self.root} did not get ready")

    def server_cpu(self) -> float:
        times = psutil.Process(self.server.proc.pid).cpu_times()
        return times.user + times.system

    def results(self, timeout: float) -> dict[str, float]:
        calls = elapsed = cpu = 0.0
        for proc in self.clients:
            out, _ = proc.communicate(timeout=timeout)
            figures = json.loads(out.strip().splitlines()[-1])
            calls += figures["calls"]
            elapsed = max(elapsed, figures["elapsed"])
            cpu += figures["cpu"]
        self.clients = []
        return {"rate": calls / elapsed, "calls": calls, "client_us": cpu / calls * 1e6}

    def close(self) -> None:
        for proc in self.clients:
            proc.kill()
            proc.wait()
        self.server.close()


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` prints, or "" if it prints none within ``timeout`` (then it is killed)."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if selector.select(timeout):
            return proc.stdout.readline()
    proc.kill()
    return ""


def one_round(sides: list[Side], clients: int, seconds: float) -> dict[str, dict[str, float]]:
    """Both sides' clients spawned and warm, released together; each side's figures."""
    for side in sides:
        side.spawn_clients(clients, seconds)
    before = {side.name: side.server_cpu() for side in sides}
    for side in sides:
        for proc in side.clients:
            proc.stdin.write("go\n")
            proc.stdin.flush()
    out = {}
    for side in sides:
        figures = side.results(seconds + 120)
        figures["server_us"] = (side.server_cpu() - before[side.name]) / figures["calls"] * 1e6
        out[side.name] = figures
    return out


def run(args: argparse.Namespace, workdir: str, logdir: str, progress: Progress, stack: contextlib.ExitStack) -> str:
    sides = []
    for name, root in (("A", args.a_root), ("B", args.b_root)):
        progress(f"starting {name}'s server from {root}")
        side = Side(name, root, workdir, logdir)
        stack.callback(side.close)
        sides.append(side)
    rows, ratios = [], []
    for r in range(args.rounds):
        progress(f"round {r + 1}/{args.rounds}: {args.clients} client process(es) a side, {args.seconds:g} s")
        got = one_round(sides if r % 2 == 0 else sides[::-1], args.clients, args.seconds)
        a, b = got["A"], got["B"]
        total = (b["client_us"] + b["server_us"]) / (a["client_us"] + a["server_us"])
        ratios.append((total, b["client_us"] / a["client_us"], b["server_us"] / a["server_us"], b["rate"] / a["rate"]))
        rows.append([r + 1] + [f"{s['rate']:,.0f}" for s in (a, b)] + [f"{s[k]:.1f}" for s in (a, b)
                                                                      for k in ("client_us", "server_us")]
                    + [f"{x:.3f}" for x in ratios[-1]])
    medians = [statistics.median(x[i] for x in ratios) for i in range(4)]
    rows.append(["median", "", "", "", "", "", ""] + [f"**{m:.3f}**" for m in medians])
    table = Table("Both checkouts under the same load",
                  ["round", "A req/s", "B req/s", "A client µs/req", "A server µs/req", "B client µs/req",
                   "B server µs/req", "B/A CPU per request", "B/A client", "B/A server", "B/A req/s"], rows,
                  [f"A = {sides[0].root}, B = {sides[1].root}. Each round: {args.clients} client process(es) a side "
                   f"calling in a closed loop for {args.seconds:g} s, all released together (which side spawns "
                   "first alternates); CPU per request = user + system CPU of a side's clients (or its server) "
                   "over the requests it completed. Read B/A CPU per request first: requests/s also move with how "
                   "the scheduler splits the cores between the two sides."])
    return "\n".join(["# A/B of two checkouts under the same load", ""] + table_lines(table))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_serving", description=__doc__.split("\n\n")[0],
                                     epilog="Prints a Markdown table to stdout, progress to stderr.")
    parser.add_argument("a_root", help="checkout A (the baseline): a directory holding runtime/ and bench/")
    parser.add_argument("b_root", help="checkout B (the change)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (default 6); the table ends with medians")
    parser.add_argument("--seconds", type=float, default=5.0, help="each round's closed loops (default 5)")
    parser.add_argument("--clients", type=int, default=4, help="client processes a side (default 4: 8 in all)")
    args = parser.parse_args(argv)
    for root in (args.a_root, args.b_root):
        if not os.path.isfile(os.path.join(root, "runtime", "client", "__init__.py")):
            parser.error(f"{root} holds no runtime/client package")
    if args.rounds < 1 or args.clients < 1 or args.seconds <= 0:
        parser.error("--rounds and --clients must be >= 1, --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Progress()
    return run_alone("phyrt-ab-", lambda workdir, logdir, pids, stack: run(args, workdir, logdir, progress, stack))


if __name__ == "__main__":
    sys.exit(main())
