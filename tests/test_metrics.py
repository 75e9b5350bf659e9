"""runtime.serving.metrics: recorded values, scraped over HTTP on loopback as Prometheus would."""

from __future__ import annotations

import importlib.util
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus-client is not installed "
                                        "(pip install prometheus-client; the serve extra)")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from runtime.serving.metrics import ERROR_TYPES, OPS, NullMetrics, ServerMetrics, start_metrics_server  # noqa: E402


@dataclass(frozen=True)
class Status:  # the fields of runtime.engine.ReplicaStatus that metrics read
    index: int
    healthy: bool
    inflight: int


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one GET."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def served():
    with start_metrics_server(0) as server:
        yield server
    assert not server._thread.is_alive()


@pytest.mark.timeout(30)
def test_requests_errors_latency_and_replicas_are_scraped(served):
    m = served.metrics
    for op in ["submit"] * 5 + ["ping", "info", "no-such-op", None]:
        m.on_request(op)
    m.on_reply(True, None, 0.0003)
    m.on_reply(True, None, 0.002)
    m.on_reply(False, "Overloaded", 0.00005)
    m.on_reply(False, "DeadlineExceeded", 7.0)
    m.on_reply(False, "SomethingNew", 0.001)
    m.on_reply(True, None, 0.0001, op="ping")
    m.observe_replicas([Status(0, True, 3), Status(1, False, 0)])

    assert served.host == "127.0.0.1" and served.port > 0
    got = scrape(served.url)
    assert got[("phyrt_requests_total", (("op", "submit"),))] == 5
    assert got[("phyrt_requests_total", (("op", "ping"),))] == 1
    assert got[("phyrt_requests_total", (("op", "other"),))] == 2  # unknown op, unreadable message
    assert got[("phyrt_requests_total", (("op", "cancel"),))] == 0  # every series exists from the start
    assert got[("phyrt_errors_total", (("type", "Overloaded"),))] == 1
    assert got[("phyrt_errors_total", (("type", "DeadlineExceeded"),))] == 1
    assert got[("phyrt_errors_total", (("type", "other"),))] == 1
    assert got[("phyrt_errors_total", (("type", "PluginError"),))] == 0
    submit = (("op", "submit"),)
    assert got[("phyrt_request_duration_seconds_count", submit)] == 5
    assert got[("phyrt_request_duration_seconds_sum", submit)] == pytest.approx(7.00335)
    assert got[("phyrt_request_duration_seconds_bucket", (("le", "0.0001"), ("op", "submit")))] == 1
    assert got[("phyrt_request_duration_seconds_bucket", (("le", "0.0025"), ("op", "submit")))] == 4
    assert got[("phyrt_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "submit")))] == 5
    assert got[("phyrt_request_duration_seconds_count", (("op", "ping"),))] == 1
    assert got[("phyrt_replica_inflight", (("replica", "0"),))] == 3
    assert got[("phyrt_replica_healthy", (("replica", "0"),))] == 1
    assert got[("phyrt_replica_healthy", (("replica", "1"),))] == 0
    assert got[("phyrt_replicas_healthy", ())] == 1

    m.observe_replicas([{"index": 0, "healthy": True, "inflight": 0}])  # info()["replicas"] form
    got = scrape(served.url)
    assert got[("phyrt_replica_inflight", (("replica", "0"),))] == 0
    assert ("phyrt_replica_healthy", (("replica", "1"),)) not in got  # a replica gone is a series gone


@pytest.mark.timeout(30)
def test_replica_source_is_read_at_each_scrape(served):
    statuses = [Status(0, True, 1)]
    with start_metrics_server(0, metrics=ServerMetrics(replicas=lambda: statuses)) as pulled:
        assert scrape(pulled.url)[("phyrt_replica_inflight", (("replica", "0"),))] == 1
        statuses[:] = [Status(0, False, 0), Status(1, True, 2)]
        got = scrape(pulled.url)
        assert got[("phyrt_replica_healthy", (("replica", "0"),))] == 0
        assert got[("phyrt_replica_inflight", (("replica", "1"),))] == 2
        assert got[("phyrt_replicas_healthy", ())] == 1
    # two servers in one process keep their own registries
    assert ("phyrt_replica_inflight", (("replica", "1"),)) not in scrape(served.url)


@pytest.mark.timeout(30)
def test_counts_are_exact_under_concurrent_recording(served):
    m = served.metrics

    def record() -> None:
        for _ in range(2000):
            m.on_request("submit")
            m.on_reply(False, "Overloaded", 0.001)

    threads = [threading.Thread(target=record) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(5):  # scrapes while recording: never an error
        scrape(served.url)
    for t in threads:
        t.join(20)
    got = scrape(served.url)
    assert got[("phyrt_requests_total", (("op", "submit"),))] == 8000
    assert got[("phyrt_errors_total", (("type", "Overloaded"),))] == 8000


@pytest.mark.timeout(30)
def test_close_frees_the_port_and_a_taken_port_raises():
    server = start_metrics_server(0)
    port = server.port
    with pytest.raises(OSError):
        start_metrics_server(port)
    server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))  # free again


@pytest.mark.timeout(30)
def test_bad_arguments_and_null_recorder():
    for port in (-1, 65536, "9100", True):
        with pytest.raises(ValueError, match="port"):
            start_metrics_server(port)
    with pytest.raises(ValueError, match="host"):
        start_metrics_server(0, host="")
    null = NullMetrics()  # what a server holds when metrics are off
    null.on_request("submit")
    null.on_reply(False, "Overloaded", 0.1)
    null.observe_replicas([Status(0, True, 0)])
    text = ServerMetrics().render().decode()
    assert "phyrt_requests_total" in text and "phyrt_replicas_healthy 0.0" in text


def fetch(url: str, method: str = "GET") -> tuple[int, str]:
    """(status, body) of one request; an error status is returned, not raised."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


@dataclass(frozen=True)
class RebuiltStatus:  # ReplicaStatus with the fields of replica restarts
    index: int
    healthy: bool
    inflight: int
    restarts: int = 0
    restarting: bool = False
    error: str | None = None


@pytest.mark.timeout(30)
def test_probes_say_live_ready_and_why_not():
    statuses: list = [RebuiltStatus(0, True, 0), RebuiltStatus(1, False, 0, error="rank 1 exited with code -9")]
    with start_metrics_server(0, metrics=ServerMetrics(replicas=lambda: statuses)) as server:
        base = f"http://127.0.0.1:{server.port}"
        assert fetch(base + "/healthz") == (200, "ok\n")
        code, body = fetch(base + "/readyz")
        assert code == 200 and body.startswith("ready")
        assert "replica 1: down (rank 1 exited with code -9)" in body  # a degraded server says so
        statuses[:] = [RebuiltStatus(0, False, 0, restarts=2, restarting=True, error="rank 0 missed heartbeats"),
                       {"index": 1, "healthy": False, "inflight": 0, "error": "rank 1 exited with code -9"}]
        code, body = fetch(base + "/readyz")
        assert code == 503
        assert "replica 0: being rebuilt (rank 0 missed heartbeats)" in body
        assert "replica 1: down (rank 1 exited with code -9)" in body
        assert fetch(base + "/healthz")[0] == 200  # alive while not ready
        assert fetch(base + "/readyz", "HEAD") == (503, "")
        assert fetch(base + "/healthz", "HEAD") == (200, "")
        for path in ("/nope", "/", "/metricsx", "/healthz/x"):
            assert fetch(base + path)[0] == 404, path
        assert fetch(base + "/healthz", "POST")[0] == 405
        assert fetch(base + "/metrics")[0] == 200
        statuses[:] = []
        assert fetch(base + "/readyz") == (503, "not ready: no replica\n")
        statuses[:] = [RebuiltStatus(0, True, 0, restarts=1)]
        assert fetch(base + "/readyz")[0] == 200  # rebuilt: ready again


@pytest.mark.timeout(30)
def test_readyz_is_503_when_the_replicas_cannot_be_read():
    def broken() -> list:
        raise RuntimeError("engine gone")

    with start_metrics_server(0, metrics=ServerMetrics(replicas=broken)) as server:
        code, body = fetch(f"http://127.0.0.1:{server.port}/readyz")
        assert code == 503 and "engine gone" in body
        assert fetch(f"http://127.0.0.1:{server.port}/healthz")[0] == 200


@pytest.mark.timeout(30)
def test_restart_gauges_follow_the_replicas(served):
    m = served.metrics
    m.observe_replicas([RebuiltStatus(0, False, 0, restarts=3, restarting=True), RebuiltStatus(1, True, 2)])
    got = scrape(served.url)
    assert got[("phyrt_replica_restarts", (("replica", "0"),))] == 3
    assert got[("phyrt_replica_restarting", (("replica", "0"),))] == 1
    assert got[("phyrt_replica_restarts", (("replica", "1"),))] == 0
    assert got[("phyrt_replica_restarting", (("replica", "1"),))] == 0
    m.observe_replicas([Status(0, True, 0), {"index": 1, "healthy": True, "inflight": 0}])  # no restart fields
    got = scrape(served.url)
    assert got[("phyrt_replica_restarts", (("replica", "0"),))] == 0
    assert got[("phyrt_replica_restarting", (("replica", "1"),))] == 0
    assert fetch(f"http://127.0.0.1:{served.port}/readyz")[0] == 200


def _first(*places: tuple[str, str]):
    """The first ``module.attr`` of ``places`` that exists (the protocol code is being split up)."""
    for name, attr in places:
        if importlib.util.find_spec(name) is not None and hasattr(module := importlib.import_module(name), attr):
            return getattr(module, attr)
    raise AssertionError(f"none of {places} exists")


@pytest.mark.timeout(60)
def test_label_sets_match_the_protocol():
    error_types = _first(("runtime.link.client_protocol", "ERROR_TYPES"), ("runtime.transport.protocol", "ERROR_TYPES"))
    ops = _first(("runtime.link.client_protocol", "OP_FIELDS"), ("runtime.serving.requests", "OP_FIELDS"))
    assert set(ERROR_TYPES) == set(error_types)
    assert set(OPS) == set(ops)


@pytest.mark.timeout(60)
def test_server_counts_requests_errors_and_replicas(tmp_path):
    import numpy as np

    from runtime import Engine, EngineArgs
    from runtime.client import Client, InvalidRequestError
    from runtime.serving.server import Server

    engine = Engine(EngineArgs("policy"))
    metrics = ServerMetrics(replicas=lambda: engine.replicas)
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    server = Server(engine, f"ipc://{private}/s.sock", metrics=metrics)
    server.start()
    try:
        with Client(server.address) as client:
            client.call({"obs": np.ones((1, 32), np.float32)}, timeout=30)
            with pytest.raises(InvalidRequestError):
                client.call({"obs": np.ones((1, 5), np.float32)}, timeout=30)
        text = metrics.render().decode()
    finally:
        server.close(5)
    assert 'phyrt_requests_total{op="submit"} 2.0' in text
    assert 'phyrt_errors_total{type="InvalidRequest"} 1.0' in text
    assert 'phyrt_replica_healthy{replica="0"} 1.0' in text
    assert 'phyrt_request_duration_seconds_count{op="submit"} 2.0' in text
