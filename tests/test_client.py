"""runtime.client against launched servers of the ``tests.plugins:Echo`` plugin (inline).

One Echo server serves the module; the Overloaded and restart tests start their own.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.client import (AsyncClient, Client, ConnectionLostError, DeadlineExceededError, InvalidRequestError,
                            OverloadedError, PluginError, ServerUnavailableError)
from tests.conftest import polls
from tests.test_launch import ROOT, Launched, shm_names_of, wait_until


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--log-level", "warning",
                      log_dir=tmp_path_factory.mktemp("echo"))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def client(echo):
    with Client(echo.address) as c:
        yield c


def _run_python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- import and round trips


@pytest.mark.timeout(90)
def test_client_imports_and_works_without_torch(echo):
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
from runtime.client import Client
with Client({echo.address!r}) as c:
    r = c.call({{"x": np.arange(6, dtype=np.int64).reshape(2, 3)}}, timeout=30)
    assert r["x"].tolist() == [[0, 1, 2], [3, 4, 5]], r
    assert c.submit({{"p": 1}}, timeout=30, priority=-3).result(30) == {{"p": 1}}  # priority: torch-free too
print("torch-free ok")
"""
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    assert "torch-free ok" in out.stdout


@pytest.mark.timeout(60)
def test_every_dtype_and_structure_round_trips(client):
    rng = np.random.default_rng(0)
    payload = {
        "nested": {"list": [1, 2.5, "three", None, True, b"bytes"], "tuple": (1, 2)},
        "scalar": np.float32(1.5),
        "empty": np.zeros((0, 3), np.float32),
        "zero_d": np.array(7, np.int32),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
        "big_endian": np.arange(4, dtype=">i4"),
        "bool": np.array([True, False, True]),
        **{str(dt): (rng.standard_normal((3, 4)) * 10).astype(dt)
           for dt in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8)},
    }
    result = client.call(payload, timeout=30)
    assert result["nested"] == {"list": [1, 2.5, "three", None, True, b"bytes"], "tuple": [1, 2]}
    assert result["scalar"] == 1.5
    for key in payload:
        if isinstance(payload[key], np.ndarray):
            expected = np.asarray(payload[key])
            assert result[key].shape == expected.shape, key
            assert result[key].dtype == expected.dtype.newbyteorder("="), key
            np.testing.assert_array_equal(result[key], expected)
            assert result[key].flags.writeable  # results are the caller's own arrays


@pytest.mark.timeout(60)
def test_torch_tensors_in_and_out(echo):
    torch = pytest.importorskip("torch")
    with Client(echo.address, tensor_type="torch") as client:
        x = torch.randn(3, 5)
        half = torch.randn(4, dtype=torch.bfloat16)
        result = client.call({"x": x, "t": x.t(), "half": half}, timeout=30)
        assert isinstance(result["x"], torch.Tensor)
        assert torch.equal(result["x"], x) and torch.equal(result["t"], x.t().contiguous())
        assert result["half"].dtype == torch.bfloat16 and torch.equal(result["half"], half)


@pytest.mark.timeout(60)
def test_bad_payloads_fail_in_the_caller(client):
    with pytest.raises(TypeError, match="cannot send"):
        client.submit({"x": object()})
    with pytest.raises(TypeError, match="map keys must be str"):
        client.submit({1: 2})
    with pytest.raises(TypeError, match="cannot be sent"):
        client.submit({"x": np.zeros(2, np.complex64)})


# --------------------------------------------------------------------------- shared memory


@pytest.mark.timeout(60)
def test_large_tensors_go_through_shared_memory_and_leave_no_names(client):
    big = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    assert wait_until(lambda: client._session is not None and client._session.mapper is not None, 10)
    for _ in range(3):
        result = client.call({"image": big, "small": np.ones(4, np.float32)}, timeout=30)
        np.testing.assert_array_equal(result["image"], big)
    session = client._session
    assert session.arena is not None and session.announced  # inputs went by shared memory
    assert session.mapper.segments  # and results came back that way
    # every name was unlinked once mapped: a crash of either side now leaks nothing
    assert [n for n in os.listdir("/dev/shm") if session.run_id in n] == []
    result_run = session.mapper.run_id
    assert wait_until(lambda: [n for n in os.listdir("/dev/shm") if result_run in n] == [], 5)


