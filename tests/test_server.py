"""runtime.serving.server behind ``python -m runtime.launch --devices 0,1,2,3 --replicas 2 --device cpu``.

One launched server (2 replicas x 2 CPU ranks, gloo, the ``policy`` demo) serves the
whole module; clients run in this process and in other processes. The last test
stops it with SIGTERM and proves nothing is left.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from runtime.client import Client, DeadlineExceededError, InvalidRequestError
from tests.test_launch import ROOT, Launched, free_port, shm_names_of, wait_until

#: oversized-message tests need a small limit; real payloads here are far below it
MAX_MESSAGE_BYTES = 1 << 20
MALFORMED = 10_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    launched = Launched("--devices", "0,1,2,3", "--replicas", "2", "--device", "cpu",
                        "--base-port", str(free_port(2)), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                        "--log-level", "warning", log_dir=tmp_path_factory.mktemp("server"))
    yield launched
    if launched.proc.returncode is None:
        assert launched.stop() == 0, launched.log()


@pytest.fixture(scope="module")
def inline_policy():
    """The reference: the same plugin, inline, in this process, on the CPU as the server's ranks are."""
    import torch

    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig

    engine = Engine(EngineArgs(plugin="policy", config=EngineConfig(device=DeviceConfig(target="cpu"))))

    def actions(obs: np.ndarray) -> np.ndarray:
        return engine.step({"obs": torch.from_numpy(obs)})["actions"].numpy()

    yield actions
    engine.close()


def _median_latency(client: Client, obs: np.ndarray, calls: int = 60) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        client.call({"obs": obs}, timeout=60)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


# --------------------------------------------------------------------------- answers


@pytest.mark.timeout(60)
def test_ready_line_reports_the_local_topology(server):
    f = server.fields
    assert (f["mode"], f["replicas"], f["ranks_per_replica"], f["device"], f["backend"]) == \
        ("local", "2", "2", "cpu", "gloo")
    assert f["address"].startswith("ipc://")
    assert len(server.pids) >= 5  # launch and four ranks


@pytest.mark.timeout(120)
def test_answers_match_the_inline_policy(server, inline_policy):
    rng = np.random.default_rng(0)
    with Client(server.address) as client:
        info = client.info(timeout=30)
        assert info["mode"] == "local" and info["replica_count"] == 2 and info["ranks_per_replica"] == 2
        assert all(r["healthy"] for r in info["replicas"])
        assert info["device"] == "cpu" and info["backend"] == "gloo"
        for batch in (1, 4, 2048):  # 2048 x 32 floats go by shared memory, and so do their actions
            obs = rng.standard_normal((batch, 32), dtype=np.float32)
            futures = [client.submit({"obs": obs}) for _ in range(4)]  # both replicas
            for future in futures:
                actions = future.result(60)["actions"]
                assert actions.shape == (batch, 8, 7) and actions.dtype == np.float32
                np.testing.assert_allclose(actions, inline_policy(obs), atol=1e-5)
        assert client._session is not None and client._session.announced


