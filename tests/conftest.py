"""Shared helpers for the local-mode tests (``tests/test_local_*.py``).

Local engines spawn real rank processes, so every test that uses them must prove
afterwards that nothing is left: no child process, no /dev/shm name and no run
directory of a run this test process started. The bookkeeping:

    RUNS        every run id a WorkerSupervisor of this process drew (recorded by
                wrapping ``supervisor.supervisor.new_run_id``; observation only)
    LIVE        the engines started through ``start_engine`` and not yet closed
                through ``close_engine``: only their healthy groups' ranks, run
                directories and segments may exist between tests

``no_leaks`` (function scope) and ``no_leaks_at_module_end`` (module scope) check
both after the test or module; modules opt in with ``pytestmark`` / an autouse
fixture of their own, so other test files are not affected.
"""

from __future__ import annotations

import collections
import glob
import os
import random
import socket
import tempfile
import threading
import time
from typing import Any

import psutil
import pytest

SHM_DIR = "/dev/shm"
#: a group that failed is stopped by a reaper: SIGTERM, up to 2 s grace, SIGKILL
REAP_GRACE_S = 8.0

RUNS: list[str] = []
LIVE: dict[int, Any] = {}


# --------------------------------------------------------------------------- observation


def child_pids() -> set[int]:
    """Live (non-zombie) descendants of this process, multiprocessing's resource
    tracker excepted (the standard library starts it once and keeps it)."""
    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part for part in proc.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        found.add(proc.pid)
    return found


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def shm_names(run_id: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"phyrt-{run_id}-"))


def run_dirs(run_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"phyrt-{run_id}-*")))


def leftovers(run_id: str) -> list[str]:
    return shm_names(run_id) + run_dirs(run_id)


def run_sockets(run_dir: str) -> dict[tuple[str, str], int]:
    """This process's unix-socket fds under ``run_dir``: (file name, "listen" | "conn") -> count."""
    inodes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.append(int(target[len("socket:["):-1]))
    paths = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(run_dir + "/"):
                listening = int(parts[3], 16) & 0x10000  # __SO_ACCEPTCON
                paths[int(parts[6])] = (os.path.basename(parts[7]), "listen" if listening else "conn")
    found = collections.Counter(paths[i] for i in inodes if i in paths)
    return dict(found)


#: Linux x86_64 / aarch64 syscall numbers of a thread asleep in poll (zmq_poll) and in futex (a lock)
_POLL_SYSCALLS = {"x86_64": {7, 271}, "aarch64": {73}}.get(os.uname().machine, set())


