"""Free rendezvous (``base_port=None``, the default), rank process names, and ranks that
the terminal's Ctrl-C does not reach (``supervisor.processes``, ``workers.main``)."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import socket
import threading
import time

import psutil
import pytest

from runtime import DeploymentConfig, Engine, WorkerSupervisorConfig
from runtime.core.errors import WorkerStartupError
from runtime.link.link_thread import LinkThread
from supervisor.processes import start_rank
from tests import conftest
from tests.conftest import (close_engine, engine_args, free_base_port, group_pids, leftovers, pid_alive,
                            supervisor_of, tp_parallel)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


def free_engine(replicas: int = 1, plugin_args: object = None) -> Engine:
    """A local CPU engine of 2-rank replicas with the default WorkerSupervisorConfig (no base_port)."""
    deployment = DeploymentConfig.local(devices=tuple(range(2 * replicas)), replica_count=replicas,
                                        process_config=WorkerSupervisorConfig(heartbeat_timeout_s=10.0))
    engine = Engine(engine_args(parallel=tp_parallel(2), plugin_args=plugin_args), deployment)
    conftest.LIVE[id(engine)] = engine
    return engine


def tcp_listen_ports(pids: list[int]) -> list[int]:
    ports = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                ports.append(conn.laddr.port)
    return ports


@pytest.fixture(scope="module")
def engine(record_runs):
    engine = free_engine()
    try:
        yield engine
    finally:
        if id(engine) in conftest.LIVE:
            close_engine(engine)


def test_the_default_is_a_free_rendezvous():
    assert WorkerSupervisorConfig().base_port is None
    assert DeploymentConfig.local(replica_count=70000).process_config.base_port is None  # no port range to pass


def test_two_engines_built_at_once_without_base_port_both_serve():
    engines: list[Engine] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            engines.append(free_engine())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    try:
        assert errors == [] and len(engines) == 2
        low = conftest._ephemeral_low()
        for engine in engines:
            pids = group_pids(engine, 0)
            answer = engine.step({"op": "pid"}, timeout=60)
            assert sorted(p for row in answer["pids"] for p in row) == sorted(pids)
            assert os.path.exists(os.path.join(supervisor_of(engine).run_dir, "store-0"))
            # gloo's own listeners take ports the OS hands out; nothing listens on one we chose
            assert all(port >= low for port in tcp_listen_ports(pids)), tcp_listen_ports(pids)
    finally:
        for engine in engines:
            close_engine(engine)  # asserts: ranks gone, run directory (store file included) and segments gone


def test_ranks_carry_their_name_in_the_kernel(engine):
    pids = group_pids(engine, 0)
    assert [psutil.Process(pid).name() for pid in pids] == ["phyrt-r0-0", "phyrt-r0-1"]
    with open(f"/proc/{pids[1]}/comm") as f:  # what ps -o comm and top show
        assert f.read().strip() == "phyrt-r0-1"


def test_sigint_sent_to_a_rank_does_not_stop_it(engine):
    pids = group_pids(engine, 0)
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert all(pid_alive(pid) for pid in pids)
    assert engine.step({"op": "echo", "x": 7}, timeout=60) == 7
    assert engine.replicas[0].healthy


def _exit_with_sigint_blocked() -> None:
    """A spawned child's target: exit 0 when SIGINT came blocked from its parent thread, else 3."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os._exit(0 if signal.SIGINT in blocked else 3)


def test_ranks_started_on_the_link_thread_start_with_sigint_blocked():
    link = LinkThread("phyrt-supervisor-test")
    link.start()
    process = multiprocessing.get_context("spawn").Process(target=_exit_with_sigint_blocked, daemon=True)
    try:
        link.call(functools.partial(start_rank, process.start))
        process.join(60)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)
        assert link.stop()
        link.dispose()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the caller's mask is untouched


def test_a_link_thread_call_returns_or_raises_there_and_fails_once_the_thread_ended():
    link = LinkThread("phyrt-call-test")
    link.start()
    try:
        assert link.call(threading.current_thread) is link.thread  # it ran there
        assert link.call(lambda: link.call(lambda: 5)) == 5  # a call from the thread itself runs at once
        with pytest.raises(ZeroDivisionError):
            link.call(lambda: 1 / 0)
        assert link.call(lambda: "still serving") == "still serving"
    finally:
        assert link.stop()
        link.dispose()
    with pytest.raises(RuntimeError, match="has ended"):
        link.call(lambda: 1)


def test_a_failed_start_without_base_port_leaves_nothing(record_runs):
    runs = len(conftest.RUNS)
    with pytest.raises(WorkerStartupError, match="rank 1"):
        free_engine(plugin_args={"fail_build_rank": 1})
    new = conftest.RUNS[runs:]
    assert len(new) == 1 and leftovers(new[0]) == []


def test_a_taken_base_port_names_the_free_rendezvous():
    base = free_base_port(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base))
        holder.listen()
        deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(base_port=base))
        with pytest.raises(ValueError, match=r"base_port=None \(the default\) for a free rendezvous"):
            Engine(engine_args(parallel=tp_parallel(2)), deployment)
