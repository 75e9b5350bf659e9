"""runtime.link.lane: a same-host client's plain submits and their replies go by shared memory and
a pipe each way, past libzmq; everything else, and every failure, keeps the ZeroMQ path."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import threading

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from runtime.client import Client, ConnectionLostError
from runtime.core.errors import ProtocolError
from runtime.link import lane as lane_mod
from runtime.link.lane import LANE_BYTES, MAX_UNREAD_REQUESTS, RING_BYTES, Doorbell, Ring
from tests.conftest import engine_args
from tests.test_client import _answers
from tests.test_launch import ROOT, Launched, shm_names_of, wait_until


# --------------------------------------------------------------------------- the ring


def _ring(max_unread: int = 1 << 30) -> tuple[Ring, Ring, bytearray]:
    """A writer's and a reader's Ring over one buffer (as two processes map one block)."""
    buf = bytearray(LANE_BYTES)
    return Ring(memoryview(buf), 0, max_unread), Ring(memoryview(buf), 0, max_unread), buf


@pytest.mark.timeout(60)
def test_a_ring_gives_back_every_message_in_order_across_many_wraps():
    writer, reader, _ = _ring()
    rng = random.Random(7)
    model: collections.deque[bytes] = collections.deque()
    for _ in range(20000):
        if rng.random() < 0.55:
            data = [rng.randbytes(rng.choice([0, 1, 7, 8, 100, 4000, RING_BYTES // 8]))
                    for _ in range(rng.choice([1, 1, 2, 3]))]
            if writer.put(data):
                model.append(data)
            else:  # refused only when too large, or when it cannot fit now (a wrap skips < its size)
                assert _size(data) > RING_BYTES // 4 or sum(_size(m) for m in model) + _size(data) > RING_BYTES // 2
        else:
            assert reader.get() == (model.popleft() if model else None)
    while model:
        assert reader.get() == model.popleft()
    assert reader.get() is None


def _size(parts: list[bytes]) -> int:
    return (8 + 4 * len(parts) + sum(map(len, parts)) + 7) & ~7


@pytest.mark.timeout(30)
def test_a_ring_refuses_what_does_not_fit_and_past_its_unread_count():
    writer, reader, _ = _ring(max_unread=3)
    assert not writer.put([b"x" * (RING_BYTES // 4)])  # a message takes at most a quarter
    assert writer.put([b"a"]) and writer.put([b"b"]) and writer.put([b"c"])
    assert not writer.put([b"d"])  # 3 unread
    assert reader.get() == [b"a"]
    assert writer.put([b"d"])
    writer2, reader2, _ = _ring()
    big = [b"y" * (RING_BYTES // 4 - 16)]
    assert [writer2.put(big) for _ in range(5)] == [True, True, True, True, False]  # full
    assert reader2.get() == big and writer2.put(big)


@pytest.mark.timeout(30)
def test_tensor_frames_go_as_their_bytes_and_a_strided_one_is_refused():
    writer, reader, _ = _ring()
    frame = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert writer.put([b"head", memoryview(frame), frame[:, 0].copy()])
    head, first, second = reader.get()
    assert head == b"head" and first == frame.tobytes() and second == frame[:, 0].tobytes()
    assert not writer.put([b"head", memoryview(frame[:, ::2])])  # not contiguous: libzmq takes it


@pytest.mark.timeout(30)
def test_a_corrupt_length_is_an_error_not_a_read_past_the_ring():
    for forged in (RING_BYTES, 12):  # past the ring; parts longer than the message
        writer, reader, buf = _ring()
        assert writer.put([b"hello", b"world"])
        if forged == RING_BYTES:
            buf[64:68] = forged.to_bytes(4, "little")  # the first message's length
        else:
            buf[72:76] = (100).to_bytes(4, "little")  # its first part's length
        with pytest.raises(ValueError, match="corrupt"):
            reader.get()


@pytest.mark.timeout(30)
def test_the_doorbell_hands_out_whole_lane_ids_in_order():
    bell = Doorbell()
    try:
        assert bell.max_lanes >= (1 << 16) // (4 * MAX_UNREAD_REQUESTS)
        os.write(bell.writer, (1).to_bytes(4, "little") + (70000).to_bytes(4, "little")[:2])
        assert bell.read() == [1]  # half an id waits for the rest
        os.write(bell.writer, (70000).to_bytes(4, "little")[2:] + (5).to_bytes(4, "little"))
        assert bell.read() == [70000, 5]
        assert bell.read() == []
    finally:
        bell.close()


# --------------------------------------------------------------------------- a served engine


def _serve(tmp_path, **options):
    """A started ``Server`` over an inline ``tests.plugins:Echo`` engine (CPU) in this process, on ipc://."""
    from runtime import Engine
    from runtime.serving.server import Server

    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    return Server(Engine(engine_args("tests.plugins:Echo")), f"ipc://{private}/s.sock", **options).start()