@pytest.mark.timeout(90)
def test_a_killed_client_leaves_no_segment(echo):
    code = f"""
import sys, time
import numpy as np
from runtime.client import Client
c = Client({echo.address!r})
deadline = time.monotonic() + 10
while (c._session is None or c._session.mapper is None) and time.monotonic() < deadline:
    time.sleep(0.01)
big = np.ones((1024, 512), np.float32)
assert (c.call({{"x": big}}, timeout=30)["x"] == big).all()
print("called", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "called"
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert shm_names_of({proc.pid}) == []
    with Client(echo.address) as c:  # the server is unaffected
        assert c.call({"after": 1}, timeout=30) == {"after": 1}


@pytest.mark.timeout(60)
def test_result_segments_of_a_dead_client_are_removed(echo):
    """A client that dies holding unreleased result blocks: the server drops them with its pid."""
    import msgpack
    import zmq

    from runtime.transport.arena import new_run_id

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(echo.address)
    try:
        sock.send(msgpack.packb({"v": 1, "op": "register", "id": 1, "run_id": new_run_id(), "segments": [],
                                 "pid": sleeper.pid}))
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["ok"], reply
        result_run = reply["result"]["result_run_id"]
        big = np.ones(1 << 16, np.float32)
        sock.send_multipart([msgpack.packb({"v": 1, "op": "submit", "id": 2, "shm_results": True, "payload": {
            "x": msgpack.ExtType(1, msgpack.packb(["float32", [1 << 16], 0]))}}), big.tobytes()])
        assert sock.poll(10_000)
        reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
        assert reply["ok"] and reply["result"]["x"].code == 2  # the result went to shared memory
        linked = lambda: [n for n in os.listdir("/dev/shm") if result_run in n]  # noqa: E731
        assert linked()  # never released, so still named
        sleeper.kill()
        sleeper.wait(10)
        assert wait_until(lambda: not linked(), 5), linked()
    finally:
        sleeper.kill()
        sleeper.wait(10)
        sock.close()
        ctx.term()


# --------------------------------------------------------------------------- shared-memory results are views


@pytest.fixture
def inline_echo(tmp_path):
    """A ``Server`` over an inline ``tests.plugins:Echo`` engine in this process: its
    per-client result arenas can be looked at."""
    from runtime import Engine, EngineArgs
    from runtime.serving.server import Server

    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    server = Server(Engine(EngineArgs(plugin="tests.plugins:Echo")), f"ipc://{private}/s.sock")
    server.start()
    yield server
    server.close(5)


def _shm_client(server, client: Client):
    """The server's ``ClientShm`` of ``client``, once both sides registered."""
    assert wait_until(lambda: client._session is not None and client._session.mapper is not None, 10)
    run_id = client._session.run_id
    assert wait_until(lambda: any(c.run_id == run_id for c in list(server._shm._clients.values())), 5)
    return next(c for c in list(server._shm._clients.values()) if c.run_id == run_id)


def _phyrt_names(*run_ids: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"phyrt-{r}-") for r in run_ids))


@pytest.mark.timeout(60)
def test_a_shm_result_is_a_view_of_its_block_held_until_collected(inline_echo):
    big = np.random.default_rng(2).standard_normal(1 << 19)  # 4 MiB of float64
    with Client(inline_echo.address, heartbeat_interval_s=0.2) as client:
        shm = _shm_client(inline_echo, client)
        result = client.call({"x": big}, timeout=30)["x"]
        np.testing.assert_array_equal(result, big)
        assert not result.flags.owndata and result.flags.writeable  # a view, and the caller may write to it
        (segment, offset), = dict(shm.session._outstanding)  # the server holds its one block for us
        # no copy: the array is that very block (a write shows in the server's own mapping of it)
        server_side = np.frombuffer(shm.session.arena._segments[segment].mm, np.float64, count=4, offset=offset)
        result[:4] = -1.0
        assert server_side.tolist() == [-1.0] * 4
        del server_side

        part = result[100:200]  # anything made from it keeps the block
        del result
        client.ping()  # messages and heartbeats go by: nothing to release yet
        time.sleep(0.6)
        assert (segment, offset) in shm.session._outstanding
        np.testing.assert_array_equal(part, big[100:200])
        del part  # the last array over the block: released with the next heartbeat
        assert wait_until(lambda: not shm.session._outstanding, 5), dict(shm.session._outstanding)

        # and the server reuses it: the next result lands in the same block
        again = client.call({"x": big}, timeout=30)["x"]
        assert dict(shm.session._outstanding) == {(segment, offset): big.nbytes}
        np.testing.assert_array_equal(again, big)


@pytest.mark.timeout(60)
def test_torch_shm_results_keep_their_block_too(inline_echo):
    torch = pytest.importorskip("torch")
    x = torch.randn(1 << 18)  # 1 MiB
    half = torch.randn(1 << 17).to(torch.bfloat16)  # 256 KiB
    with Client(inline_echo.address, tensor_type="torch", heartbeat_interval_s=0.2) as client:
        shm = _shm_client(inline_echo, client)
        result = client.call({"x": x, "half": half}, timeout=30)
        assert torch.equal(result["x"], x) and torch.equal(result["half"], half)
        assert len(shm.session._outstanding) == 2
        kept_x, kept_half = result["x"][::2], result["half"].view(torch.int16)
        del result
        time.sleep(0.6)
        assert len(shm.session._outstanding) == 2  # the torch tensors (and views of them) hold their blocks
        del kept_x
        assert wait_until(lambda: len(shm.session._outstanding) == 1, 5)
        assert torch.equal(kept_half, half.view(torch.int16))
        del kept_half
        assert wait_until(lambda: not shm.session._outstanding, 5)


