"""A request's priority across the client<->server wire (issue 34): the clients check it and send it
(never when 0), the server checks it at decode and hands it to ``Engine.submit``/``submit_stream``.

    Client / AsyncClient / RoutingClient  -- check_priority, then ``priority`` in the header -->
    Server (in this process, an inline Echo engine whose submits are recorded; its idle runner is
    off, so that every request goes through ``engine.submit``) -- engine.submit(p, priority=...)

A bad priority from a client raises before anything is sent; one forged on the wire (raw DEALER
frames, hypothesis too) gets the protocol's ``InvalidRequest`` reply, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.client import AsyncClient, Client, ServerUnavailableError
from runtime.client.routing import RoutingClient
from runtime.core.priority import PRIORITY_MAX, PRIORITY_MIN
from runtime.link.client_protocol import PROTOCOL_VERSION
from runtime.serving.metrics import NullMetrics

pytestmark = [pytest.mark.timeout(120)]
BAD_PRIORITIES = [("high", TypeError), (1.0, TypeError), (True, TypeError), (False, TypeError), (None, TypeError),
                  ([1], TypeError), ({"p": 1}, TypeError), (2**40, ValueError), (-2**63, ValueError),
                  (PRIORITY_MAX + 1, ValueError), (PRIORITY_MIN - 1, ValueError)]
#: forged on the wire: the values above, and nested or other msgpack kinds
WIRE_BAD = [value for value, _ in BAD_PRIORITIES] + [[[1]], {"a": [1, {"b": None}]}, b"\x01", float("nan"),
                                                     2**64 - 1, [], {}, "", -0.0]


class RecordingMetrics(NullMetrics):
    on = True  # the server calls it

    def __init__(self) -> None:
        self.ops: list[str] = []

    def on_request(self, op: str) -> None:
        self.ops.append(op)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A ``Server`` over an inline Echo engine whose ``submit``/``submit_stream`` record
    ``(op, keyword arguments)`` in ``server.seen``; ``server.ops``: the ops it received."""
    from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
    from runtime.serving.server import Server

    engine = Engine(EngineArgs(plugin="tests.plugins:Echo", config=EngineConfig(device=DeviceConfig(target="cpu"))))
    seen: list[tuple[str, dict]] = []
    submit, submit_stream = engine.submit, engine.submit_stream

    def recording_submit(request: Any, **kwargs: Any) -> Any:
        seen.append(("submit", kwargs))
        return submit(request, **kwargs)

    def recording_submit_stream(request: Any, on_chunk: Any, **kwargs: Any) -> Any:
        seen.append(("stream", kwargs))
        return submit_stream(request, on_chunk, **kwargs)

    engine.submit, engine.submit_stream = recording_submit, recording_submit_stream
    engine.inline_runner = lambda: None  # every request through engine.submit (an idle runner has no queue)
    private = tmp_path_factory.mktemp("priority") / "run"
    private.mkdir(mode=0o700)
    metrics = RecordingMetrics()
    srv = Server(engine, f"ipc://{private}/s.sock", metrics=metrics).start()
    srv.seen, srv.ops = seen, metrics.ops
    yield srv
    srv.close(5)


@pytest.fixture
def seen(server):
    server.seen.clear()
    return server.seen


# --------------------------------------------------------------------------- from the clients to the engine


def test_the_clients_priority_reaches_the_engine_and_0_is_not_passed(server, seen):
    obs = np.arange(4, dtype=np.float32)
    with Client(server.address) as client:
        assert client.call({"a": 1}, timeout=30, priority=5) == {"a": 1}
        assert client.submit({"b": 2}, timeout=30, priority=-7).result(30) == {"b": 2}
        assert client.call({"c": 3}, timeout=30) == {"c": 3}
        assert client.call({"d": 4}, timeout=30, priority=0) == {"d": 4}
        assert list(client.stream({"e": 5}, timeout=30, priority=PRIORITY_MAX)) == [{"e": 5}]
        got = client.submit({"obs": obs}, priority=PRIORITY_MIN).result(30)  # tensors: the encoder's header
        np.testing.assert_array_equal(got["obs"], obs)
    assert seen == [("submit", {"priority": 5}), ("submit", {"priority": -7}), ("submit", {}), ("submit", {}),
                    ("stream", {"priority": PRIORITY_MAX}), ("submit", {"priority": PRIORITY_MIN})]


def test_the_async_client_sends_its_priority(server, seen):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            assert await client.call({"a": 1}, 30, priority=3) == {"a": 1}
            assert await client.submit({"b": 2}, timeout=30, priority=4) == {"b": 2}
            assert [chunk async for chunk in client.stream({"c": 3}, 30, priority=6)] == [{"c": 3}]

    asyncio.run(main())
    assert seen == [("submit", {"priority": 3}), ("submit", {"priority": 4}), ("stream", {"priority": 6})]


def test_the_routing_client_sends_its_priority(server, seen):
    with Client([server.address]) as client:
        assert isinstance(client, RoutingClient)
        assert client.call({"a": 1}, 30, priority=8) == {"a": 1}
        assert client.submit({"b": 2}, timeout=30, priority=9).result(30) == {"b": 2}
        assert list(client.stream({"c": 3}, 30, priority=-10)) == [{"c": 3}]
        assert client.call({"d": 4}, 30) == {"d": 4}
    assert seen == [("submit", {"priority": 8}), ("submit", {"priority": 9}), ("stream", {"priority": -10}),
                    ("submit", {})]

    async def main() -> None:
        async with AsyncClient([server.address]) as client:
            assert await client.call({"a": 1}, 30, priority=11) == {"a": 1}
            assert [chunk async for chunk in client.stream({"c": 3}, 30, priority=12)] == [{"c": 3}]

    seen.clear()
    asyncio.run(main())
    assert seen == [("submit", {"priority": 11}), ("stream", {"priority": 12})]