@pytest.mark.timeout(180)
def test_eight_concurrent_client_processes(server, inline_policy, tmp_path):
    code = """
import sys
sys.modules["torch"] = None
import numpy as np
from runtime.client import Client
address, seed, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
obs = np.random.default_rng(seed).standard_normal((15, 2, 32), dtype=np.float32)
with Client(address) as client:
    np.save(path, np.stack([client.call({"obs": o}, timeout=120)["actions"] for o in obs]))
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, server.address, str(seed), str(tmp_path / f"{seed}.npy")],
                              cwd=ROOT, stderr=subprocess.PIPE, text=True) for seed in range(8)]
    for proc in procs:
        _, err = proc.communicate(timeout=170)
        assert proc.returncode == 0, err
    for seed in range(8):
        obs = np.random.default_rng(seed).standard_normal((15, 2, 32), dtype=np.float32)
        got = np.load(tmp_path / f"{seed}.npy")
        np.testing.assert_allclose(got, np.stack([inline_policy(o) for o in obs]), atol=1e-5)


@pytest.mark.timeout(60)
def test_deadline_on_local_replicas(server):
    with Client(server.address) as client:
        obs = np.ones((1, 32), np.float32)
        with pytest.raises(DeadlineExceededError, match="still running"):
            client.submit({"obs": obs}, timeout=1e-6).result(30)
        assert wait_until(lambda: client.info()["inflight"] == 0, 10)  # its result came and was dropped
        assert client.call({"obs": obs}, timeout=30)["actions"].shape == (1, 8, 7)


@pytest.mark.timeout(60)
def test_cancel_is_refused_on_local_replicas(server):
    with Client(server.address) as client:
        obs = np.ones((1, 32), np.float32)
        future = client.submit({"obs": obs})
        assert client.cancel(future) is False  # local ranks run what they were sent
        assert future.result(30)["actions"].shape == (1, 8, 7)


@pytest.mark.timeout(60)
def test_plugin_validation_rejects_bad_requests(server):
    with Client(server.address) as client:
        with pytest.raises(InvalidRequestError, match="shape"):
            client.call({"obs": np.ones((2, 5), np.float32)}, timeout=30)
        with pytest.raises(InvalidRequestError, match="float32"):
            client.call({"obs": np.ones((2, 32), np.float64)}, timeout=30)
        with pytest.raises(InvalidRequestError, match="NaN"):
            client.call({"obs": np.full((1, 32), np.nan, np.float32)}, timeout=30)
        assert all(r["healthy"] for r in client.info()["replicas"])


# --------------------------------------------------------------------------- untrusted input


@pytest.mark.timeout(240)
def test_malformed_inputs_do_not_stop_or_slow_the_server(server, tmp_path):
    obs = np.ones((1, 32), np.float32)
    with Client(server.address) as good:
        before = _median_latency(good, obs)
        served, failures = [0], []
        stop = threading.Event()

        def keep_calling() -> None:  # a good client keeps being served meanwhile
            while not stop.is_set():
                try:
                    good.call({"obs": obs}, timeout=60)
                    served[0] += 1
                except Exception as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)

        caller = threading.Thread(target=keep_calling)
        caller.start()
        try:
            out = subprocess.run([sys.executable, "-c", "import sys; from tests.test_server import fuzz; "
                                  "fuzz(sys.argv[1], int(sys.argv[2]), 7)", server.address, str(MALFORMED)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=200)
        finally:
            stop.set()
            caller.join(60)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        assert stats["sent"] >= MALFORMED
        assert stats["errors"] == stats["expected_errors"], stats
        assert stats["bad_replies"] == [], stats["bad_replies"][:5]
        assert not failures, failures[:3]
        assert served[0] > 0
        after = _median_latency(good, obs)
        assert after < max(3 * before, before + 0.010), (before, after)  # loose: the machine is shared
        info = good.info()
        assert all(r["healthy"] for r in info["replicas"]) and info["inflight"] == 0
    assert server.proc.poll() is None


def fuzz(address: str, count: int, seed: int) -> None:
    """Send ``count`` malformed messages (and a few oversized ones), check each answer.

    Prints one JSON line: sent, expected_errors, errors, bad_replies (answers that
    are not an InvalidRequest error, or that carry a traceback).
    """
    import random

    import msgpack
    import zmq

    from runtime.transport.arena import ShmArena, new_run_id

    rng = random.Random(seed)
    P = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    Ext = msgpack.ExtType
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    run_id = new_run_id()
    arena = ShmArena(run_id, 1 << 20)
    segment = arena.segments[0]
    other = ShmArena(new_run_id(), 1 << 16)  # a real segment of another run

    def submit(payload, frames=(), **extra):
        return [P({"v": 1, "op": "submit", "id": rng.randrange(1 << 30), "payload": payload, **extra}), *frames]

    def frame_ref(dtype, shape, index):
        return Ext(1, P([dtype, shape, index]))

    def shm_ref(seg, offset, dtype="float32", shape=(4,)):
        return Ext(2, P([seg, offset, dtype, list(shape)]))

    f32 = np.ones((1, 32), np.float32).tobytes()
    kinds = [
        lambda: [rng.randbytes(rng.randrange(0, 300))],
        lambda: [P(rng.choice([1, "x", [1, 2], None, 3.5, b"b", True]))],
        lambda: [P(rng.choice([{"op": "ping", "id": 1}, {"v": 2, "op": "ping", "id": 1},
                               {"v": "1", "op": "ping", "id": 1}, {"v": True, "op": "ping", "id": 1}]))],
        lambda: [P({"v": 1, "op": rng.choice(["shutdown", "", "exec", 5, None, ["submit"], "SUBMIT"]), "id": 1})],
        lambda: [P({"v": 1, "op": "ping", "id": rng.choice([1.5, -1, -2**63, "", "x" * 129, True, [1], {"a": 1}])})],
        lambda: [P({"v": 1, "op": rng.choice(["ping", "info"]), "id": 1, rng.choice(["extra", "debug"]): 1})],
        lambda: submit({"obs": 1}, urgency=9),  # an unknown field
        lambda: submit({"obs": 1}, priority=rng.choice(["high", 1.5, True, None, [1], {"p": 1}, 2**40, -2**63])),
        lambda: [rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xffabc",
                             b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",
                             b"\x84" + P("v") + P(1) + P("op") + P("submit") + P("id") + P(1) + P("payload")
                             + b"\xdd\x7f\xff\xff\xff"]) + rng.randbytes(rng.randrange(0, 16))],
        lambda: submit({"obs": frame_ref(rng.choice(["complex64", 5, None, "float128"]), [1, 32], 0)}, [f32]),
        lambda: submit({"obs": frame_ref("float32", rng.choice([[-1], [2**41], [1] * 17, "abc", [1.5]]), 0)},
                       [f32]),
        lambda: submit({"obs": frame_ref("float32", [1, 32], rng.choice([1, 5, -1, True, "0", 2**63]))}, [f32]),
        lambda: submit({"obs": frame_ref("float32", [rng.randrange(2, 9), 32], 0)}, [f32]),  # size mismatch
        lambda: submit({"obs": frame_ref("float32", [1, 32], 0), "again": frame_ref("float32", [1, 32], 0)},
                       [f32]),
        lambda: submit({"obs": 1}, [f32]),  # a frame nothing refers to
        lambda: submit({"obs": Ext(1, rng.randbytes(rng.randrange(0, 12)))}, [f32]),
        lambda: submit({"obs": Ext(rng.choice([0, 3, 7, 99]), b"\x90")}),
        lambda: submit({"obs": frame_ref("float32", [0], 0)}, [b""] * 257),
        lambda: submit({"obs": shm_ref(rng.choice(["phyrt-deadbeef-1-0", "../../etc/passwd", "/dev/shm/x", "",
                                                   f"phyrt-{run_id}-1-99", other.segments[0], segment]),
                                       rng.choice([0, 2**62, 12]))}),
        lambda: submit({"obs": shm_ref(segment, rng.choice([-8, 2**40, (1 << 20) - 8, 2, True]),
                                       shape=rng.choice([(1, 32), (4,), (2**30,)]))}),
        lambda: [P({"v": 1, "op": "register", "id": 1, "run_id": rng.choice([run_id, "XYZ", 5, "a" * 40, None]),
                    "segments": rng.choice([[other.segments[0]], ["../x"], [f"phyrt-{run_id}-1-0"], "seg", [5],
                                            [segment] * 65])})],
        lambda: submit([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
        lambda: [P({"v": 1, "op": "submit", "id": 1, "payload": None})[:-1] + b"\x91" * 5000 + b"\xc0"],
        lambda: submit({"obs": msgpack.Timestamp(1, 2)}),
        lambda: [P({"v": 1, "op": rng.choice(["ping", "info"]), "id": 1}), f32],
        lambda: submit({"obs": frame_ref("float32", [1, 32], 0), "extra": 1}, [f32]),  # the plugin refuses it
        lambda: submit({"obs": frame_ref(rng.choice(["int32", "float64"]), [1, 8], 0)},
                       [np.ones(8, np.float64).tobytes()]),  # a size mismatch, or a dtype the plugin refuses
        lambda: submit({"obs": frame_ref("float32", [1, 32], 0)}, [np.full(32, np.nan, np.float32).tobytes()]),
        lambda: submit({"obs": 1}, timeout_s=rng.choice([0, -1, float("inf"), "1", True, 1e9])),
        lambda: submit({"obs": 1}, shm_results=rng.choice([1, "yes", None])),
        lambda: [P({"v": 1, "op": "cancel", "id": 1, "target": rng.choice([None, -5, 1.5, [1]])})],
        lambda: [b""],
    ]
    no_reply = [
        lambda: [P({"v": 1, "op": "release", "id": 1, "blocks": rng.choice([[["x", 1]], "junk", [[1, 2, 3]],
                                                                              [[segment, 0]], [[[], {}]]])})],
    ]

    replies: list[dict] = []
    bad: list[str] = []

    def drain(wait_ms: int = 0) -> None:
        while sock.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            frames = sock.recv_multipart()
            try:
                header = msgpack.unpackb(frames[0], raw=False)
            except Exception as exc:  # noqa: BLE001
                bad.append(f"undecodable reply: {exc}")
                continue
            replies.append(header)
            err = header.get("error") or {}
            if header.get("ok") is not False or err.get("type") != "InvalidRequest" \
                    or "Traceback" in str(err.get("message")):
                bad.append(repr(header)[:300])

    # one legitimate registration, so that offsets and sizes inside a real segment get checked
    sock.send_multipart([P({"v": 1, "op": "register", "id": "reg", "run_id": run_id, "segments": [segment]})])
    if not sock.poll(10_000, zmq.POLLIN):
        raise SystemExit("no answer to the registration")
    reg = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    if reg.get("ok") is not True:
        raise SystemExit(f"registration refused: {reg}")

    sent = expected = 0
    while sent < count:
        if rng.random() < 0.03:
            sock.send_multipart(rng.choice(no_reply)())
        else:
            sock.send_multipart(rng.choice(kinds)())
            expected += 1
        sent += 1
        if sent % 200 == 0:
            drain()
    deadline = time.monotonic() + 60
    while len(replies) < expected and time.monotonic() < deadline:
        drain(200)

    # oversized messages: dropped by MAXMSGSIZE with their sender's connection, never answered
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(address)
    for _ in range(5):
        big.send_multipart([P({"v": 1, "op": "submit", "id": 1, "payload": None}), b"\0" * (2 * MAX_MESSAGE_BYTES)])
    time.sleep(0.5)
    big.close()
    sent += 5

    sock.close()
    ctx.term()
    arena.close()
    other.close()
    print(json.dumps({"sent": sent, "expected_errors": expected, "errors": len(replies), "bad_replies": bad}))


# --------------------------------------------------------------------------- examples


@pytest.mark.timeout(120)
def test_client_call_example(server):
    out = subprocess.run([sys.executable, "examples/client_call.py", "--address", server.address, "--calls", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert "mode=local 2 replica(s) x 2 rank(s) on cpu" in out.stdout
    assert "actions (4, 8, 7) float32" in out.stdout
    assert "20 calls: p50" in out.stdout


@pytest.mark.timeout(120)
def test_async_client_example(server):
    out = subprocess.run([sys.executable, "examples/async_client.py", "--address", server.address],
                         cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert "16 concurrent requests" in out.stdout and "actions (1, 8, 7) float32" in out.stdout
    assert "deadline: DeadlineExceededError" in out.stdout


# --------------------------------------------------------------------------- shutdown (last)


@pytest.mark.timeout(120)
def test_sigterm_stops_the_server_and_leaves_nothing(server):
    with Client(server.address) as client:
        client.call({"obs": np.ones((2048, 32), np.float32)}, timeout=60)  # shm both ways
        assert shm_names_of({os.getpid()}) == []  # our segment's name went once the server mapped it
        code = server.stop(signal.SIGTERM)  # checks processes, segments and the socket file
    assert code == 0, server.log()
    assert "ERROR phyrt" not in server.log()  # no replica failed, no server bug was logged


# --------------------------------------------------------------------------- an inline server in this process


@pytest.fixture
def inline_server(tmp_path, monkeypatch):
    """A ``Server`` over an inline ``tests.plugins:Echo`` engine, in this process, with every
    reply it sends recorded as (thread name, header) in ``sent``, and the op of every
    well-formed message it received in ``ops`` (its metrics)."""
    import runtime.serving.server as loop_module
    from runtime import Engine, EngineArgs
    from runtime.serving.metrics import NullMetrics
    from runtime.link.lane import ServerLane
    from runtime.link.listener import Listener
    from runtime.serving.server import Server
    from bench.fuzz import reply_fields

    # a message left unread would wait for the next housekeeping: make that wait unmissable
    monkeypatch.setattr(loop_module, "_HOUSEKEEPING_S", 30.0)
    sent: list[tuple[str, dict]] = []
    send = Listener.send

    def recording_send(self, identity, header, frames=()):
        sent.append((threading.current_thread().name, dict(reply_fields(header))))
        return send(self, identity, header, frames)

    monkeypatch.setattr(Listener, "send", recording_send)
    reply = ServerLane.reply

    def recording_reply(self, frames):  # a submit's reply by its client's lane (runtime.link.lane)
        sent.append((threading.current_thread().name, dict(reply_fields(frames[0]))))
        return reply(self, frames)

    monkeypatch.setattr(ServerLane, "reply", recording_reply)

    class RecordingMetrics(NullMetrics):
        on = True  # it records: the server calls it

        def __init__(self):
            self.ops: list = []

        def on_request(self, op):
            self.ops.append(op)

    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    metrics = RecordingMetrics()
    server = Server(Engine(EngineArgs(plugin="tests.plugins:Echo")), f"ipc://{private}/s.sock", metrics=metrics)
    server.sent = sent
    server.ops = metrics.ops
    server.start()
    yield server
    server.close(5)


SERVER_THREADS = {"phyrt-server-0", "phyrt-server-1"}


@pytest.mark.timeout(60)
def test_an_idle_inline_server_runs_a_request_where_it_received_it(inline_server):
    """No hop to the engine's thread and back: with nothing else in the engine, the server
    thread that read a request runs it and sends its reply (the other one reads meanwhile)."""
    # no heartbeat ping in the way: a submit the engine holds another request for goes to the
    # engine's thread
    with Client(inline_server.address, heartbeat_interval_s=60.0, heartbeat_timeout_s=120.0) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}  # read with the client's first ping
        for i in range(10):
            assert client.call({"i": i}, timeout=30) == {"i": i}
        assert client.ping(10) > 0
    submits = [name for name, header in inline_server.sent if header.get("op") == "submit"][1:]
    assert len(submits) == 10 and set(submits) <= SERVER_THREADS, submits
    assert {name for name, header in inline_server.sent if header.get("op") == "ping"} <= SERVER_THREADS


@pytest.mark.timeout(60)
def test_a_request_running_in_a_server_thread_leaves_the_socket_served(inline_server):
    """While one server thread runs a slow request, the other answers pings and queues more
    work for the engine's own thread, whose replies it sends itself."""
    with Client(inline_server.address) as slow, Client(inline_server.address) as other:
        running = slow.submit({"sleep": 1.5})
        time.sleep(0.3)  # it runs now, in the server thread that read it
        started = time.monotonic()
        assert other.ping(5) > 0
        queued = other.submit({"q": 1})  # the engine is busy: this one goes to its thread
        assert time.monotonic() - started < 1.0  # answered while the slow request (1.5 s) runs
        assert running.result(10) == {"sleep": 1.5}
        assert queued.result(10) == {"q": 1}
    names = {header.get("id"): name for name, header in inline_server.sent if header.get("op") == "submit"}
    assert set(names.values()) <= SERVER_THREADS | {"phyrt-inline-0"}
    assert "phyrt-inline-0" in names.values(), names  # the request queued behind the slow one


