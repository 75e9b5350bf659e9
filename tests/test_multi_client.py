"""``Client([address, ...])``: one client over several servers (``runtime.client.routing``).

Real ``python -m runtime.launch`` servers (tests.plugins:Echo, inline) at fixed ipc://
addresses, shared by the module, so that a killed one can be started again at the same
address; and a fake single-address client for the rules that need a server to answer
EngineUnavailable or to turn healthy on cue.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import pytest

from runtime.client import AsyncClient, Client, ConnectionLostError, RoutingClient, ServerUnavailableError
from runtime.client.rotation import DOWN, UP
from tests.test_launch import Launched, wait_until

FAST = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0}


class Servers:
    """Echo servers by name, each at an ipc:// path of its own private directory."""

    def __init__(self, root, names: tuple[str, ...]) -> None:
        self.root = root
        self.addresses = {}
        for name in names:
            private = root / name
            private.mkdir(mode=0o700)
            self.addresses[name] = f"ipc://{private}/echo.sock"
        self.running: dict[str, Launched] = {}

    def start(self, *names: str) -> None:
        """Start them side by side (each waits for its ready line in a thread of its own)."""
        def launch(name: str) -> Launched:
            return Launched("--plugin", "tests.plugins:Echo", "--device", "cpu", "--address", self.addresses[name],
                            "--log-level", "warning", log_dir=self.root, name=name)

        with ThreadPoolExecutor(len(names)) as pool:
            for name, server in zip(names, pool.map(launch, names)):
                self.running[name] = server

    def kill(self, name: str) -> None:
        server = self.running.pop(name)
        server.kill()
        server.proc.stdout.close()

    def stop_all(self) -> None:
        for name in list(self.running):
            server = self.running.pop(name)
            assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    fleet = Servers(tmp_path_factory.mktemp("fleet"), ("a", "b"))
    try:
        fleet.start("a", "b")
        yield fleet
    finally:
        fleet.stop_all()


def states(client: RoutingClient) -> dict[str, str]:
    return {s["address"]: s["state"] for s in client.info(timeout=2)["servers"]}


def all_up(client: RoutingClient) -> bool:
    return set(states(client).values()) == {UP}


# --------------------------------------------------------------------------- real servers


@pytest.mark.timeout(60)
def test_a_list_of_addresses_gives_one_client_with_the_same_verbs(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]
    with Client([a, b], **FAST) as client:
        assert isinstance(client, RoutingClient) and client.addresses == [a, b]
        assert client.call({"x": 1}, timeout=30) == {"x": 1}
        assert client.submit({"x": 2}).result(30) == {"x": 2}
        assert list(client.stream({"x": 3}, timeout=30)) == [{"x": 3}]  # a plugin that does not stream: one chunk
        assert 0 < client.ping() < 5
        assert wait_until(lambda: all_up(client), 10)
        info = client.info()
        assert info["in_rotation"] == 2
        by_address = {s["address"]: s for s in info["servers"]}
        assert by_address[a]["info"]["address"] == a and by_address[b]["info"]["address"] == b
        assert by_address[a]["info"]["server_id"] != by_address[b]["info"]["server_id"]


@pytest.mark.timeout(60)
def test_requests_go_to_the_server_with_fewest_in_flight_ties_in_turn(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]
    with Client([a, b], **FAST) as client:
        assert wait_until(lambda: all_up(client), 10)
        futures = [client.submit({"sleep": 0.3, "i": i}) for i in range(8)]  # all in flight at once
        assert [f.result(30)["i"] for f in futures] == list(range(8))
        assert sorted(f.server for f in futures) == [a] * 4 + [b] * 4
        for i in range(4):  # one at a time: nothing in flight, so they take turns
            client.call({"i": i}, timeout=30)
        served = {s["address"]: s["served"] for s in client.info()["servers"]}
        assert served == {a: 6, b: 6}
        # one server busy with a long request: the next ones, one at a time, all go to the other
        assert wait_until(lambda: all(s["inflight"] == 0 for s in client.info()["servers"]), 10)
        slow = client.submit({"sleep": 3.0})
        for i in range(3):
            client.call({"i": i}, timeout=30)  # call: its in-flight count is down again when it returns
        held = not slow.done()
        assert slow.result(30) == {"sleep": 3.0}
        other = b if slow.server == a else a
        after = {s["address"]: s["served"] for s in client.info()["servers"]}
        delta = {k: after[k] - served[k] for k in after}
        assert delta == {slow.server: 1, other: 3}, f"served: {delta}; long request in flight to the end: {held}"