@pytest.mark.timeout(120)
def test_dropped_results_are_released_and_shared_memory_does_not_grow(inline_echo):
    big = np.zeros((1024, 1024), np.float32)  # 4 MiB
    with Client(inline_echo.address) as client:
        shm = _shm_client(inline_echo, client)
        client_run, result_run = client._session.run_id, shm.result_run_id

        def round_trips(n: int, start: int) -> None:
            for i in range(start, start + n):
                big[0, 0] = i
                assert client.call({"x": big, "i": i}, timeout=30)["x"][0, 0] == i  # dropped at once

        round_trips(10, 0)
        capacity = shm.session.arena.capacity
        round_trips(60, 10)
        # the same blocks, over and over: no growth with the number of calls. (A block's release
        # rides with the next message once its result is collected; on a loaded machine the
        # thread that completed the call may still hold the result when the caller sends its
        # next request, so the arena may grow once by a segment, never per call.)
        assert shm.session.arena.capacity <= 3 * capacity
        grown = shm.session.arena.capacity
        round_trips(60, 70)
        assert shm.session.arena.capacity <= max(grown, 3 * capacity)
        assert len(shm.session.arena.segments) <= 2 and len(client._session.mapper.segments) <= 2
        # a few held at once (the arena grows for them), then dropped: all of them come back
        held = [client.call({"x": big}, timeout=30)["x"] for _ in range(3)]
        assert len(shm.session._outstanding) == 3
        del held
        client.ping()  # the release rides with this message
        assert wait_until(lambda: not shm.session._outstanding, 5), dict(shm.session._outstanding)
        capacity = shm.session.arena.capacity
        round_trips(30, 200)
        assert shm.session.arena.capacity <= 3 * capacity
        # every name went once mapped: nothing of this client is named in /dev/shm
        assert wait_until(lambda: _phyrt_names(client_run, result_run) == [], 5), _phyrt_names(client_run,
                                                                                               result_run)


@pytest.mark.timeout(120)
def test_a_result_kept_after_close_stays_valid_and_nothing_is_left(tmp_path):
    """The views outlive Client.close() and the server's close (no dangling mapping: a
    segfault would end the child), and /dev/shm holds nothing of either afterwards."""
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    code = f"""
import gc, os
import numpy as np
import torch
from runtime import Engine, EngineArgs
from runtime.client import Client
from runtime.serving.server import Server
from tests.test_launch import shm_names_of, wait_until

server = Server(Engine(EngineArgs(plugin="tests.plugins:Echo")), "ipc://{private}/s.sock")
server.start()
big = np.random.default_rng(3).standard_normal((512, 1024))  # 4 MiB
with Client(server.address) as client, Client(server.address, tensor_type="torch") as torch_client:
    for c in (client, torch_client):
        assert wait_until(lambda: c._session is not None and c._session.mapper is not None, 10)
    kept = client.call({{"x": big}}, timeout=30)["x"]
    kept_torch = torch_client.call({{"x": torch.from_numpy(big)}}, timeout=30)["x"]
    assert not kept.flags.owndata
gc.collect()
assert (kept == big).all() and torch.equal(kept_torch, torch.from_numpy(big))
kept += 1.0
kept_torch.add_(1.0)
assert (kept == big + 1.0).all() and torch.equal(kept_torch, torch.from_numpy(big + 1.0))
server.close(5)
gc.collect()
assert (kept == big + 1.0).all() and torch.equal(kept_torch, torch.from_numpy(big + 1.0))
assert shm_names_of({{os.getpid()}}) == [], shm_names_of({{os.getpid()}})
del kept, kept_torch
gc.collect()
print("ok", os.getpid(), flush=True)
"""
    proc = _run_python(code, timeout=100)
    assert proc.returncode == 0 and proc.stdout.startswith("ok "), (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert shm_names_of({int(proc.stdout.split()[1])}) == []


# --------------------------------------------------------------------------- deadlines, cancel, errors


@pytest.mark.timeout(60)
def test_deadline_of_a_running_request(client):
    with pytest.raises(DeadlineExceededError, match="still running"):
        client.submit({"sleep": 1.0}, timeout=0.2).result(10)
    assert client.call({"next": 1}, timeout=30) == {"next": 1}


@pytest.mark.timeout(60)
def test_deadline_of_a_queued_request_cancels_it(client):
    running = client.submit({"sleep": 0.8})
    queued = client.submit({"queued": 1}, timeout=0.2)
    with pytest.raises(DeadlineExceededError, match="cancelled while queued"):
        queued.result(10)
    assert running.result(10) == {"sleep": 0.8}


@pytest.mark.timeout(60)
def test_call_timeout_raises_deadline_exceeded(client):
    with pytest.raises(DeadlineExceededError):
        client.call({"sleep": 1.0}, timeout=0.1)
    assert client.call({"ok": 1}, timeout=30) == {"ok": 1}


@pytest.mark.timeout(60)
def test_cancel_only_a_queued_request(client, tmp_path):
    mark = tmp_path / "running"
    running = client.submit({"sleep": 1.0, "mark": str(mark)})
    assert wait_until(mark.exists, 10)  # the inline engine runs it
    queued = client.submit({"queued": 2})
    assert client.cancel(queued) is True
    assert wait_until(queued.cancelled, 5)
    assert client.cancel(running) is False
    assert running.result(10) == {"sleep": 1.0, "mark": str(mark)}
    assert client.cancel(running) is False  # finished: nothing to cancel


@pytest.mark.timeout(60)
def test_future_cancel_asks_the_server_to_drop_the_request(client):
    running = client.submit({"sleep": 0.5})
    queued = client.submit({"queued": 3})
    assert queued.cancel()
    assert running.result(10) == {"sleep": 0.5}
    assert client.call({"after": 3}, timeout=30) == {"after": 3}


@pytest.mark.timeout(60)
def test_error_types(client):
    with pytest.raises(InvalidRequestError, match="marked invalid"):
        client.call({"invalid": True}, timeout=30)
    with pytest.raises(PluginError, match="ZeroDivisionError: boom") as info:
        client.call({"raise": "ZeroDivisionError"}, timeout=30)
    assert "Traceback" not in str(info.value)
    assert client.call({"still": "serving"}, timeout=30) == {"still": "serving"}


@pytest.mark.timeout(60)
def test_ping_and_info(client):
    assert 0 < client.ping() < 5
    info = client.info()
    assert info["plugin"] == "tests.plugins:Echo" and info["mode"] == "inline"
    assert info["replicas"][0]["healthy"] is True
    assert {"phyrt", "protocol", "torch", "pyzmq", "msgpack"} <= info["versions"].keys()


# --------------------------------------------------------------------------- concurrency


@pytest.mark.timeout(90)
def test_many_threads_share_one_client(client):
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(25):
                payload = {"w": worker, "i": i, "x": np.full(3, worker * 100 + i, np.int32)}
                result = client.call(payload, timeout=30)
                assert result["w"] == worker and result["i"] == i
                assert result["x"].tolist() == [worker * 100 + i] * 3
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]


