"""Local engines' lifetime: close(), an engine nobody closed, the engine process
SIGKILLed under its ranks, and what is refused before any process starts.

Engines that must die with their process run in a subprocess (``python -c``) that
prints its rank pids and run id as one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from runtime import DeploymentConfig, Engine, EngineUnavailableError, WorkerSupervisorConfig
from tests import conftest
from tests.conftest import (child_pids, close_engine, engine_args, free_base_port, group_pids, leftovers,
                            pid_alive, run_dirs, shm_names, start_engine, supervisor_of, tp_parallel,
                            wait_until)
from tests.plugins import mark_files
from tests.test_kill_matrix import _inode

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaks")]
ROOT = Path(__file__).resolve().parents[1]

#: a 2-rank local engine in a fresh interpreter; big tensors make both sides' arenas grow
ENGINE_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from tests.conftest import group_pids, start_engine, supervisor_of, tp_parallel

    engine = start_engine(parallel=tp_parallel(2))
    x = torch.arange(4 << 20, dtype=torch.float32)
    kept = engine.step({"op": "echo", "x": x}, timeout=60)
    assert torch.equal(kept, x)
    pending = engine.submit({"op": "sleep", "s": 60.0})
    sup = supervisor_of(engine)
    print(json.dumps({"run_id": sup.run_id, "run_dir": sup.run_dir, "pids": group_pids(engine, 0)}), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(120)
    # else: leave without close(), a request still running
""")


@pytest.fixture(scope="module", autouse=True)
def _module_end(no_leaks_at_module_end):
    yield


def run_engine_script(mode: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"the engine subprocess printed nothing: {err[-3000:]}")
    return proc, json.loads(line)


# --------------------------------------------------------------------------- close()


def test_close_fails_pending_futures_is_idempotent_and_refuses_work(tmp_path):
    engine = start_engine(parallel=tp_parallel(2))
    pids = group_pids(engine, 0)
    mark = str(tmp_path / "running")
    running = engine.submit({"op": "sleep", "s": 30.0, "mark": mark})
    queued = [engine.submit({"op": "echo", "x": i}) for i in range(3)]
    assert wait_until(lambda: len(mark_files(mark)) == 2, 30), mark_files(mark)  # running on both ranks
    assert not any(f.done() for f in [running] + queued)
    started = time.monotonic()
    close_engine(engine)  # also checks: ranks, run directory and segments gone
    assert time.monotonic() - started < 10
    for future in [running] + queued:
        exc = future.exception(timeout=0)
        assert isinstance(exc, EngineUnavailableError) and "closed" in str(exc), repr(exc)
    engine.close()  # idempotent
    assert engine.closed
    with pytest.raises(EngineUnavailableError, match="closed"):
        engine.submit({"op": "pid"})
    with pytest.raises(EngineUnavailableError, match="closed"):
        engine.step({"op": "pid"})
    assert not any(pid_alive(p) for p in pids)


def test_close_of_an_idle_engine_is_quick():
    engine = start_engine(parallel=tp_parallel(2))
    assert engine.step({"op": "echo", "x": 1}, timeout=30) == 1
    started = time.monotonic()
    close_engine(engine)
    assert time.monotonic() - started < 3  # ranks leave on the shutdown message, no SIGTERM grace


# Was a bug (fixed; this guards it): WorkerSupervisor._release closed a stopped rank's Process (its
# spawn pipes) only if its exit code showed at once. When another thread polls the same Process
# (Process.start, in any thread, first polls every child of the process: in the kill matrix, the
# next engine starting meanwhile), the thread whose waitpid reaps the rank stores the code a moment
# later, and the reaper's own waitpid meanwhile fails (ECHILD), which multiprocessing reads as "still
# running": the reaper skipped the rank and its sentinel stayed open after Engine.close() ("spawn
# pipes of a closed engine", about once in 7 runs of test_kill_matrix). This test plays that other
# thread: it reaps the killed rank itself (the I/O thread kept off it by the process lock), then
# stores the exit code once the reaper has looked (or 0.3 s into its wait), or never (a wait
# outside multiprocessing), and closes the engine while the reaper runs
@pytest.mark.parametrize("stored", ["late", "never"])
def test_close_releases_a_rank_whose_exit_code_another_thread_collected(stored):
    engine = start_engine()  # one rank: the reaper has no other rank to stop
    sup = supervisor_of(engine)
    rank = sup._replicas[0].ranks[0]
    popen = rank.process._popen
    pipe = (rank.process.sentinel, os.fstat(rank.process.sentinel).st_ino)
    with sup._reaping.lock:  # the I/O thread's dead_rank waits for this: nothing polls the rank meanwhile
        os.kill(rank.process.pid, signal.SIGKILL)
        _, status = os.waitpid(rank.process.pid, 0)  # reaped here; multiprocessing's own waits get ECHILD
    assert wait_until(lambda: sup._reaping.threads, 10), "the group did not fail"
    reaper = sup._reaping.threads[0]

    def store() -> None:  # as the reaping thread would, once it has the GIL back
        wait_until(lambda: not reaper.is_alive(), 0.3)
        popen.returncode = os.waitstatus_to_exitcode(status)

    storing = threading.Thread(target=store, daemon=True)
    if stored == "late":
        storing.start()
    started = time.monotonic()
    close_engine(engine)
    closed_s = time.monotonic() - started
    if stored == "late":
        storing.join(5)
    assert rank.closed and rank.process.exitcode == (-signal.SIGKILL if stored == "late" else None), rank.process
    assert [fd for fd, inode in [pipe] if _inode(fd) == inode] == [], "the rank's spawn pipe is open after close()"
    assert closed_s < 5, closed_s