@pytest.mark.timeout(120)
def test_sigkill_under_load_fails_only_that_servers_requests_and_a_restart_comes_back(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]
    with Client([a, b], **FAST) as client:
        assert wait_until(lambda: all_up(client), 10)
        futures: list[Future] = []
        killed_at = None
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # a closed loop of 6 requests in flight
            futures = [f for f in futures] + [client.submit({"sleep": 0.02})
                                              for _ in range(6 - sum(not f.done() for f in futures))]
            wait_futures([f for f in futures if not f.done()], timeout=1, return_when="FIRST_COMPLETED")
            if killed_at is None and time.monotonic() - started > 1.0:
                servers.kill("b")
                killed_at = len(futures)
        done, hanging = wait_futures(futures, timeout=15)
        assert not hanging  # every request is accounted for: answered or failed
        failed = [f for f in futures if f.exception() is not None]
        assert failed and all(f.server == b and isinstance(f.exception(), ConnectionLostError) for f in failed)
        assert all(b in str(f.exception()) for f in failed)
        after = futures[killed_at:]
        assert sum(f.server == a and f.exception() is None for f in after) > 10  # a kept serving
        assert all(f.server == a for f in futures[-12:])  # b is out of the rotation
        assert states(client)[b] == DOWN

        servers.start("b")  # at the same address: probed back into the rotation
        assert wait_until(lambda: states(client)[b] == UP, 30)
        again = [client.submit({"sleep": 0.2}) for _ in range(4)]
        assert [f.result(30) for f in again] == [{"sleep": 0.2}] * 4
        assert sorted(f.server for f in again) == [a, a, b, b]


@pytest.mark.timeout(60)
def test_async_client_over_several_servers(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]

    async def main():
        async with AsyncClient([a, b], **FAST) as client:
            assert await client.call({"x": 1}, timeout=30) == {"x": 1}
            results = await asyncio.gather(*(client.submit({"i": i}) for i in range(6)))
            assert [r["i"] for r in results] == list(range(6))
            assert 0 < await client.ping() < 5
            assert [chunk async for chunk in client.stream({"s": 1}, timeout=30)] == [{"s": 1}]
            info = await client.info(timeout=10)
            return sorted(s["address"] for s in info["servers"] if s["info"] is not None)

    assert asyncio.run(main()) == [a, b]


@pytest.mark.timeout(60)
def test_info_right_after_connecting_shows_the_serving_servers_up(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]
    with Client([a, b], **FAST) as client:
        info = client.info(timeout=10)  # before the routing thread's first probe could answer
        assert [(s["state"], s["error"]) for s in info["servers"]] == [(UP, None), (UP, None)], info
        assert info["in_rotation"] == 2
        assert states(client) == {a: UP, b: UP}  # in the rotation from then on


@pytest.mark.timeout(60)
def test_a_wrong_ipc_path_among_several_is_out_at_once_naming_the_path(servers, tmp_path):
    a = servers.addresses["a"]
    missing, stale = tmp_path / "missing.sock", tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(stale))  # a socket file nobody listens on
    wrong = {f"ipc://{missing}": f"no socket at {missing}", f"ipc://{stale}": f"nothing listens at {stale}"}
    with Client([*wrong, a], heartbeat_interval_s=1.0, heartbeat_timeout_s=20.0) as client:
        assert [client.call({"i": i}, timeout=30) for i in range(3)] == [{"i": 0}, {"i": 1}, {"i": 2}]
        assert client.submit({"i": 3}).result(30) == {"i": 3}
        by_address = {s["address"]: s for s in client.info(timeout=10)["servers"]}
        assert by_address[a]["state"] == UP and by_address[a]["served"] == 4
        for address, why in wrong.items():
            assert by_address[address]["state"] == DOWN and why in by_address[address]["cause"], by_address
    with Client(list(wrong), heartbeat_interval_s=1.0, heartbeat_timeout_s=20.0) as client:
        with pytest.raises(ServerUnavailableError, match="no server is in the rotation") as raised:
            client.call({"x": 1}, timeout=30)  # at once, not after heartbeat_timeout_s
        assert set(raised.value.causes) == set(wrong)
        for address, why in wrong.items():
            assert why in raised.value.causes[address], raised.value.causes


@pytest.mark.timeout(60)
def test_with_every_server_down_a_call_fails_at_once_naming_each_cause(servers):
    a, b = servers.addresses["a"], servers.addresses["b"]
    with Client([a, b], **FAST) as client:
        assert wait_until(lambda: all_up(client), 10)
        servers.kill("a")
        servers.kill("b")
        assert wait_until(lambda: set(states(client).values()) == {DOWN}, 10)
        with pytest.raises(ServerUnavailableError, match="no server is in the rotation") as raised:
            client.call({"x": 1}, timeout=30)
        assert type(raised.value) is ServerUnavailableError  # raised here, not a request that was sent
        assert set(raised.value.causes) == {a, b} and all("lost" in c for c in raised.value.causes.values())
        with pytest.raises(ServerUnavailableError):
            client.submit({"x": 1})


def test_bad_address_lists_are_refused():
    for bad in ([], ["ipc:///x/a.sock", "ipc:///x/a.sock"], ["nowhere"], [1]):
        with pytest.raises(ValueError):
            Client(bad)
    with pytest.raises(TypeError):
        Client(["ipc:///x/a.sock"], refresh="not callable")


# --------------------------------------------------------------------------- the rules, on fake servers