@pytest.mark.timeout(60)
def test_submit_from_a_callback_does_not_block(client):
    """What a ROS subscriber callback does: submit, and publish from the done callback."""
    published: list = []
    done = threading.Event()

    def on_result(future):
        published.append(future.result()["n"])
        if len(published) == 20:
            done.set()

    started = time.monotonic()
    for n in range(20):
        client.submit({"n": n, "sleep": 0.01}).add_done_callback(on_result)
    assert time.monotonic() - started < 0.5  # submits return at once
    assert done.wait(30)
    assert sorted(published) == list(range(20))


@pytest.mark.timeout(60)
def test_async_client(echo):
    async def scenario():
        async with AsyncClient(echo.address) as client:
            assert await client.ping() > 0
            assert (await client.info())["mode"] == "inline"
            results = await asyncio.gather(*(client.call({"i": i}, timeout=30) for i in range(20)))
            assert [r["i"] for r in results] == list(range(20))
            with pytest.raises(DeadlineExceededError):
                await client.call({"sleep": 1.0}, timeout=0.1)
            running = client.submit({"sleep": 0.5})
            queued = client.submit({"queued": 1})
            assert await client.cancel(queued) is True
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert (await running)["sleep"] == 0.5

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_closed_client_fails_pending_and_refuses_new_requests(echo):
    client = Client(echo.address)
    pending = client.submit({"sleep": 0.5})
    client.close()
    with pytest.raises(ConnectionLostError, match="closed"):
        pending.result(5)
    with pytest.raises(ConnectionLostError):
        client.submit({"x": 1})
    client.close()  # idempotent


# --------------------------------------------------------------------------- back-pressure


@pytest.mark.timeout(120)
def test_overloaded_beyond_max_inflight(tmp_path):
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--max-inflight", "1",
                      "--log-level", "warning", log_dir=tmp_path)
    try:
        with Client(server.address) as client:
            mark = tmp_path / "running"
            slow = client.submit({"sleep": 1.0, "mark": str(mark)})
            assert wait_until(mark.exists, 10)  # in flight on the server
            started = time.monotonic()
            with pytest.raises(OverloadedError, match="max-inflight 1"):
                client.call({"x": 1}, timeout=10)
            assert time.monotonic() - started < 0.9  # refused at once, not queued behind the 1 s request
            assert slow.result(10) == {"sleep": 1.0, "mark": str(mark)}
            assert client.call({"x": 2}, timeout=10) == {"x": 2}
    finally:
        assert server.stop() == 0, server.log()


# --------------------------------------------------------------------------- server loss and restart


