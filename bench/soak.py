"""python -m bench.soak --minutes N: clients keep calling a 2-replica server while its ranks
are killed, and every request must end with a result or a typed error, in time.

    this process                                                  the server (a subprocess)
    8 client threads, one Client each ─── ipc:// (fixed path) ──> python -m runtime.launch
      {"obs": float32 [B, 32]}, B random: 1..16, 64..512,           --devices 0,1,2,3 --replicas 2
      1024..4096 (the large ones go by shared memory both ways)     --device cpu (the policy plugin)
      submit(timeout=--deadline-s), then wait deadline + slack         ├── replica 0: ranks 0, 1
    killer thread: every --kill-every seconds, SIGKILL (or SIGTERM)    └── replica 1: ranks 0, 1
      one live rank (a child process of the server, via psutil)
    keeper thread ("systemd"): when the server reports no healthy replica, died, or answers
      no info for 20 s (a watchdog: "wedged"), SIGTERM it (it must exit 0 and leave
      nothing; SIGKILL after 60 s), then start a new one on the same address
    sampler thread: every 2 s, the server's RSS, fds and threads, and this process's

Each request ends as one of: succeeded (a result of the right shape, dtype and range),
failed explicitly (a ``ServerError`` subclass, counted by type: ConnectionLostError
while the server restarts, ServerUnavailableError when no replica is left,
DeadlineExceededError, ...), wrong (a result that is not the policy's), untyped (any
other exception), or lost (no outcome within --deadline-s + the client's heartbeat
timeout + a margin). lost, untyped and wrong must be 0, no server may wedge, and each
server exits 0 on SIGTERM or 3 by itself once no replica is left (its documented stop). A
wedged server is SIGUSR1ed before its SIGKILL: faulthandler writes every thread's stack
into its log, kept (with the directory) whenever something was left behind.

Bounded: stops after --minutes (or --max-requests), then stops the server with SIGTERM
and checks that no process of any server instance, no /dev/shm name of theirs and no
socket file is left, and that this process's fds and threads are back to where they
were; removes its private directory. Prints a summary and one JSON line; exit status 1
if anything was lost, untyped, wrong or left behind, or a server wedged or exited badly.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

import numpy as np
import psutil

from runtime.client import Client, ServerError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBS_DIM, HORIZON, ACT_DIM = 32, 8, 7
CLIENT_HEARTBEAT_S = (0.5, 3.0)  # interval, timeout
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
#: a live server that answers no ``info`` for this long is wedged: restarted, and reported
WEDGED_S = 20.0
#: a server's exit status once no replica can serve (``runtime.launch.EXIT_CANNOT_SERVE``; this
#: process imports the client alone, not torch): the keeper restarts it, as a process manager would
UNHEALTHY_EXIT = 3


def _free_ports(count: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base + 1, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _fd_targets() -> dict[int, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return found


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


def _shm_of(pids: set[int]) -> list[str]:
    names = []
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == "phyrt" and parts[2].isdigit() and int(parts[2]) in pids:
            names.append(name)
    return sorted(names)


# --------------------------------------------------------------------------- the server


class ServerProcess:
    """One ``python -m runtime.launch`` instance; remembers every pid of its tree."""

    def __init__(self, address: str, log_path: str, args: list[str]) -> None:
        self.log_path = log_path
        self._log = open(log_path, "a")
        argv = ["--devices", "0,1,2,3", "--replicas", "2", "--device", "cpu", "--address", address,
                "--base-port", str(_free_ports(2)), "--log-level", "info", *args]
        # python -m runtime.launch, plus a SIGUSR1 handler that dumps every thread's stack to its log
        # (how a server that does not stop on SIGTERM shows where it is stuck)
        cmd = [sys.executable, "-c", "import faulthandler, runpy, signal, sys; "
               "faulthandler.register(signal.SIGUSR1, all_threads=True); "
               "sys.argv = ['runtime.launch', *sys.argv[1:]]; runpy.run_module('runtime.launch', run_name='__main__')",
               *argv]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.pids = {self.proc.pid}
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        self.samples: list[dict] = []
        self.exit_code: int | None = None
        self.leftovers: list[str] = []
        self.stopped = False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if selector.select(0.5):
                    line = self.proc.stdout.readline()
                    if line.startswith("phyrt ready"):
                        self.ready_after_s = time.monotonic() - self.started
                        self.remember_children()
                        return True
                    if not line:
                        return False
                elif self.proc.poll() is not None:
                    return False
        finally:
            selector.close()
        return False

    def remember_children(self) -> None:
        try:
            self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def ranks(self) -> list[int]:
        """Live rank processes (the resource tracker excepted)."""
        found = []
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE and not any("resource_tracker" in part
                                                                      for part in child.cmdline()):
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        self.pids |= set(found)
        return found

    def sample(self, t: float) -> None:
        try:
            p = psutil.Process(self.proc.pid)
            with p.oneshot():
                self.samples.append({"t": round(t, 1), "rss_mb": round(p.memory_info().rss / 2**20, 1),
                                     "fds": p.num_fds(), "threads": p.num_threads(), "ranks": len(self.ranks())})
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> None:
        """SIGTERM, wait; then check that nothing of the tree is left (SIGKILL what is). Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        self.remember_children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.leftovers.append(f"server {self.proc.pid} still running {STOP_TIMEOUT_S} s after SIGTERM "
                                  f"(its threads' stacks: {self.log_path})")
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.proc.kill()
            self.exit_code = self.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in self.pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in self.pids if _alive(p)]
        if alive:
            self.leftovers.append(f"processes left: {alive}")
            for pid in alive:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shm = _shm_of(self.pids)
        if shm:
            self.leftovers.append(f"segments left: {shm}")
        self.proc.stdout.close()
        self._log.close()