@pytest.fixture
def served(tmp_path):
    server = _serve(tmp_path)
    yield server
    server.close(5)


def _lane_counts(server) -> list[tuple[int, int]]:
    """Per client lane: (requests it put in its ring, replies the server put in its), from the rings'
    own counters in shared memory."""
    out = []
    for client in server._messages.shm._clients.values():
        if client.lane is not None:
            requests, replies = client.lane.requests, client.lane.replies
            out.append((int.from_bytes(requests._buf[24:32], "little"),
                        int.from_bytes(replies._buf[replies._base + 24:replies._base + 32], "little")))
    return out


def _lane_up(client: Client) -> bool:
    return client._link._shm.lane is not None


@pytest.mark.timeout(60)
def test_plain_calls_go_by_the_lane_and_tensors_still_by_shared_memory(served):
    with Client(served.address) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        assert wait_until(lambda: _lane_up(client), 10)
        for i in range(200):
            assert client.call({"i": i, "s": "x" * (i % 50)}, timeout=30) == {"i": i, "s": "x" * (i % 50)}
        [(requests, replies)] = _lane_counts(served)
        assert requests >= 200 and replies >= 200
        obs = np.arange(32, dtype=np.float32).reshape(1, 32)  # a tensor frame: by the lane too
        for i in range(20):
            out = client.call({"obs": obs + i}, timeout=30)["obs"]
            assert out.dtype == np.float32 and (out == obs + i).all()
        assert _lane_counts(served)[0][0] >= requests + 20
        big = np.arange(64 * 1024, dtype=np.float32)
        before = _lane_counts(served)[0][0]
        assert (client.call({"x": big}, timeout=30)["x"] == big).all()  # in shared memory, by the lane too
        # the arena's first segment went by the lane (its register, then the submit)
        assert _lane_counts(served)[0][0] == before + 2
        assert client._link._shm.current.registers_by_lane