@pytest.mark.timeout(60)
def test_messages_read_with_a_slow_request_are_answered_while_it_runs(inline_server):
    """Three messages sent back to back, likely read as one batch: the slow submit runs in the
    thread that read it, and the ping read with it does not wait for it (the standby takes the
    loop, the messages not yet handled with it); the fast submit queues behind the slow one
    (the engine runs one request at a time, in order)."""
    import zmq

    from runtime.link.client_protocol import control_header, submit_message
    from runtime.transport.protocol import PayloadEncoder, unpack_header

    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(inline_server.address)
    try:
        for rounds in range(3):
            slow, fast = 3 * rounds, 3 * rounds + 1
            sent = time.monotonic()
            sock.send(submit_message(PayloadEncoder(copy=False), slow, None, False, {"sleep": 1.5}), zmq.NOBLOCK)
            sock.send(submit_message(PayloadEncoder(copy=False), fast, None, False, {"fast": rounds}), zmq.NOBLOCK)
            sock.send(control_header("ping", 3 * rounds + 2), zmq.NOBLOCK)
            answered = {}
            while len(answered) < 3:
                assert sock.poll(10_000), f"no reply within 10 s; have {sorted(answered)}"
                reply = unpack_header(sock.recv(), 1 << 20, [])
                answered[reply["id"]] = time.monotonic() - sent
                assert reply["ok"], reply
            assert answered[3 * rounds + 2] < 1.0, answered  # not behind the slow one
            assert 1.5 <= answered[slow] <= answered[fast], answered
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(120)
def test_no_message_is_stranded_while_engine_threads_send(inline_server):
    """Replies sent by the engine thread race new messages for the socket's edge-triggered
    descriptor; none may be left unread (it would wait 30 s for housekeeping here)."""
    errors: list[BaseException] = []

    def pipeline(worker: int) -> None:
        try:
            with Client(inline_server.address) as client:
                for batch in range(10):
                    futures = [client.submit({"w": worker, "n": n}) for n in range(40)]
                    for n, future in enumerate(futures):
                        assert future.result(10) == {"w": worker, "n": n}
                for i in range(100):
                    assert client.call({"w": worker, "i": i}, timeout=10) == {"w": worker, "i": i}
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=pipeline, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors[:3]
    assert time.monotonic() - started < 25  # no stall of a housekeeping period
    assert wait_until(lambda: inline_server.inflight == 0, 5)