@pytest.mark.timeout(180)
def test_server_death_fails_in_flight_requests_and_a_restart_is_reconnected(tmp_path):
    private = tmp_path / "sock"
    private.mkdir(mode=0o700)
    address = f"ipc://{private}/echo.sock"
    args = ("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", address, "--log-level", "warning")
    first = Launched(*args, log_dir=tmp_path, name="first")
    client = Client(address, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    second = None
    try:
        assert wait_until(lambda: client._session is not None and client._session.mapper is not None, 10)
        big = np.ones((1024, 256), np.float32)
        assert (client.call({"x": big}, timeout=30)["x"] == big).all()
        running = tmp_path / "running"
        in_flight = client.submit({"sleep": 30, "mark": str(running)})
        assert wait_until(running.exists, 10)  # the server runs it
        first.kill()  # SIGKILL: no goodbye
        started = time.monotonic()
        with pytest.raises(ConnectionLostError, match="lost"):
            in_flight.result(10)
        assert time.monotonic() - started < 5
        assert wait_until(lambda: shm_names_of(first.pids) == [], 5), shm_names_of(first.pids)

        second = Launched(*args, log_dir=tmp_path, name="second")
        assert wait_until(lambda: _answers(client), 30)
        assert (client.call({"x": big}, timeout=30)["x"] == big).all()  # a fresh shm session
    finally:
        client.close()
        if second is not None:
            assert second.stop() == 0, second.log()


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return all(state in ("T", "t") for state in states)


def _answers(client: Client) -> bool:
    try:
        return client.call({"up": 1}, timeout=2) == {"up": 1}
    except (ConnectionLostError, DeadlineExceededError, ServerUnavailableError):
        return False


@pytest.mark.timeout(120)
def test_a_silent_server_fails_in_flight_requests_after_the_heartbeat_timeout(tmp_path):
    server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--log-level", "warning",
                      log_dir=tmp_path)
    client = Client(server.address, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    try:
        assert client.call({"x": 1}, timeout=30) == {"x": 1}
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: _all_threads_stopped(server.proc.pid), 10)  # it takes a moment
            started = time.monotonic()
            with pytest.raises(ConnectionLostError, match="heartbeat_timeout_s"):
                client.submit({"x": 2}).result(10)
            assert time.monotonic() - started < 3
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert wait_until(lambda: _answers(client), 10)
    finally:
        client.close()
        assert server.stop() == 0, server.log()


# --------------------------------------------------------------------------- a wrong ipc:// address


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed server leaves its own."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


@pytest.mark.timeout(10)  # the old behaviour waited for heartbeat_timeout_s (20 s here), then "no word"
@pytest.mark.parametrize("kind, why", [("missing", "no socket at {path}"), ("file", "{path} is not a socket"),
                                       ("stale", "nothing listens at {path} (connection refused")])
def test_a_wrong_ipc_address_fails_each_request_at_once_naming_the_path(tmp_path, kind, why):
    path = tmp_path / "phyrt.sock"
    if kind == "file":
        path.write_text("not a socket")
    elif kind == "stale":
        _stale_socket(path)
    expected = re.escape(why.format(path=path))
    with Client(f"ipc://{path}", heartbeat_timeout_s=20.0) as client:
        with pytest.raises(ServerUnavailableError, match=expected):
            client.call({"x": 1}, timeout=30)
        with pytest.raises(ServerUnavailableError, match=expected):
            client.submit({"x": 1})
        with pytest.raises(ServerUnavailableError, match=expected):
            client.ping(timeout=30)


@pytest.mark.timeout(120)
def test_a_client_made_before_its_server_listens_is_served_once_it_does(tmp_path):
    private = tmp_path / "sock"
    private.mkdir(mode=0o700)
    address = f"ipc://{private}/echo.sock"
    _stale_socket(private / "echo.sock")  # a killed server's leftover, which the next one replaces
    with Client(address) as client:
        with pytest.raises(ServerUnavailableError, match="nothing listens at"):
            client.call({"x": 1}, timeout=30)
        server = Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", address,
                          "--log-level", "warning", log_dir=tmp_path)
        try:
            assert wait_until(lambda: _answers(client), 30)
            assert client.call({"x": 2}, timeout=30) == {"x": 2}
        finally:
            assert server.stop() == 0, server.log()


# --------------------------------------------------------------------------- the reader: callers read the socket


class _ReaderProbe:
    """Wraps ``Dealer.read`` (a caller holding the socket reads) and the link thread's read of one
    message (``Link._on_readable``) to learn which threads read, and the socket's ``recv`` to count
    how many threads are in it at once and whether each is the socket's holder (``strays``)."""

    def __init__(self, client: Client) -> None:
        self._lock = threading.Lock()
        self.inside = self.most = self.strays = 0
        self.readers: set[str] = set()
        link = client._link
        dealer = self._dealer = link.dealer
        dealer.read, link._on_readable = self._named(dealer.read), self._named(link._on_readable)
        dealer.sock.recv = self._counted(dealer.sock.recv)

    def _named(self, method):
        def probed(*args, **kwargs):
            with self._lock:
                self.readers.add(threading.current_thread().name)
            return method(*args, **kwargs)
        return probed

    def _counted(self, method):
        def probed(*args, **kwargs):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
                self.strays += self._dealer.role.holder != threading.get_ident()
            try:
                return method(*args, **kwargs)
            finally:
                with self._lock:
                    self.inside -= 1
        return probed