# --------------------------------------------------------------------------- the soak


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    succeeded: int = 0
    failed: collections.Counter = field(default_factory=collections.Counter)
    lost: int = 0
    untyped: int = 0
    wrong: int = 0
    latencies: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def note(self, kind: str, detail: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail}"[:300])


class Soak:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.dir = tempfile.mkdtemp(prefix="phyrt-soak-")  # 0700: the socket's private directory
        self.address = f"ipc://{self.dir}/soak.sock"
        self.tally = Tally()
        self.stop = threading.Event()
        self.servers: list[ServerProcess] = []
        self.server: ServerProcess | None = None
        self.server_lock = threading.Lock()
        self.serving = threading.Event()  # the current server is ready and has a healthy replica
        self.kills: list[dict] = []
        self.restarts = 0
        self.unexpected_exits = 0  # a server that exited by itself otherwise than as below
        self.unhealthy_exits = 0  # runtime.launch's own stop, exit status 3, once no replica can serve
        self.wedged: list[int] = []  # pids of servers that stopped answering while alive
        self.keeper_error: str | None = None
        self.client_samples: list[dict] = []
        self.started = time.monotonic()
        self.deadline_at = self.started + opts.minutes * 60

    # -- clients

    def client_loop(self, index: int) -> None:
        rng = np.random.default_rng(self.opts.seed * 100 + index)
        interval, timeout = CLIENT_HEARTBEAT_S
        deadline = self.opts.deadline_s
        wait = deadline + timeout + self.opts.margin_s
        with Client(self.address, heartbeat_interval_s=interval, heartbeat_timeout_s=timeout) as client:
            while not self.stop.is_set():
                with self.tally.lock:
                    if self.opts.max_requests and self.tally.sent >= self.opts.max_requests:
                        return
                    self.tally.sent += 1
                roll = rng.random()
                batch = int(rng.integers(1, 17) if roll < 0.7 else rng.integers(64, 513) if roll < 0.9
                            else rng.integers(1024, 4097))
                obs = rng.standard_normal((batch, OBS_DIM), dtype=np.float32)
                started = time.monotonic()
                try:
                    future = client.submit({"obs": obs}, timeout=deadline)
                    result = future.result(wait)
                except FutureTimeoutError:
                    with self.tally.lock:
                        self.tally.lost += 1
                        self.tally.note("lost", f"batch {batch}: no outcome within {wait} s")
                    continue
                except ServerError as exc:
                    with self.tally.lock:
                        self.tally.failed[type(exc).__name__] += 1
                    if not self.serving.is_set():
                        self.stop.wait(0.05)  # the server restarts: do not spin
                    continue
                except Exception as exc:  # noqa: BLE001 - the finding
                    with self.tally.lock:
                        self.tally.untyped += 1
                        self.tally.note("untyped", f"{type(exc).__name__}: {exc}")
                    continue
                elapsed = time.monotonic() - started
                actions = result.get("actions") if isinstance(result, dict) else None
                ok = (isinstance(actions, np.ndarray) and actions.shape == (batch, HORIZON, ACT_DIM)
                      and actions.dtype == np.float32 and np.isfinite(actions).all() and np.abs(actions).max() <= 1)
                with self.tally.lock:
                    if ok:
                        self.tally.succeeded += 1
                        self.tally.latencies.append(elapsed)
                    else:
                        self.tally.wrong += 1
                        self.tally.note("wrong", f"batch {batch}: {type(actions).__name__} "
                                                 f"{getattr(actions, 'shape', None)}")

    # -- the server's keeper, its killer and the sampler

    def start_server(self) -> None:
        server = ServerProcess(self.address, os.path.join(self.dir, f"server-{len(self.servers)}.log"),
                               self.opts.server_args)
        with self.server_lock:
            self.server = server
            self.servers.append(server)
        if not server.wait_ready():
            raise RuntimeError(f"the server did not start; log:\n{open(server.log_path).read()[-3000:]}")
        self.serving.set()

    def restart_server(self, why: str) -> None:
        self.serving.clear()
        with self.server_lock:
            old = self.server
        old.stop()
        # a server with no healthy replica stops by itself with exit status 3 (runtime.launch), and
        # may have begun to when our SIGTERM comes (its log says "SIGTERM again"): both are right
        expected = (0, 3) if why == "no healthy replica" else (0,)
        if old.exit_code not in expected and why != "died":
            old.leftovers.append(f"exit code {old.exit_code} after SIGTERM")
        if self.stop.is_set():
            return
        self.restarts += 1
        self.start_server()

    def keeper_loop(self) -> None:
        try:
            self._keep()
        except Exception as exc:  # noqa: BLE001 - a server that cannot start again ends the soak
            self.keeper_error = f"{type(exc).__name__}: {exc}"[:2000]
            self.stop.set()

    def _keep(self) -> None:
        with Client(self.address, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0) as control:
            answered = time.monotonic()
            while not self.stop.wait(0.5):
                server = self.server
                if server.proc.poll() is not None:
                    if server.proc.returncode == UNHEALTHY_EXIT:
                        self.unhealthy_exits += 1
                    else:
                        self.unexpected_exits += 1
                    self.restart_server("died")
                    answered = time.monotonic()
                    continue
                try:
                    info = control.info(timeout=5)
                except Exception:  # noqa: BLE001 - a restart in progress, or a lost ping
                    if time.monotonic() - answered > WEDGED_S:  # a watchdog, as systemd's would
                        self.wedged.append(server.proc.pid)
                        self.restart_server("wedged")
                        answered = time.monotonic()
                    continue
                answered = time.monotonic()
                if not any(r["healthy"] for r in info["replicas"]):
                    self.restart_server("no healthy replica")
                    answered = time.monotonic()

    def killer_loop(self) -> None:
        low, high = self.opts.kill_every
        while not self.stop.wait(self.rng.uniform(low, high)):
            if not self.serving.is_set():
                continue
            server = self.server
            ranks = server.ranks()
            if not ranks:
                continue
            pid = self.rng.choice(ranks)
            how = self.rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
            try:
                os.kill(pid, how)
                self.kills.append({"t": round(time.monotonic() - self.started, 1), "pid": pid,
                                   "signal": signal.Signals(how).name, "server": server.proc.pid})
            except ProcessLookupError:
                pass

    def sampler_loop(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(2.0):
            t = time.monotonic() - self.started
            if self.serving.is_set():
                self.server.sample(t)
            self.client_samples.append({"t": round(t, 1), "fds": me.num_fds(), "threads": me.num_threads()})

    # -- the run

    def run(self) -> dict:
        from zmq.utils.garbage import gc as zmq_garbage

        if not zmq_garbage.is_alive():  # pyzmq's one zero-copy collector per process (a context, a thread),
            zmq_garbage.start()         # started by the first copy=False send: part of the baseline
        me = psutil.Process()
        before = {"fds": me.num_fds(), "threads": me.num_threads()}
        self.fds_before = _fd_targets()
        threads: list[threading.Thread] = []
        try:
            self.start_server()
            threads = [threading.Thread(target=self.client_loop, args=(i,), name=f"soak-client-{i}")
                       for i in range(self.opts.clients)]
            threads += [threading.Thread(target=f, name=f"soak-{f.__name__}")
                        for f in (self.keeper_loop, self.killer_loop, self.sampler_loop)]
            for t in threads:
                t.start()
            while time.monotonic() < self.deadline_at and not self.stop.is_set():
                if self.opts.max_requests and self.tally.sent >= self.opts.max_requests:
                    break
                time.sleep(0.5)
        finally:
            self.stop.set()
            for t in threads:
                t.join(self.opts.deadline_s + CLIENT_HEARTBEAT_S[1] + self.opts.margin_s + 30)
            stuck = [t.name for t in threads if t.is_alive()]
            if self.server is not None and not self.server.stopped:
                self.server.stop()
                if self.server.exit_code != 0:
                    self.server.leftovers.append(f"exit code {self.server.exit_code} after SIGTERM")
            socket_left = os.path.exists(self.address[len("ipc://"):])
            if not any(s.leftovers for s in self.servers) and not socket_left:
                shutil.rmtree(self.dir, ignore_errors=True)  # else kept: the server logs tell why
        time.sleep(0.5)
        gc.collect()  # the dead client threads' thread-local sockets of pyzmq's collector go with them
        after = {"fds": me.num_fds(), "threads": me.num_threads()}
        return self.report(before, after, stuck, socket_left)

    def report(self, before: dict, after: dict, stuck: list[str], socket_left: bool) -> dict:
        t = self.tally
        lat = sorted(t.latencies)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, math.ceil(q * len(lat)) - 1)] * 1000, 2) if lat else None

        instances = []
        for s in self.servers:
            first, last = (s.samples[0], s.samples[-1]) if s.samples else ({}, {})
            instances.append({"pid": s.proc.pid, "ready_after_s": None if s.ready_after_s is None
                              else round(s.ready_after_s, 1), "exit_code": s.exit_code,
                              "first": first, "last": last,
                              "max_fds": max((x["fds"] for x in s.samples), default=None),
                              "max_threads": max((x["threads"] for x in s.samples), default=None),
                              "max_rss_mb": max((x["rss_mb"] for x in s.samples), default=None),
                              "leftovers": s.leftovers})
        left = [x for s in self.servers for x in s.leftovers] + ([f"socket file {self.address}"] if socket_left else [])
        if stuck:
            left.append(f"threads still running: {stuck}")
        if self.keeper_error:
            left.append(f"the keeper stopped: {self.keeper_error}")
        client_fds = [x["fds"] for x in self.client_samples] or [before["fds"]]
        client_threads = [x["threads"] for x in self.client_samples] or [before["threads"]]
        new_fds = sorted(v for k, v in _fd_targets().items() if self.fds_before.get(k) != v)
        # pyzmq's zero-copy collector keeps a thread-local PUSH socket (an eventfd) for threads that
        # sent with copy=False; one may outlive its thread until that thread-local is collected
        collector = [fd for fd in new_fds if fd == "anon_inode:[eventfd]"][:2]
        if after["fds"] - len(collector) > before["fds"] or after["threads"] > before["threads"]:
            left.append(f"this process: fds {before['fds']} -> {after['fds']} {new_fds}, "
                        f"threads {before['threads']} -> {after['threads']} {_thread_names()}")
        return {
            "minutes": round((time.monotonic() - self.started) / 60, 2), "clients": self.opts.clients,
            "seed": self.opts.seed, "deadline_s": self.opts.deadline_s,
            "sent": t.sent, "succeeded": t.succeeded, "failed": sum(t.failed.values()),
            "failed_by_type": dict(t.failed), "lost": t.lost, "untyped": t.untyped, "wrong": t.wrong,
            "examples": t.examples,
            "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
            "server_starts": len(self.servers), "restarts": self.restarts, "unexpected_exits": self.unexpected_exits,
            "unhealthy_exits": self.unhealthy_exits,
            "wedged": self.wedged,
            "ranks_killed": len(self.kills), "servers": instances,
            "client_process": {"fds": [min(client_fds), max(client_fds)], "threads": [min(client_threads),
                                                                                       max(client_threads)],
                               "before": before, "after": after},
            "leftovers": left, "kept_dir": self.dir if os.path.isdir(self.dir) else None,
        }