# --------------------------------------------------------------------------- a bad priority from a client


def _verbs(client: Any) -> dict[str, Any]:
    return {"submit": lambda p: client.submit({"x": 1}, timeout=30, priority=p),
            "call": lambda p: client.call({"x": 1}, 30, priority=p),
            "stream": lambda p: client.stream({"x": 1}, 30, priority=p)}


@pytest.mark.parametrize("routing", [False, True])
def test_a_bad_priority_raises_in_the_client_before_anything_is_sent(server, seen, routing):
    with Client([server.address] if routing else server.address) as client:
        assert client.call({"warm": 1}, 30) == {"warm": 1}
        ops_before = len(server.ops)
        for name, verb in _verbs(client).items():
            for value, error in BAD_PRIORITIES:
                with pytest.raises(error, match="priority"):
                    verb(value)
        assert client.call({"after": 1}, 30, priority=1) == {"after": 1}
    assert [op for op in server.ops[ops_before:] if op in ("submit", "stream")] == ["submit"]  # the last call only
    assert seen == [("submit", {}), ("submit", {"priority": 1})]


def test_the_async_clients_bad_priority_raises_before_anything_is_sent(server, seen):
    async def main() -> None:
        async with AsyncClient(server.address) as client:
            for value, error in BAD_PRIORITIES:
                with pytest.raises(error, match="priority"):
                    client.submit({"x": 1}, priority=value)
                with pytest.raises(error, match="priority"):
                    await client.call({"x": 1}, 30, priority=value)
                with pytest.raises(error, match="priority"):
                    client.stream({"x": 1}, 30, priority=value)

    asyncio.run(main())
    assert seen == []


def test_the_priority_is_checked_before_the_server_is_even_looked_for(tmp_path):
    """No server at the address: a good request fails with ServerUnavailableError, a bad priority first
    with its own error (nothing was about to be sent)."""
    with Client(f"ipc://{tmp_path}/nobody.sock") as client:
        with pytest.raises(ServerUnavailableError):
            client.submit({"x": 1}, priority=1)
        with pytest.raises(TypeError, match="priority"):
            client.submit({"x": 1}, priority="high")
        with pytest.raises(TypeError, match="priority"):
            client.call({"x": 1}, priority=True)
        with pytest.raises(ValueError, match="priority"):
            client.stream({"x": 1}, priority=2**40)


# --------------------------------------------------------------------------- forged on the wire


@pytest.fixture(scope="module")
def dealer(server):
    """A raw DEALER connected to the server: ``ask(header) -> reply header`` (a 10 s bound: no hang)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)

    def ask(header: dict) -> dict:
        sock.send(msgpack.packb(header, use_bin_type=True))
        while True:
            assert sock.poll(10_000, zmq.POLLIN), f"no reply to {header!r} within 10 s"
            reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            if reply.get("id") == header["id"]:
                return reply

    yield ask
    sock.close()
    ctx.term()


def _refused(reply: dict, op: str, request_id: int) -> None:
    assert reply["v"] == PROTOCOL_VERSION and reply["ok"] is False, reply
    assert reply["op"] == op and reply["id"] == request_id, reply
    assert reply["error"]["type"] == "InvalidRequest", reply
    assert "priority" in reply["error"]["message"] and "Traceback" not in reply["error"]["message"], reply


def test_a_forged_priority_gets_invalid_request_and_the_server_serves_on(server, seen, dealer):
    for i, value in enumerate(WIRE_BAD):
        for op in ("submit", "stream"):
            request_id = 2 * i + (op == "stream")
            _refused(dealer({"v": 1, "op": op, "id": request_id, "payload": {"i": i}, "priority": value}), op,
                     request_id)
    assert seen == []  # none reached the engine
    good = dealer({"v": 1, "op": "submit", "id": 1000, "payload": {"ok": 1}, "priority": 4})
    assert good["ok"] is True and good["result"] == {"ok": 1}, good
    end = dealer({"v": 1, "op": "stream", "id": 1001, "payload": {"ok": 2}, "priority": -4})
    assert end["ok"] is True and end["final"] is True and end["result"] == {"ok": 2}, end
    zero = dealer({"v": 1, "op": "submit", "id": 1002, "payload": {"ok": 3}, "priority": 0})
    assert zero["ok"] is True, zero
    assert seen == [("submit", {"priority": 4}), ("stream", {"priority": -4}), ("submit", {})]
    assert dealer({"v": 1, "op": "ping", "id": 1003})["ok"] is True
    with Client(server.address) as client:
        assert client.info(10)["inflight"] == 0


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.text(max_size=6) | st.binary(max_size=6)
    | st.integers(-(2**63), 2**64 - 1) | st.sampled_from([PRIORITY_MIN - 1, PRIORITY_MIN, PRIORITY_MAX,
                                                          PRIORITY_MAX + 1, 0, -1]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
_ids = iter(range(10_000, 10**9))


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=_msgpack_values, op=st.sampled_from(["submit", "stream"]))
def test_any_priority_value_on_the_wire_is_served_or_refused_with_invalid_request(server, dealer, value, op):
    request_id = next(_ids)
    reply = dealer({"v": 1, "op": op, "id": request_id, "payload": {"n": request_id}, "priority": value})
    valid = isinstance(value, int) and not isinstance(value, bool) and PRIORITY_MIN <= value <= PRIORITY_MAX
    if valid:
        assert reply["ok"] is True and reply["result"] == {"n": request_id}, reply
    else:
        _refused(reply, op, request_id)