@pytest.mark.timeout(120)
def test_callers_and_submitters_at_once_each_get_their_own_replies(client):
    """Callers take turns reading the socket while other threads submit and ping: every reply
    reaches the request it answers (none lost, none swapped), and one thread reads at a time."""
    probe = _ReaderProbe(client)
    errors: list[BaseException] = []
    start = threading.Barrier(12)

    def caller(worker: int) -> None:
        try:
            start.wait(10)
            for i in range(60):
                tag = f"c{worker}-{i}"
                result = client.call({"tag": tag, "x": np.full(4, worker * 1000 + i, np.int64)}, timeout=30)
                assert result["tag"] == tag and result["x"].tolist() == [worker * 1000 + i] * 4
                if i % 20 == 0:
                    assert client.ping(10) > 0
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def submitter(worker: int) -> None:
        try:
            start.wait(10)
            futures = [(i, client.submit({"tag": f"s{worker}-{i}"})) for i in range(60)]
            for i, future in futures:
                assert future.result(30) == {"tag": f"s{worker}-{i}"}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = ([threading.Thread(target=caller, args=(w,), name=f"caller-{w}") for w in range(8)]
               + [threading.Thread(target=submitter, args=(w,), name=f"submitter-{w}") for w in range(4)])
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors[:3]
    assert probe.most == 1 and probe.strays == 0  # one reader at a time, the socket's holder
    assert len(client._link.awaited.table) == 0 and client._link.dealer.role.holder is None
    # under that load a caller that finds the socket held sleeps on its Slot (whether one found it
    # free is up to the scheduler); a caller that finds it free reads its own reply
    replies: list = []
    solo = threading.Thread(target=lambda: replies.append(client.call({"tag": "solo"}, timeout=30)), name="caller-solo")
    solo.start()
    solo.join(60)
    assert replies == [{"tag": "solo"}] and "caller-solo" in probe.readers


@pytest.mark.timeout(60)
def test_a_lone_caller_reads_its_own_reply(client):
    """The round trip of a lone caller involves no other thread of this process."""
    probe = _ReaderProbe(client)
    client.call({"warm": 1}, timeout=30)
    probe.readers.clear()
    for i in range(20):
        assert client.call({"i": i}, timeout=30) == {"i": i}
    assert probe.readers <= {threading.current_thread().name, "phyrt-client"}  # the I/O thread: heartbeats
    assert threading.current_thread().name in probe.readers


@pytest.mark.timeout(60)
def test_a_reading_caller_that_times_out_hands_over_to_the_others(client, tmp_path):
    """The caller reading the socket gives up at its deadline; one waiting behind it still gets its reply."""

    def slow(mark: Path, outcome: dict) -> None:
        try:
            client.call({"sleep": 1.0, "mark": str(mark)}, timeout=0.5)
        except DeadlineExceededError as exc:
            outcome["slow"], outcome["slow_at"] = exc, time.monotonic()

    assert client.call({"warm": 1}, timeout=30) == {"warm": 1}  # connected and registered
    for attempt in range(5):
        time.sleep(0.05)  # the client's I/O thread, woken as the last call left the socket, settles
        outcome: dict = {}
        mark = tmp_path / f"slow-{attempt}"
        thread = threading.Thread(target=slow, args=(mark, outcome))
        thread.start()
        # its request runs on the inline engine (the next call queues behind it), and it sleeps in
        # poll(2): it reads the socket itself (while the I/O thread reads, a caller waits on a lock)
        if wait_until(lambda: mark.exists() and polls(thread) and "slow" not in outcome, 0.3, 0.01):
            break
        thread.join(10)  # the I/O thread read for it: not the case this test is about; again
        assert client.call({"drain": attempt}, timeout=30) == {"drain": attempt}  # after its sleep
    else:
        pytest.fail("in 5 attempts the slow caller never read the socket itself")
    asked = time.monotonic()
    outcome["fast"] = client.call({"fast": 1}, timeout=30)
    answered = time.monotonic()
    thread.join(10)
    assert isinstance(outcome.get("slow"), DeadlineExceededError)
    assert outcome["fast"] == {"fast": 1}
    # the hand-over took place: this call was waiting when the reader gave up, and was answered after
    assert asked < outcome["slow_at"] < answered, (asked, outcome["slow_at"], answered)


@pytest.mark.timeout(60)
def test_closing_the_client_fails_a_call_that_is_reading(echo, tmp_path):
    def call(client: Client, mark: Path, outcome: dict) -> None:
        try:
            client.call({"sleep": 1.5, "mark": str(mark)}, timeout=30)
        except ConnectionLostError as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    for attempt in range(5):
        client = Client(echo.address)
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}  # connected and registered
        time.sleep(0.05)  # the client's I/O thread, woken as the warm-up call left the socket, settles
        outcome: dict = {}
        mark = tmp_path / f"running-{attempt}"
        thread = threading.Thread(target=call, args=(client, mark, outcome))
        thread.start()
        # its request runs on the server (after a previous attempt's, if any), and it sleeps in poll(2):
        # it reads the socket itself (while the I/O thread reads, a caller waits on a lock)
        if wait_until(lambda: mark.exists() and polls(thread) and "at" not in outcome, 3.0, 0.01):
            running = time.monotonic()
            break
        client.close()  # the I/O thread read for it: not the case this test is about; again
        thread.join(10)
    else:
        pytest.fail("in 5 attempts the caller never read the socket itself")
    client.close()
    thread.join(10)
    assert isinstance(outcome.get("error"), ConnectionLostError), outcome
    assert outcome["at"] - running < 1.2  # failed at close, not when the reply came (1.5 s after it ran)
    assert not client._link._thread.thread.is_alive()