class FakeClient:
    """A single-address client whose server answers as the test says: ``answer`` (ok or an error),
    ``healthy`` (its info), ``alive`` (its connection)."""

    made: dict[str, "FakeClient"] = {}

    def __init__(self, address: str, **kwargs: Any) -> None:
        self.address = address
        self.answer: BaseException | None = None
        self.healthy = True
        self.alive = True
        self.sent: list[Any] = []
        self.closed = False
        self._unreachable = None  # what the rotation reads at once
        self._callbacks: list[Any] = []  # what it hears of failures by: Client._on_failure
        self._timeout = kwargs.get("heartbeat_timeout_s", 5.0)
        self.made[address] = self
        threading.Thread(target=self._beat, daemon=True).start()

    def _on_failure(self, callback: Any) -> None:
        self._callbacks.append(callback)

    def lose(self) -> None:
        """Its monitor saw the connection drop: the link's failure callbacks run."""
        for callback in self._callbacks:
            callback(f"the connection to the server at {self.address} was lost")

    def _beat(self) -> None:  # heartbeats answered while alive; silence past the timeout: a failure, once
        heard, silent = time.monotonic(), False
        while not self.closed:
            now = time.monotonic()
            if self.alive:
                heard, silent = now, False
            elif now - heard > self._timeout and not silent:
                silent = True
                for callback in self._callbacks:
                    callback(f"no word from {self.address} for {now - heard:.1f} s (heartbeat_timeout_s)")
            time.sleep(0.05)

    def submit(self, payload: Any, *, timeout: float | None = None) -> Future:
        future: Future = Future()
        self.sent.append(payload)
        if self.answer is None:
            future.set_result(payload)
        else:
            future.set_exception(self.answer)
        return future

    def _control_async(self, op: str) -> Future:
        future: Future = Future()
        if not self.alive:
            future.set_exception(ConnectionLostError(f"no word from {self.address}"))
        elif op == "info":
            future.set_result({"accepting": True, "replicas": [{"healthy": self.healthy, "error": None if
                                                                self.healthy else "replica 0 failed"}]})
        else:
            future.set_result({"server_id": "id-" + self.address})
        return future

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake():
    FakeClient.made.clear()
    client = RoutingClient(["tcp://x:1", "tcp://y:1"], FakeClient, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    assert wait_until(lambda: set(states(client).values()) == {UP}, 5)
    yield client, FakeClient.made["tcp://x:1"], FakeClient.made["tcp://y:1"]
    client.close()
    assert all(c.closed for c in FakeClient.made.values())


@pytest.mark.timeout(30)
def test_engine_unavailable_takes_a_server_out_without_retry_until_a_probe_finds_it_healthy(fake):
    client, x, y = fake
    x.answer, x.healthy = ServerUnavailableError("no healthy replica"), False
    first = client.submit({"n": 0})  # nothing in flight anywhere: the first in turn
    assert first.server == "tcp://x:1"
    with pytest.raises(ServerUnavailableError, match="no healthy replica"):
        first.result(1)
    assert x.sent[-1] == {"n": 0} and {"n": 0} not in y.sent  # never retried elsewhere
    assert [client.submit({"n": i}).server for i in range(4)] == ["tcp://y:1"] * 4
    # probed meanwhile (after a back-off): it answers, but with no healthy replica it stays out
    assert wait_until(lambda: "replica 0 failed" in (client.info()["servers"][0]["cause"] or ""), 10)
    assert states(client)["tcp://x:1"] == DOWN
    x.answer, x.healthy = None, True
    assert wait_until(lambda: states(client)["tcp://x:1"] == UP, 5)


@pytest.mark.timeout(30)
def test_missed_heartbeats_and_a_lost_connection_take_a_server_out(fake):
    client, x, y = fake
    x.alive = False  # silent
    assert wait_until(lambda: states(client)["tcp://x:1"] == DOWN, 5)
    assert "heartbeat_timeout_s" in client.info()["servers"][0]["cause"]
    y.lose()  # its monitor saw the connection drop
    with pytest.raises(ServerUnavailableError) as raised:
        client.submit({"n": 1})
    assert "lost" in raised.value.causes["tcp://y:1"] and "heartbeat" in raised.value.causes["tcp://x:1"]
    x.alive = True
    assert wait_until(lambda: states(client)["tcp://x:1"] == UP, 5)
    assert client.submit({"n": 2}).result(1) == {"n": 2}


@pytest.mark.timeout(30)
def test_refresh_replaces_the_list_and_closes_dropped_servers():
    FakeClient.made.clear()
    listed = [["tcp://x:1", "tcp://y:1"]]
    client = RoutingClient(listed[0], FakeClient, refresh=lambda: listed[0], refresh_interval_s=0.05,
                           heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    try:
        listed[0] = ["tcp://y:1", "tcp://z:1"]
        assert wait_until(lambda: client.addresses == ["tcp://y:1", "tcp://z:1"], 5)
        assert FakeClient.made["tcp://x:1"].closed and not FakeClient.made["tcp://y:1"].closed
        assert wait_until(lambda: all_up(client), 5)
    finally:
        client.close()