def _summary(r: dict) -> str:
    lines = [
        f"soak: {r['minutes']} min, {r['clients']} clients, {r['server_starts']} server start(s), "
        f"{r['ranks_killed']} ranks killed, {len(r['wedged'])} server(s) wedged "
        f"(no answer to info for {WEDGED_S:.0f} s), {r['unhealthy_exits']} stopped by themselves with no "
        f"replica left (exit {UNHEALTHY_EXIT}), {r['unexpected_exits']} exited otherwise",
        f"requests: sent {r['sent']}, succeeded {r['succeeded']}, failed explicitly {r['failed']} "
        f"{r['failed_by_type']}, lost {r['lost']}, untyped {r['untyped']}, wrong {r['wrong']}",
        f"latency of successes: p50 {r['latency_ms']['p50']} ms, p99 {r['latency_ms']['p99']} ms, "
        f"max {r['latency_ms']['max']} ms",
        "server instances (first sample after ready -> last before its stop):",
    ]
    for s in r["servers"]:
        f, l_ = s["first"], s["last"]
        lines.append(f"  pid {s['pid']}: ready in {s['ready_after_s']} s, exit {s['exit_code']}; "
                     f"rss {f.get('rss_mb')} -> {l_.get('rss_mb')} MB, fds {f.get('fds')} -> {l_.get('fds')}, "
                     f"threads {f.get('threads')} -> {l_.get('threads')}, ranks {f.get('ranks')} -> {l_.get('ranks')}")
    c = r["client_process"]
    lines.append(f"this process (8 Clients across restarts): fds {c['fds'][0]}..{c['fds'][1]}, "
                 f"threads {c['threads'][0]}..{c['threads'][1]}; before {c['before']}, after {c['after']}")
    lines.append(f"left behind: {r['leftovers'] or 'nothing'}")
    if r.get("kept_dir"):
        lines.append(f"server logs kept in {r['kept_dir']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 6.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between two rank kills, drawn uniformly")
    parser.add_argument("--deadline-s", type=float, default=5.0, help="each request's timeout_s")
    parser.add_argument("--margin-s", type=float, default=5.0,
                        help="past deadline + the client's heartbeat timeout + this, a request is lost")
    parser.add_argument("--max-requests", type=int, default=0, help="stop after this many (0: no limit)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--server-arg", dest="server_args", action="append", default=[],
                        help="an extra argument for python -m runtime.launch (repeatable)")
    opts = parser.parse_args(argv)
    if not 0 < opts.minutes <= 24 * 60 or opts.clients < 1:
        parser.error("--minutes must be in (0, 1440] and --clients >= 1")
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(2**31)
    soak = Soak(opts)
    previous = signal.signal(signal.SIGINT, lambda *_: soak.stop.set())  # Ctrl-C: stop, and still clean up
    try:
        report = soak.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    print(_summary(report), flush=True)
    print(json.dumps(report), flush=True)
    bad = (report["lost"] or report["untyped"] or report["wrong"] or report["leftovers"] or report["unexpected_exits"]
           or report["wedged"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