@pytest.mark.timeout(120)
def test_a_deadline_racing_a_completion_answers_once(inline_server):
    """The engine thread's reply and the I/O thread's deadline race; each request gets one reply."""
    outcomes = []
    with Client(inline_server.address) as client:
        futures = [client.submit({"i": i, "sleep": 0.02}, timeout=0.02 + 0.002 * (i % 10)) for i in range(60)]
        for future in futures:
            try:
                outcomes.append(future.result(30))
            except DeadlineExceededError as exc:
                outcomes.append(exc)
        assert client.call({"after": 1}, timeout=30) == {"after": 1}
    replies: dict = {}
    for _, header in inline_server.sent:
        if header.get("op") == "submit":
            replies[header["id"]] = replies.get(header["id"], 0) + 1
    assert sorted(replies.values()) == [1] * len(replies) and len(replies) == 61
    assert any(isinstance(o, DeadlineExceededError) for o in outcomes)
    assert wait_until(lambda: inline_server.inflight == 0, 5)


@pytest.mark.timeout(120)
def test_answered_requests_with_a_long_timeout_are_not_kept_until_it(inline_server):
    """Memory grows with the requests in flight, not with those answered within their timeout:
    1,200 requests with a 60 s deadline, answered one at a time and 200 at once, leave no more
    than the server's slack of answered requests alive."""
    import gc

    from runtime.serving.outcomes import Request

    with Client(inline_server.address) as client:
        for i in range(1000):
            assert client.call({"i": i}, timeout=60) == {"i": i}
        futures = [client.submit({"j": j}, timeout=60) for j in range(200)]
        assert [f.result(30) for f in futures] == [{"j": j} for j in range(200)]
    assert wait_until(lambda: inline_server.inflight == 0, 5)
    gc.collect()
    alive = sum(1 for obj in gc.get_objects() if type(obj) is Request)
    assert alive <= 100, f"{alive} answered requests are still held"


