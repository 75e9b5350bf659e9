"""A runner's ``info()`` reaches ``Engine.replicas`` (inline and local: rank 0's, by heartbeat), a
served client's ``info()`` and the Prometheus page; a broken ``info()`` does not stop the serving."""

from __future__ import annotations

import pytest

from runtime import DeviceConfig, Engine, EngineArgs, EngineConfig
from tests.conftest import close_engine, start_engine
from tests.test_launch import wait_until

pytestmark = pytest.mark.timeout(120)

COUNTING = "tests.plugins:Counting"


def _inline() -> Engine:
    return Engine(EngineArgs(COUNTING, None, EngineConfig(device=DeviceConfig(target="cpu"))))


def test_an_inline_replica_reports_its_runners_info_after_each_burst():
    engine = _inline()
    try:
        assert engine.replicas[0].plugin_info is None  # nothing ran yet: no snapshot
        for i in range(3):
            engine.step({"i": i})
            assert engine.replicas[0].plugin_info == {"requests": i + 1, "rank": 0, "kind": "counting"}
    finally:
        engine.close()


def test_a_runner_without_info_reports_none():
    engine = Engine(EngineArgs("tests.plugins:Echo", None, EngineConfig(device=DeviceConfig(target="cpu"))))
    try:
        engine.step({"x": 1})
        assert engine.replicas[0].plugin_info is None
    finally:
        engine.close()


def test_a_broken_info_is_dropped_and_the_replica_keeps_serving(caplog):
    engine = _inline()
    try:
        engine.step({"x": 1})
        assert engine.step({"break_info": True}) == {"break_info": True}
        assert engine.step({"x": 2}) == {"x": 2}
        assert engine.replicas[0].healthy
        assert engine.replicas[0].plugin_info == {"requests": 1, "rank": 0, "kind": "counting"}  # the last good one
        assert "info() failed (RuntimeError: info() broke on purpose)" in caplog.text
    finally:
        engine.close()


def test_a_local_replicas_rank_0_sends_its_info_with_its_heartbeats():
    engine = start_engine(COUNTING, replicas=2, heartbeat_interval_s=0.05)
    try:
        for i in range(5):
            engine.step({"i": i})
        assert wait_until(lambda: sum((r.plugin_info or {}).get("requests", 0) for r in engine.replicas) == 5, 10.0), \
            [r.plugin_info for r in engine.replicas]
        assert all(r.plugin_info["rank"] == 0 for r in engine.replicas)
    finally:
        close_engine(engine)


def test_the_info_reply_and_the_metrics_page_carry_the_numbers(tmp_path):
    pytest.importorskip("prometheus_client")
    from runtime.client import Client
    from runtime.serving.metrics import ServerMetrics
    from runtime.serving.server import Server

    engine = _inline()
    server = Server(engine, f"ipc://{tmp_path}/s.sock").start()
    try:
        with Client(f"ipc://{tmp_path}/s.sock") as client:
            client.call({"x": 1}, timeout=30)
            client.call({"x": 2}, timeout=30)
            replicas = client.info()["replicas"]
        assert replicas[0]["plugin_info"] == {"requests": 2, "rank": 0, "kind": "counting"}
        page = ServerMetrics(replicas=lambda: engine.replicas).render().decode()
        assert 'phyrt_plugin_requests{replica="0"} 2.0' in page
        assert "phyrt_plugin_kind" not in page  # not a number
    finally:
        server.close()
        engine.close()