def test_an_engine_nobody_closed_is_cleaned_up_at_interpreter_exit():
    proc, info = run_engine_script("leave")
    left_at = time.monotonic()  # it printed its line; now it falls off the end of its script
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    # the running request gets the polite shutdown's grace, then SIGTERM: seconds, not more
    assert time.monotonic() - left_at < 10
    assert wait_until(lambda: not any(pid_alive(p) for p in info["pids"]), 2.0)
    assert not os.path.exists(info["run_dir"])
    assert leftovers(info["run_id"]) == []


# --------------------------------------------------------------------------- the engine process SIGKILLed


@pytest.fixture(scope="module")
def killed_engine():
    """Run the engine script and SIGKILL the engine process; watch its ranks for 3 s, then
    SIGKILL whatever is left of the tree, as ``kill -9`` of a whole process tree would."""
    proc, info = run_engine_script("hang")
    ranks_alive = all(pid_alive(p) for p in info["pids"])
    proc.kill()
    proc.wait(10)
    killed_at = time.monotonic()
    gone = wait_until(lambda: not any(pid_alive(p) for p in info["pids"]), 3.0, 0.01)
    info |= {"ranks_alive_before": ranks_alive, "gone": gone, "gone_after_s": time.monotonic() - killed_at}
    for pid in info["pids"]:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not any(pid_alive(p) for p in info["pids"]), 5.0)
    proc.communicate(timeout=10)  # the ranks held the pipes open
    yield info
    for path in run_dirs(info["run_id"]):
        shutil.rmtree(path, ignore_errors=True)


def test_ranks_exit_within_2s_of_their_engine_process_sigkill(killed_engine):
    assert killed_engine["ranks_alive_before"]
    assert killed_engine["gone"], f"ranks {killed_engine['pids']} still alive 3 s after the engine's SIGKILL"
    assert killed_engine["gone_after_s"] < 2.0, killed_engine["gone_after_s"]


def test_a_killed_engine_tree_leaves_nothing_in_dev_shm_after_the_next_start(killed_engine):
    """Arenas of both sides grew (16 MiB each way); every name must be gone, at once or
    after the sweep of the next start."""
    run_id = killed_engine["run_id"]
    if shm_names(run_id):  # names still linked after the kill are swept by the next start
        close_engine(start_engine())
    assert shm_names(run_id) == []


def test_a_killed_engine_leaves_no_run_directory_after_the_next_start(killed_engine):
    close_engine(start_engine())
    assert run_dirs(killed_engine["run_id"]) == []


# --------------------------------------------------------------------------- refused before any process starts


def test_plugin_args_that_are_not_plain_data_raise_typeerror_before_any_process():
    before, runs = child_pids(), len(conftest.RUNS)
    deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(base_port=free_base_port(1)))
    for bad in ({"f": object()}, {"s": {1, 2}}, {"t": torch.ones(2)}, {"big": 2**64}):
        with pytest.raises(TypeError, match="plugin_args"):
            Engine(engine_args(parallel=tp_parallel(2), plugin_args=bad), deployment)
    assert child_pids() == before
    assert len(conftest.RUNS) == runs  # not even a supervisor was made


@pytest.mark.parametrize("taken", [0, 1])
def test_a_taken_base_port_is_a_clear_valueerror(taken):
    base = free_base_port(2)
    before, runs = child_pids(), len(conftest.RUNS)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + taken))
        holder.listen()
        deployment = DeploymentConfig.local(devices=(0, 1, 2, 3), replica_count=2,
                                            process_config=WorkerSupervisorConfig(base_port=base))
        with pytest.raises(ValueError) as info:
            Engine(engine_args(parallel=tp_parallel(2)), deployment)
    message = str(info.value)
    assert f"port {base + taken}" in message and f"replica {taken}" in message, message
    assert "base_port" in message
    assert child_pids() == before
    assert all(leftovers(run_id) == [] for run_id in conftest.RUNS[runs:])


def _time_wait_on(port: int) -> None:
    """Leave a connection in TIME_WAIT on ``port`` (the listening side closes first), as a
    replica's rendezvous store does when its engine closes."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()
        time.sleep(0.05)
        client.close()


def test_an_engine_restarted_at_once_on_the_same_base_port_starts():
    """The previous engine's rendezvous connections linger in TIME_WAIT for a minute: no obstacle."""
    base = free_base_port(1)
    _time_wait_on(base)
    # the TCP states of the port, from /proc/net/tcp through psutil (no ss binary needed)
    states = [c.status for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == base]
    assert psutil.CONN_TIME_WAIT in states, states  # the obstacle this test is about is there
    deployment = DeploymentConfig.local(devices=(0, 1), process_config=WorkerSupervisorConfig(base_port=base))
    engine = Engine(engine_args(parallel=tp_parallel(2)), deployment)
    try:
        assert engine.step({"op": "pid"}, timeout=60)["replica"] == 0, states
    finally:
        close_engine(engine)


def test_plugin_args_with_int_keys_reach_the_ranks_or_are_refused_up_front():
    before = child_pids()
    try:
        engine = start_engine(plugin_args={1: "one"})
    except TypeError:  # refused in the caller: acceptable, if nothing was started
        assert child_pids() == before
        return
    try:
        assert engine.step({"op": "echo", "x": 1}, timeout=30) == 1
    finally:
        close_engine(engine)