@pytest.mark.timeout(60)
def test_a_request_running_in_a_server_thread_still_gets_its_deadline_and_cannot_be_cancelled(inline_server):
    """The standby thread takes the loop from a thread running a long request: that request's
    deadline is answered while it runs, and a cancel of it says it is running."""
    with Client(inline_server.address) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        started = time.monotonic()
        slow = client.submit({"sleep": 1.5}, timeout=0.3)
        time.sleep(0.1)
        assert client.cancel(slow, timeout=5) is False  # running: not cancellable
        with pytest.raises(DeadlineExceededError, match="still running"):
            slow.result(10)
        assert time.monotonic() - started < 1.2  # answered before the request ended
        assert client.call({"after": 1}, timeout=30) == {"after": 1}  # queued behind it, then served
    assert wait_until(lambda: inline_server.inflight == 0, 5)
    replies = [h for _, h in inline_server.sent if h.get("op") == "submit" and h.get("id") == slow.request_id]
    assert len(replies) == 1 and replies[0]["error"]["type"] == "DeadlineExceeded"


@pytest.mark.timeout(60)
def test_an_idle_server_and_a_waiting_client_do_not_spin(inline_server):
    """The short polls before sleeping (runtime.transport.spin) end: an idle server costs no CPU, and a
    caller waiting for a long request costs little."""
    with Client(inline_server.address) as client:
        for i in range(50):
            assert client.call({"i": i}, timeout=30) == {"i": i}
        before = time.process_time()  # this process: the server's threads and the client's
        time.sleep(1.0)
        assert time.process_time() - before < 0.1
        before = time.thread_time()
        assert client.call({"sleep": 0.5}, timeout=30) == {"sleep": 0.5}
        assert time.thread_time() - before < 0.1


