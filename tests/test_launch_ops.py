"""python -m runtime.launch in operation: it exits 3 once no replica can serve (or stays up
when asked to), answers the probes /healthz and /readyz, rebuilds a failed replica when
asked to, and abandons a start on Ctrl-C or SIGTERM, leaving nothing behind.

Every test starts a real server (``tests.test_launch.Launched``) with CPU ranks; each
uses a short private TMPDIR, so that the server's private directory and the supervisor's
run directories can be proven gone after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from tests.test_launch import ROOT, Launched, _alive, shm_names_of, wait_until

#: from the kill of the last rank to the server's exit, on a busy 2-core machine
EXIT_BOUND_S = 20.0
#: from the signal to the exit of a start that is abandoned
ABANDON_BOUND_S = 15.0


@pytest.fixture
def tmpdir_env() -> Iterator[Path]:
    """A short, private TMPDIR for one server (ipc:// paths must stay under 108 bytes);
    it must be empty once the server is gone."""
    path = Path(tempfile.mkdtemp(prefix="phyrt-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ranks_of(pid: int) -> list[psutil.Process]:
    """The rank processes of the server ``pid`` (its children, multiprocessing's helper aside)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if not any("resource_tracker" in part for part in child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def fetch(url: str) -> tuple[int, str]:
    """(status, body) of a GET; an error status is returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def probe_base(server: Launched) -> str:
    return server.fields["metrics"].rsplit("/", 1)[0]


def kill_ranks(server: Launched, count: int) -> float:
    """SIGKILL every rank of ``server`` (there must be ``count``); the time of the kill."""
    ranks = ranks_of(server.proc.pid)
    assert len(ranks) == count, [r.name() for r in ranks]
    server.remember_children()
    killed = time.monotonic()
    for rank in ranks:
        rank.kill()
    return killed


# --------------------------------------------------------------------------- no replica can serve


@pytest.mark.timeout(240)
def test_every_rank_killed_exits_3_after_answering_and_leaves_nothing(tmp_path, tmpdir_env):
    """2 replicas x 1 rank: both killed, with a request in flight -> that request is answered
    EngineUnavailable, then the server cleans up as for SIGTERM and exits 3 on its own."""
    from runtime.client import Client, ConnectionLostError, ServerUnavailableError

    server = Launched("--plugin", "tests.plugins:Echo", "--devices", "0,1", "--replicas", "2", "--device", "cpu",
                      log_dir=tmp_path, env={"TMPDIR": str(tmpdir_env)})
    client = Client(server.address)
    try:
        client.call({"warm": True}, timeout=60)
        running = client.submit({"sleep": 60})
        assert wait_until(lambda: client.info()["inflight"] == 1, 10)
        killed = kill_ranks(server, 2)
        error = running.exception(30)
        code = server.proc.wait(EXIT_BOUND_S + 30)
        elapsed = time.monotonic() - killed
        print(f"from the kill of every rank to exit status {code}: {elapsed:.2f} s")
    finally:
        client.close()
        server.stop()
    assert isinstance(error, ServerUnavailableError) and not isinstance(error, ConnectionLostError), repr(error)
    assert code == 3, server.log()
    assert elapsed < EXIT_BOUND_S, server.log()
    log = server.log()
    assert "no replica can serve" in log and "replica 0:" in log and "replica 1:" in log  # each cause
    assert "Traceback" not in log
    assert os.listdir(tmpdir_env) == []  # private dir and run directories gone


@pytest.mark.timeout(240)
def test_keep_serving_unhealthy_stays_up_and_probes_say_not_ready(tmp_path, tmpdir_env):
    from runtime.client import Client, ServerUnavailableError

    server = Launched("--plugin", "tests.plugins:Echo", "--devices", "0", "--device", "cpu",
                      "--keep-serving-unhealthy", "--metrics-port", "0", log_dir=tmp_path,
                      env={"TMPDIR": str(tmpdir_env)})
    base = probe_base(server)
    client = Client(server.address)
    try:
        assert fetch(base + "/healthz") == (200, "ok\n")
        assert fetch(base + "/readyz")[0] == 200
        assert fetch(base + "/nope")[0] == 404
        assert client.call({"x": 1}, timeout=60) == {"x": 1}
        kill_ranks(server, 1)
        assert wait_until(lambda: fetch(base + "/readyz")[0] == 503, 30), server.log()
        status, body = fetch(base + "/readyz")
        assert "replica 0: down" in body, body
        time.sleep(1.0)  # several of the main thread's checks: it must not exit
        assert server.proc.poll() is None, server.log()
        assert client.ping(timeout=10) >= 0
        replica = client.info(timeout=10)["replicas"][0]
        assert replica["healthy"] is False and replica["error"] and replica["restarts"] == 0
        with pytest.raises(ServerUnavailableError):
            client.call({"x": 2}, timeout=30)
        assert fetch(base + "/healthz")[0] == 200  # alive, though not ready
    finally:
        client.close()
        code = server.stop()
    assert code == 0, server.log()
    assert "staying up" in server.log()
    assert os.listdir(tmpdir_env) == []


@pytest.mark.timeout(300)
def test_a_rebuilt_replica_is_ready_again_then_exit_3_once_restarts_are_spent(tmp_path, tmpdir_env):
    """One replica of 2 ranks, --replica-restarts 1: killed -> /readyz 503 while it is rebuilt
    -> 200 and serving again; killed again -> no rebuild left -> exit 3."""
    import numpy as np

    from runtime.client import Client

    server = Launched("--devices", "0,1", "--device", "cpu", "--replica-restarts", "1", "--restart-backoff-s", "1",
                      "--metrics-port", "0", log_dir=tmp_path, env={"TMPDIR": str(tmpdir_env)})
    base = probe_base(server)
    client = Client(server.address)
    obs = {"obs": np.ones((1, 32), np.float32)}
    try:
        assert fetch(base + "/readyz")[0] == 200
        client.call(obs, timeout=60)
        kill_ranks(server, 2)
        seen: list[tuple[int, str]] = []
        assert wait_until(lambda: seen.append(fetch(base + "/readyz")) or seen[-1][0] == 503, 30), server.log()
        assert "replica 0: being rebuilt" in seen[-1][1] or "replica 0: down" in seen[-1][1], seen[-1]
        assert server.proc.poll() is None  # a replica being rebuilt can still serve: no exit
        assert wait_until(lambda: fetch(base + "/readyz")[0] == 200, 120), server.log()
        replica = client.info(timeout=10)["replicas"][0]
        assert replica["healthy"] is True and replica["restarts"] == 1 and replica["restarting"] is False
        assert client.call(obs, timeout=60)["actions"].shape == (1, 8, 7)
        assert 'phyrt_replica_restarts{replica="0"} 1.0' in fetch(base + "/metrics")[1]
        killed = kill_ranks(server, 2)  # the rebuilt ranks
        code = server.proc.wait(EXIT_BOUND_S + 30)
        print(f"restarts spent: from the kill to exit status {code}: {time.monotonic() - killed:.2f} s")
    finally:
        client.close()
        server.stop()
    assert code == 3, server.log()
    assert os.listdir(tmpdir_env) == []


# --------------------------------------------------------------------------- signals during the start


def _start_and_signal(tmp_path: Path, tmpdir_env: Path, send: Any) -> tuple[subprocess.Popen, set[int], float, str]:
    """Start a 2-rank server in a session of its own; once its ranks exist, ``send(proc)``.
    Returns the process (exited), every pid of its tree, the seconds from signal to exit, its log."""
    log_path = tmp_path / "start.log"
    env = {**os.environ, "TMPDIR": str(tmpdir_env)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "--devices", "0,1", "--device", "cpu",
                                 "--startup-timeout-s", "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                                text=True, start_new_session=True, env=env)
        pids = {proc.pid}
        try:
            assert wait_until(lambda: "starting them" in log_path.read_text(), 90), log_path.read_text()
            assert wait_until(lambda: len(ranks_of(proc.pid)) >= 2, 30), log_path.read_text()
            pids |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            sent = time.monotonic()
            send(proc)
            out, _ = proc.communicate(timeout=60)
            elapsed = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(10)
    assert out == ""  # it never became ready
    return proc, pids, elapsed, log_path.read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["ctrl-c to the process group", "SIGTERM to the server"])
def test_a_signal_while_ranks_start_abandons_the_start_and_leaves_nothing(tmp_path, tmpdir_env, how):
    if how.startswith("ctrl-c"):
        send, name = (lambda proc: os.killpg(proc.pid, signal.SIGINT)), "SIGINT"  # as a terminal's Ctrl-C
    else:
        send, name = (lambda proc: proc.send_signal(signal.SIGTERM)), "SIGTERM"
    proc, pids, elapsed, log = _start_and_signal(tmp_path, tmpdir_env, send)
    print(f"{how}: from the signal to exit status {proc.returncode}: {elapsed:.2f} s")
    assert proc.returncode == 0, log
    assert f"{name} while starting" in log and "stopped" in log
    assert "Traceback" not in log
    assert elapsed < ABANDON_BOUND_S, log
    assert wait_until(lambda: not [p for p in pids if _alive(p)], 15), [p for p in pids if _alive(p)]
    assert shm_names_of(pids) == []
    assert os.listdir(tmpdir_env) == []  # the supervisor's run directory (and FileStore) gone


# --------------------------------------------------------------------------- side by side


@pytest.mark.timeout(240)
def test_two_servers_without_base_port_start_together_and_serve(tmp_path, tmpdir_env):
    """Two 2-rank servers started at the same moment, neither given --base-port: each
    replica rendezvouses through a file in its own run directory, so neither is refused."""
    import threading

    from runtime.client import Client

    servers: dict[str, Any] = {}

    def start(name: str) -> None:
        try:
            servers[name] = Launched("--plugin", "tests.plugins:TPProbe", "--devices", "0,1", "--device", "cpu",
                                     log_dir=tmp_path, name=name, env={"TMPDIR": str(tmpdir_env)})
        except BaseException as exc:  # reported below
            servers[name] = exc

    threads = [threading.Thread(target=start, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    try:
        assert all(isinstance(s, Launched) for s in servers.values()), servers
        for server in servers.values():
            assert server.fields["ranks_per_replica"] == "2"
            with Client(server.address) as client:
                answer = client.call({"op": "pid"}, timeout=60)  # a gather over both ranks
                assert len(answer["pids"]) == 2, answer
    finally:
        codes = [s.stop() for s in servers.values() if isinstance(s, Launched)]
    assert codes == [0, 0]
    assert os.listdir(tmpdir_env) == []