@pytest.mark.timeout(60)
def test_done_callbacks_may_submit_from_the_thread_that_reads(client):
    """A submit() future completed by a reading caller runs its callbacks on that caller's thread;
    a callback that submits again neither blocks nor deadlocks, and its reply still comes."""
    chained: list[int] = []
    done = threading.Event()

    def on_done(future) -> None:
        n = future.result()["n"]
        chained.append(n)
        if n < 20:
            client.submit({"n": n + 1}).add_done_callback(on_done)
        else:
            done.set()

    client.submit({"n": 0}).add_done_callback(on_done)
    for i in range(40):  # meanwhile this thread calls, and so often reads the chain's replies
        assert client.call({"i": i}, timeout=30) == {"i": i}
    assert done.wait(30)
    assert sorted(chained) == list(range(21))


# --------------------------------------------------------------------------- the wire's fast paths


def _nested(levels: int) -> list:
    value: list = [1]
    for _ in range(levels - 1):
        value = [value]
    return value


_PAYLOADS = [
    1, None, "text", b"\x00\xff", 2.5, True, [1, 2.5, "x"], (1, 2), {"a": 1},
    {"task": "pick", "step": 3, "obs": [0.125 * i for i in range(8)], "done": False},
    {"nested": {"deeper": [{"x": [1, [2, [3]]]}, (4, 5)]}, "empty": {}, "none": None},
    {"np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(7)], "f64": np.float64(0.1)},
    {"buffers": [bytearray(b"ab"), memoryview(b"cd"), memoryview(np.arange(6, dtype=np.uint8))[::2]]},
    {"array": np.arange(12, dtype=np.float32).reshape(3, 4), "list_of_arrays": [np.ones(2, np.int16)] * 2},
    {"big": np.zeros(100_000, np.uint8), "small": np.ones(3)},  # shared memory when a place is given
    {"ordered": __import__("collections").OrderedDict(a=1), "ext": __import__("msgpack").ExtType(1, b"")},
    {"deep": _nested(30)},  # near MAX_DEPTH: the slow path counts the levels
]


@pytest.mark.parametrize("payload", _PAYLOADS, ids=range(len(_PAYLOADS)))
def test_the_packing_fast_path_gives_the_slow_paths_bytes(payload):
    import msgpack

    from runtime.transport.protocol import PayloadEncoder

    def place(nbytes):
        return "phyrt-0123456789abcdef-1-0", 64 * len(blocks), memoryview(bytearray(nbytes))

    blocks: list = []
    fast, slow = PayloadEncoder(copy=False, place=place, shm_threshold=1000), PayloadEncoder(copy=True, place=place,
                                                                                              shm_threshold=1000)
    packed = fast.pack(payload)
    assert packed.data == msgpack.packb(slow.encode(payload), use_bin_type=True)
    assert [bytes(f) for f in fast.frames] == [bytes(f) for f in slow.frames]
    assert fast.blocks == slow.blocks


@pytest.mark.parametrize("payload, error, match", [
    ({1: 2}, TypeError, "payload: map keys must be str"),
    ({"x": {"y": object()}}, TypeError, r"payload.x.y: cannot send a object"),
    ({"x": [set()]}, TypeError, r"payload.x\[0\]: cannot send a set"),
    ({"x": np.zeros(2, np.complex64)}, TypeError, "cannot be sent"),
    ({"x": _nested(40)}, ValueError, "nested deeper"),
    ({"x": 2**70}, OverflowError, "out of range"),
])
def test_the_packing_fast_path_refuses_what_the_slow_path_refuses(payload, error, match):
    from runtime.transport.protocol import PayloadEncoder

    with pytest.raises(error, match=match):
        PayloadEncoder(copy=False).pack(payload)


def test_a_header_with_a_packed_payload_is_the_plain_header():
    import msgpack

    from runtime.link.client_protocol import submit_message
    from runtime.transport.protocol import PayloadEncoder, pack_header

    payload = {"obs": [1.5, 2.5], "task": "t"}
    packed = PayloadEncoder(copy=False).pack(payload)
    for header in ({"v": 1, "op": "submit", "id": 7, "payload": packed},
                   {"v": 1, "op": "submit", "id": 2**40, "ok": True, "result": packed, "inputs_held": True}):
        plain = {k: (payload if v is packed else v) for k, v in header.items()}
        assert msgpack.unpackb(pack_header(header)) == plain
    for timeout, shm, release in ((None, False, None), (0.5, True, [["seg", 64]]), (3, False, []),
                                  (None, True, [["a", 0], ["b", 1 << 40]])):
        plain = {"v": 1, "op": "submit", "id": 9, "payload": payload}
        if timeout is not None:
            plain["timeout_s"] = float(timeout)
        if shm:
            plain["shm_results"] = True
        if release:
            plain["release"] = release
        message = submit_message(PayloadEncoder(copy=False), 9, timeout, shm, payload, release)
        assert message == pack_header({**plain, "payload": packed})
        assert msgpack.unpackb(message) == plain


def test_a_plain_payload_is_packed_without_an_encoder_into_the_same_bytes():
    import msgpack

    from runtime.link.client_protocol import plain_submit, submit_message
    from runtime.transport.protocol import PayloadEncoder

    plain = [{"obs": [1.5, 2.5], "task": "t", "n": None, "b": b"\x00\xff", "deep": {"x": [[1, 2], (3, 4)]}},
             [1, "two", 3.0], "text", 2**63, {}]
    for payload in plain:
        for timeout, shm, stream, priority in ((None, False, False, 0), (0.5, True, False, 7),
                                               (2, False, True, -2**31)):
            data = plain_submit(5, timeout, shm, payload, stream, priority)
            assert data == submit_message(PayloadEncoder(copy=False), 5, timeout, shm, payload, None, stream,
                                          priority)
            assert msgpack.unpackb(data).get("priority") == (priority or None)
    # a tensor, a numpy scalar, a map key that is not a str, an int past 64 bits: the encoder's
    # path takes them (and names what it refuses)
    for payload in ({"x": np.zeros(3, np.float32)}, {"x": np.float32(1.5)}, {1: "a"}, {"x": 2**70},
                    {"x": [np.int64(3)]}):
        assert plain_submit(5, None, False, payload) is None
    with pytest.raises(TypeError, match="payload: map keys must be str"):
        submit_message(PayloadEncoder(copy=False), 5, None, False, {1: "a"})


@pytest.mark.parametrize("raw, match", [
    # a msgpack Timestamp (extension -1) in each encoding msgpack accepts, not only the canonical ones
    (b"\x82\xa1v\x01\xa1t\xd6\xff\x00\x00\x00\x01", "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\xd7\xff" + bytes(8), "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\xc7\x0c\xff" + bytes(12), "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\xc7\x04\xff\x00\x00\x00\x01", "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\xc8\x00\x08\xff" + bytes(8), "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\xc9\x00\x00\x00\x04\xff\x00\x00\x00\x01", "Timestamp|timestamps"),
    (b"\x82\xa1v\x01\xa1t\x91\xc7\x04\xff\x00\x00\x00\x01", "Timestamp|timestamps"),  # inside a list
    (b"\x83\xa1v\x01\xa1k\x01\xa1k\x02", "duplicate"),  # duplicate keys
    (b"\x82\xa1v\x01\xc4\x01k\x01", "map keys must be str"),  # a bin (bytes) key
    (b"\x82\xa1v\x01\x01\x02", "malformed|not allowed"),  # an int key
])
def test_header_decoding_refuses_what_the_protocol_forbids(raw, match):
    from runtime.core.errors import ProtocolError
    from runtime.transport.protocol import unpack_header

    with pytest.raises(ProtocolError, match=match):
        unpack_header(raw, 1 << 20)
    with pytest.raises(ProtocolError, match=match):  # the same as a zmq frame's buffer (the slow path)
        unpack_header(memoryview(bytearray(raw + bytes(5000)))[:len(raw)], 1 << 20)


def test_header_decoding_fast_and_slow_paths_agree():
    import msgpack

    from runtime.transport.protocol import _Ext, unpack_header

    payload = {"a": [1, 2.5, "x", b"\xff\xd6"], "t": msgpack.ExtType(1, b"\x93\xa5uint8\x91\x02\x00")}
    header = {"v": 1, "op": "submit", "id": 3, "payload": payload}
    raw = msgpack.packb(header, use_bin_type=True)
    refs: list = []
    fast = unpack_header(raw, 1 << 20, refs)
    slow = unpack_header(memoryview(bytearray(raw + bytes(5000)))[:len(raw)], 1 << 20)
    assert fast == slow and len(refs) == 1 and isinstance(refs[0], _Ext)
    assert fast["payload"]["a"] == [1, 2.5, "x", b"\xff\xd6"]  # bytes that look like a Timestamp mark


@pytest.mark.timeout(60)
def test_submit_snapshots_tensor_frames_that_a_reader_sends_later(client):
    """While another thread reads (and so holds the socket), submit() cannot send at once: it
    queues a snapshot, so changing the array after submit returns changes nothing sent."""
    reader = threading.Thread(target=client.call, args=({"sleep": 0.6},), kwargs={"timeout": 30})
    reader.start()
    assert wait_until(lambda: client._link.dealer.polling, 5)  # the reader sleeps in poll, holding the socket
    arrays = [np.arange(1000, dtype=np.int32) + i for i in range(5)]  # 4 KB: frames, not shared memory
    futures = [client.submit({"x": a}) for a in arrays]
    for a in arrays:
        a[:] = -1
    for i, future in enumerate(futures):
        assert future.result(30)["x"].tolist() == list(range(i, 1000 + i))
    reader.join(30)