@pytest.mark.timeout(120)
def test_a_growing_arena_registers_by_the_lane_ahead_of_the_submits_that_use_it(served):
    """Tensors in shared memory go by the lane; each new segment of the client's arena is registered
    by the lane first, so the server (which handles the lanes first) never sees a block of a
    segment it was not told of. Many in flight at once make the arena grow several times."""
    with Client(served.address) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        assert wait_until(lambda: _lane_up(client), 10)
        arrays = [np.full(((1 << 20) + 4096 * k) // 4, k, dtype=np.float32) for k in range(24)]  # ~24 MiB
        for _ in range(3):
            futures = [client.submit({"k": k, "x": a}) for k, a in enumerate(arrays)]
            for k, future in enumerate(futures):
                got = future.result(60)
                assert got["k"] == k and (got["x"] == arrays[k]).all()
        session = client._link._shm.current
        assert session.registers_by_lane and len(session.arena.segments) > 1
        assert sum(requests for requests, _ in _lane_counts(served)) >= 3 * 24 + len(session.arena.segments)


@pytest.mark.timeout(60)
def test_a_register_the_lane_refused_keeps_submits_with_blocks_off_the_lane(served, monkeypatch):
    """A segment registered by ZeroMQ (the ring refused its register) could be overtaken by a submit
    on the lane, which the server handles first: from then on submits with blocks go by ZeroMQ too,
    behind it; plain ones keep the lane."""
    with Client(served.address) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        assert wait_until(lambda: _lane_up(client), 10)
        lane = client._link._shm.current.lane
        send = lane.send
        monkeypatch.setattr(lane, "send", lambda frames: b"register" not in bytes(frames[0]) and send(frames))
        big = np.arange(64 * 1024, dtype=np.float32)
        before = _lane_counts(served)[0][0]
        for i in range(5):
            assert (client.call({"x": big + i}, timeout=30)["x"] == big + i).all()
        assert not client._link._shm.current.registers_by_lane
        assert _lane_counts(served)[0][0] == before  # neither the register nor the submits
        assert client.call({"plain": 1}, timeout=30) == {"plain": 1}
        assert _lane_counts(served)[0][0] == before + 1


@pytest.mark.timeout(60)
def test_a_connected_client_has_its_lane_before_its_first_request(served):
    """The lane's answer is read as soon as it comes (not with a later request's reply), so requests
    of clients made together all go by their lanes, in the order they were sent."""
    with Client(served.address) as first, Client(served.address) as second:
        assert wait_until(lambda: _lane_up(first) and _lane_up(second), 10)
        assert [c.call({"c": i}, timeout=30) for i, c in enumerate((first, second))] == [{"c": 0}, {"c": 1}]
        assert sorted(requests for requests, _ in _lane_counts(served)) == [1, 1]


@pytest.mark.timeout(120)
def test_threads_submitting_past_the_rings_bounds_get_every_answer(served):
    """Four clients, threads submitting 300 at once (more than a ring takes unread): each future gets
    its own answer, by whichever path it went."""
    errors: list[BaseException] = []

    def pipeline(worker: int) -> None:
        try:
            with Client(served.address) as client:
                client.call({"warm": worker}, timeout=30)
                wait_until(lambda: _lane_up(client), 10)
                for _ in range(3):
                    futures = [client.submit({"w": worker, "n": n}) for n in range(300)]
                    assert [f.result(30) for f in futures] == [{"w": worker, "n": n} for n in range(300)]
                    for i in range(50):
                        assert client.call({"w": worker, "i": i}, timeout=30) == {"w": worker, "i": i}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pipeline, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors[:3]
    assert all(requests > 0 for requests, _ in _lane_counts(served))


@pytest.mark.timeout(60)
def test_without_the_lane_everything_goes_by_zeromq(served, monkeypatch):
    monkeypatch.setenv("PHYRT_LANE", "0")
    with Client(served.address) as client:
        for i in range(50):
            assert client.call({"i": i}, timeout=30) == {"i": i}
        assert not _lane_up(client) and _lane_counts(served) == []


@pytest.mark.timeout(60)
def test_a_server_that_refuses_the_lane_serves_by_zeromq(served, monkeypatch):
    from runtime.link.peer_shm import PeerSessions

    def refuse(self, *args):
        raise ProtocolError("no lanes here")

    monkeypatch.setattr(PeerSessions, "open_lane", refuse)
    with Client(served.address) as client:
        big = np.ones((256, 256), np.float32)
        for i in range(50):
            assert client.call({"i": i}, timeout=30) == {"i": i}
        assert (client.call({"x": big}, timeout=30)["x"] == big).all()  # shared memory itself stays
        assert not _lane_up(client)


def _raw_session(address: str, tmp_path):
    """A raw DEALER with a registered shm session (one lane-sized segment), as a client would have."""
    from runtime.transport.arena import ShmArena, new_run_id

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(address)
    arena = ShmArena(new_run_id(), LANE_BYTES)
    segment, offset, _ = arena.place(LANE_BYTES)
    sock.send(msgpack.packb({"v": 1, "op": "register", "id": "r", "run_id": arena.run_id,
                             "segments": [], "pid": os.getpid()}))
    assert msgpack.unpackb(sock.recv())["ok"] is True
    return ctx, sock, arena, segment, offset


@pytest.mark.timeout(60)
def test_a_bad_lane_request_is_refused_and_the_server_keeps_serving(served, tmp_path):
    ctx, sock, arena, segment, offset = _raw_session(served.address, tmp_path)
    regular = open(tmp_path / "file", "wb")
    r, w = os.pipe()
    try:
        def lane(**fields):
            sock.send(msgpack.packb({"v": 1, "op": "lane", "id": "lane", **fields}))
            return msgpack.unpackb(sock.recv())

        bad = [dict(segment=segment, offset=offset),  # no fd
               dict(segment=segment, offset="0", fd=w),
               dict(segment=segment, offset=offset, fd=True),
               dict(segment=segment, offset=offset, fd=-1),
               dict(segment="phyrt-nope-1-1", offset=0, fd=w),  # not a name of its run
               dict(segment=f"phyrt-{arena.run_id}-{os.getpid()}-99999", offset=0, fd=w),  # no such segment
               dict(segment=segment, offset=offset + 4096, fd=w),  # reaches past the segment
               dict(segment=segment, offset=offset, fd=regular.fileno()),  # not a pipe
               dict(segment=segment, offset=offset, fd=1 << 20)]  # no such descriptor
        for fields in bad:
            reply = lane(**fields)
            assert reply["ok"] is False and reply["error"]["type"] == "InvalidRequest", (fields, reply)
        good = lane(segment=segment, offset=offset, fd=w)
        assert good["ok"] is True and set(good["result"]) == {"pid", "fd", "lane"}
        again = lane(segment=segment, offset=offset, fd=w)
        assert again["ok"] is False and "already" in again["error"]["message"]
        with Client(served.address) as client:
            assert client.call({"still": "serving"}, timeout=30) == {"still": "serving"}
    finally:
        regular.close()
        os.close(r)
        os.close(w)
        sock.close(0)
        ctx.term()
        arena.close()


@pytest.mark.timeout(60)
def test_a_lane_without_a_registered_session_is_refused(served):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(served.address)
    try:
        sock.send(msgpack.packb({"v": 1, "op": "lane", "id": "lane", "segment": "x", "offset": 0, "fd": 3}))
        reply = msgpack.unpackb(sock.recv())
        assert reply["ok"] is False and reply["error"]["type"] == "InvalidRequest"
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_clients_that_come_and_go_leave_no_descriptor_or_segment_in_either_process(tmp_path):
    """Client and server in this process: each client's pipe and lane go at its close, the server's
    end of a lane with the session (dropped once silent for client_timeout_s)."""
    me = psutil.Process()
    before_shm = shm_names_of({os.getpid()})
    server = _serve(tmp_path, client_timeout_s=0.5)
    try:
        with Client(server.address) as client:  # the server's doorbell exists now
            client.call({"warm": 1}, timeout=30)
        assert wait_until(lambda: _lane_counts(server) == [], 10)
        before = me.num_fds()
        for _ in range(5):
            with Client(server.address) as client:
                assert client.call({"x": 1}, timeout=30) == {"x": 1}
                assert wait_until(lambda: _lane_up(client), 10)
        assert wait_until(lambda: _lane_counts(server) == [] and me.num_fds() <= before, 10), (before, me.num_fds())
        assert shm_names_of({os.getpid()}) == before_shm
    finally:
        server.close(5)


CLIENT_LOOP = """
import sys
from runtime.client import Client
client = Client(sys.argv[1])
print(client.call({"up": 1}, timeout=30), flush=True)
while True:
    client.call({"x": 1}, timeout=30)
"""


@pytest.mark.timeout(120)
def test_a_client_killed_mid_call_leaves_the_server_serving_and_no_lane(served):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_LOOP, served.address], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "{'up': 1}"
        assert wait_until(lambda: len(_lane_counts(served)) == 1, 10)
        proc.kill()
        proc.wait(10)
        with Client(served.address) as client:
            for i in range(100):
                assert client.call({"i": i}, timeout=30) == {"i": i}
        served._messages.housekeeping(float("inf"))  # what the server does each second: drop gone clients
        assert len(_lane_counts(served)) <= 1  # at most the live client's lane
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.timeout(180)
def test_a_server_killed_mid_call_fails_it_and_a_new_one_gets_a_new_lane(tmp_path):
    private = tmp_path / "sock"
    private.mkdir(mode=0o700)
    address = f"ipc://{private}/echo.sock"
    args = ("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", address, "--log-level", "warning")
    first = Launched(*args, log_dir=tmp_path, name="first")
    client = Client(address, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
    second = None
    try:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        assert wait_until(lambda: _lane_up(client), 10)
        running = tmp_path / "running"
        in_flight = client.submit({"sleep": 30, "mark": str(running)})  # by the lane
        assert wait_until(running.exists, 10)
        first.kill()
        with pytest.raises(ConnectionLostError):
            in_flight.result(10)
        with pytest.raises(Exception):  # the lane is gone with its server: by ZeroMQ, which fails
            client.call({"after": 1}, timeout=2)
        assert wait_until(lambda: shm_names_of(first.pids) == [], 5)
        second = Launched(*args, log_dir=tmp_path, name="second")
        assert wait_until(lambda: _answers(client), 30)
        assert wait_until(lambda: _lane_up(client), 10)
        for i in range(50):
            assert client.call({"i": i}, timeout=30) == {"i": i}
    finally:
        client.close()
        if second is not None:
            assert second.stop() == 0, second.log()


def test_the_lane_module_needs_no_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, runtime.link.lane, runtime.client; "
                          "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    assert lane_mod.LANE_BYTES == 2 * (64 + RING_BYTES)