def polls(thread: threading.Thread) -> bool:
    """Whether ``thread`` sleeps in poll(2) now (as a caller reading a socket does), not in a lock
    or a condition (futex), as /proc/self/task/TID/syscall shows."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
            number = f.read().split()[0]
    except (OSError, IndexError):
        return False
    return number.isdigit() and int(number) in _POLL_SYSCALLS


class WatchedLock:
    """A lock that records (``contended``) when a thread had to wait for it: put in place of a
    lock that another thread is expected to block on while the test holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        self.contended.set()
        return self._lock.acquire(True, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


# --------------------------------------------------------------------------- engines


def supervisor_of(engine: Any) -> Any:
    """The engine's WorkerSupervisor (internal: used only for pids, run id and address)."""
    return engine._dispatcher.executors[0]._supervisor


def group_pids(engine: Any, replica: int) -> list[int]:
    return [r.process.pid for r in supervisor_of(engine)._replicas[replica].ranks]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_base_port(count: int = 1) -> int:
    """A base port whose ``count`` consecutive ports are free now (replica i uses base + i).

    Picked below the kernel's ephemeral range: a port in it can be taken at any moment by
    the source port of some outgoing connection (another replica's gloo pairs, say),
    between this check and the rank's bind.
    """
    rng = random.Random()
    high = max(_ephemeral_low(), 10000 + 2 * count) - count
    for _ in range(500):
        base = rng.randrange(10000, high)
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports")


def tp_parallel(tp: int = 2, cfg: int = 1) -> Any:
    from runtime import AttentionParallelConfig, DenseParallelConfig, OuterParallelConfig, ParallelConfig

    return ParallelConfig(outer=OuterParallelConfig(cfg_size=cfg), dense=DenseParallelConfig(tp_size=tp),
                          attention=AttentionParallelConfig(tp_size=tp))


def engine_args(plugin: str = "tests.plugins:TPProbe", parallel: Any = None, plugin_args: Any = None) -> Any:
    from runtime import DeviceConfig, EngineArgs, EngineConfig, ParallelConfig

    return EngineArgs(plugin, plugin_args, EngineConfig(device=DeviceConfig(target="cpu"),
                                                        parallel=parallel or ParallelConfig()))


def start_engine(plugin: str = "tests.plugins:TPProbe", *, parallel: Any = None, replicas: int = 1,
                 plugin_args: Any = None, **supervisor: Any) -> Any:
    """A local engine on CPU; ``supervisor`` overrides WorkerSupervisorConfig fields.

    Retries with another base port if one was taken between the check and the start.
    """
    from runtime import DeploymentConfig, Engine, WorkerSupervisorConfig

    args = engine_args(plugin, parallel, plugin_args)
    ranks = args.config.parallel.infer_replica_world_size()
    # generous heartbeats by default: ranks importing torch on a loaded 2-core machine can
    # hold the GIL for seconds (tests about heartbeats pass their own)
    settings = {"heartbeat_timeout_s": 10.0, "execution_timeout_s": None} | supervisor
    for attempt in range(3):
        config = WorkerSupervisorConfig(base_port=free_base_port(replicas), **settings)
        deployment = DeploymentConfig.local(devices=tuple(range(ranks * replicas)), replica_count=replicas,
                                            process_config=config)
        try:
            engine = Engine(args, deployment)
        except Exception as exc:
            if attempt < 2 and ("is taken" in str(exc) or "rendezvous" in str(exc)):
                continue
            raise
        LIVE[id(engine)] = engine
        return engine
    raise AssertionError("unreachable")


def close_engine(engine: Any) -> None:
    """Close ``engine`` and check that its ranks, run directory and segments are gone."""
    sup = supervisor_of(engine)
    pids = [r.process.pid for g in sup._replicas for r in g.ranks]
    try:
        engine.close()
    finally:
        LIVE.pop(id(engine), None)
    assert not [p for p in pids if pid_alive(p)], "ranks still alive right after close()"
    assert not os.path.exists(sup.run_dir)
    assert leftovers(sup.run_id) == []


def allowed_children() -> set[int]:
    """The ranks of healthy groups of engines still open."""
    allowed = set()
    for engine in LIVE.values():
        sup = supervisor_of(engine)
        for status, group in zip(engine.replicas, sup._replicas):
            if status.healthy:
                allowed.update(r.process.pid for r in group.ranks)
    return allowed


def live_run_ids() -> set[str]:
    return {supervisor_of(engine).run_id for engine in LIVE.values()}


def check_no_leaks(grace: float = REAP_GRACE_S) -> None:
    """No stray process, and nothing left by a run whose engine is closed."""
    wait_until(lambda: child_pids() <= allowed_children(), grace, 0.05)
    stray = child_pids() - allowed_children()
    info = []
    for pid in stray:
        try:
            info.append(" ".join(psutil.Process(pid).cmdline())[:200])
        except psutil.NoSuchProcess:
            pass
    assert not stray, f"processes left behind: {sorted(stray)} {info}"
    live = live_run_ids()
    left = {rid: leftovers(rid) for rid in RUNS if rid not in live}
    assert not any(left.values()), f"segments or run directories left behind: {left}"


@pytest.fixture(scope="session")
def record_runs():
    """Record every run id a supervisor in this process draws (wraps the id source only)."""
    import supervisor.supervisor as sup_module

    original = sup_module.new_run_id

    def recording() -> str:
        run_id = original()
        RUNS.append(run_id)
        return run_id

    patch = pytest.MonkeyPatch()
    patch.setattr(sup_module, "new_run_id", recording)
    yield RUNS
    patch.undo()


@pytest.fixture
def no_leaks(record_runs):
    yield
    check_no_leaks()


@pytest.fixture(scope="module")
def no_leaks_at_module_end(record_runs):
    """After the module's own engines are closed: no child process at all, nothing left."""
    yield
    for engine in list(LIVE.values()):  # a test that failed half-way may leave one open
        close_engine(engine)
    check_no_leaks()
    assert child_pids() == set()