@pytest.mark.timeout(60)
def test_shared_memory_requests_with_releases_run_where_they_were_received(inline_server):
    """A dropped result's release rides in the next request's header: the request is still the
    last message read, so an idle server runs it in the reading thread."""
    image = np.arange(1 << 18, dtype=np.uint8).reshape(512, 512)  # 256 KiB: shared memory both ways
    with Client(inline_server.address, heartbeat_interval_s=60.0, heartbeat_timeout_s=120.0) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}  # read with the client's first ping
        assert wait_until(lambda: client._session is not None and client._session.mapper is not None, 10)
        for i in range(10):
            result = client.call({"image": image, "i": i}, timeout=30)
            assert result["i"] == i and np.array_equal(result["image"], image)
            assert result["image"].base is not None  # a view of the server's block, released when dropped
            del result
    submits = [name for name, header in inline_server.sent if header.get("op") == "submit"][1:]
    assert len(submits) == 10 and set(submits) <= SERVER_THREADS, submits


@pytest.mark.timeout(60)
def test_dropped_results_are_given_back_in_the_next_submit_and_a_bad_release_field_is_refused(inline_server):
    """Releases ride in submits (no release message of their own) and free the blocks: the
    server holds only the result still alive. A submit whose ``release`` is not a list of
    blocks gets InvalidRequest, one naming blocks that are not its own frees nothing, and the
    server goes on serving."""
    import msgpack
    import zmq

    ops = inline_server.ops
    image = np.arange(1 << 18, dtype=np.uint8).reshape(512, 512)  # 256 KiB: shared memory both ways
    with Client(inline_server.address, heartbeat_interval_s=60.0, heartbeat_timeout_s=120.0) as client:
        assert client.call({"warm": 1}, timeout=30) == {"warm": 1}
        assert wait_until(lambda: client._session is not None and client._session.mapper is not None, 10)
        shm = next(iter(inline_server._shm._clients.values()))
        for i in range(20):
            result = client.call({"image": image, "i": i}, timeout=30)
            assert np.array_equal(result["image"], image)
            del result
            # the one just dropped; the rest came back with submits (freed just after each reply went out)
            assert wait_until(lambda: len(shm.session._outstanding) == 1, 5), shm.session._outstanding
        assert ops.count("submit") == 21 and "release" not in ops, ops
        assert len(shm.session.arena.segments) == 1

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(inline_server.address)
        try:
            for i, release in enumerate(["junk", [["x", 0]] * 4097, {"a": 1}]):
                sock.send(msgpack.packb({"v": 1, "op": "submit", "id": i, "payload": {"i": i}, "release": release}))
                assert sock.poll(10_000)
                reply = msgpack.unpackb(sock.recv())
                assert reply["id"] == i and reply["ok"] is False, reply
                assert reply["error"]["type"] == "InvalidRequest" and "release" in reply["error"]["message"]
            # well-formed, but not this connection's blocks (it registered none): answered, nothing freed
            (key, nbytes), = list(shm.session._outstanding.items()) or [(None, None)]
            sock.send(msgpack.packb({"v": 1, "op": "submit", "id": 9, "payload": {"i": 9},
                                     "release": [list(key) if key else ["x", 0], [1, 2], "junk"]}))
            assert sock.poll(10_000)
            assert msgpack.unpackb(sock.recv()) == {"v": 1, "op": "submit", "id": 9, "ok": True, "result": {"i": 9}}
        finally:
            sock.close(0)
        assert len(shm.session._outstanding) == 1  # another connection cannot give back this client's block
        assert client.call({"i": 10}, timeout=30) == {"i": 10}
