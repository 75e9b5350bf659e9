"""``runtime.cluster``: phyrt servers placed and restarted by Ray, served through ``Client([...])``.

One local Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``, one CPU each)
for the module; the servers run tests.plugins:Echo inline. Slow (Ray's start, two servers
and a restart on a busy 2-core machine): one test for ``RayFleet`` (placement, a server killed
and restarted, the client following), one for the command line.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from runtime.client import ConnectionLostError, RoutingClient
from runtime.client.rotation import UP
from tests.test_launch import ROOT, wait_until

ray = pytest.importorskip("ray", reason="Ray is the optional extra phyrt[ray]: pip install -e '.[test,ray]'")

LAUNCH_ARGS = ["--plugin", "tests.plugins:Echo", "--device", "cpu", "--log-level", "warning"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        ray.init(address=nodes.address, logging_level="warning", log_to_driver=False)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def idle_cluster(cluster):
    """The cluster with both nodes alive and every CPU free: whatever ran before (an earlier test's
    fleet, its actors killed a moment ago) has given its CPUs back, so that each test's two servers,
    one CPU each, can be placed whichever test runs first or alone."""
    def idle() -> bool:
        alive_nodes = [n for n in ray.nodes() if n.get("Alive")]
        return len(alive_nodes) == 2 and ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"]

    assert wait_until(idle, 120), (ray.nodes(), ray.available_resources())
    return cluster


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(400)
def test_servers_on_both_nodes_one_killed_is_restarted_and_the_client_keeps_serving(idle_cluster):
    from runtime.cluster import RayFleet

    key_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "phyrt-ray-*")))
    fleet = RayFleet(LAUNCH_ARGS, num_cpus=1, max_restarts=2, cwd=str(ROOT))
    pids: set[int] = set()
    try:
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "phyrt-ray-*"))) == key_dirs  # keys read, removed
        assert len(fleet.actors) == 2
        assert len(set(ray.get([a.node_id.remote() for a in fleet.actors]))) == 2  # one per node
        pids = set(ray.get([a.server_pid.remote() for a in fleet.actors]))
        first = fleet.addresses()
        assert len(first) == 2 and all(a.startswith("tcp://") for a in first)

        with fleet.client(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, refresh_interval_s=0.5) as client:
            assert isinstance(client, RoutingClient)
            assert wait_until(lambda: _all_up(client), 60)
            futures = [client.submit({"sleep": 0.2, "i": i}) for i in range(4)]
            assert [f.result(60)["i"] for f in futures] == [0, 1, 2, 3]
            assert sorted(f.server for f in futures) == sorted(first * 2)  # both servers, over CURVE

            victim = fleet.actors[0]
            victim_address, victim_pid = ray.get(victim.address.remote()), ray.get(victim.server_pid.remote())
            os.kill(victim_pid, signal.SIGKILL)  # the server dies; its actor follows; Ray restarts it
            survivor = next(a for a in first if a != victim_address)
            served_while_down = []
            deadline = time.monotonic() + 180
            while len(client.addresses) < 2 or victim_address in client.addresses or not _all_up(client):
                assert time.monotonic() < deadline, client.info(timeout=2)
                try:
                    served_while_down.append(client.call({"ok": 1}, timeout=30) == {"ok": 1})
                except ConnectionLostError as exc:  # only a request that went to the killed server
                    assert victim_address in str(exc)
                time.sleep(0.05)
            assert served_while_down.count(True) > 0  # the survivor kept serving meanwhile
            restarted = fleet.addresses()
            assert len(restarted) == 2 and survivor in restarted and victim_address not in restarted
            again = [client.submit({"sleep": 0.2}) for _ in range(4)]
            assert [f.result(60) for f in again] == [{"sleep": 0.2}] * 4
            assert sorted(f.server for f in again) == sorted(restarted * 2)
        pids |= set(ray.get([a.server_pid.remote() for a in fleet.actors]))
        assert fleet.close() == [0, 0]  # each drained and exited cleanly
    finally:
        fleet.close()
    assert wait_until(lambda: not any(alive(p) for p in pids), 30)  # no server outlives the fleet


@pytest.mark.timeout(300)
def test_the_cli_publishes_keys_and_addresses_a_client_can_use_and_stops_its_servers(idle_cluster, tmp_path):
    """Alone or after the test above: ``idle_cluster`` waits for the nodes' CPUs to be free."""
    from runtime.client import Client

    cluster = idle_cluster

    keys, listed = tmp_path / "keys", tmp_path / "fleet.json"
    log = open(tmp_path / "cli.log", "w")
    cli = subprocess.Popen([sys.executable, "-m", "runtime.cluster", "--ray-address", cluster.address, "--keys-dir",
                            str(keys), "--addresses-file", str(listed), "--", *LAUNCH_ARGS], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = cli.stdout.readline()  # "phyrt cluster servers=2 addresses=tcp://...,tcp://..."
        assert line.startswith("phyrt cluster servers=2 "), (line, (tmp_path / "cli.log").read_text())
        addresses = json.loads(listed.read_text())["addresses"]
        assert line.split("addresses=")[1].split() == [",".join(addresses)]
        with Client(addresses, refresh=lambda: json.loads(listed.read_text())["addresses"],
                    server_public_key=str(keys / "server.key"), public_key=str(keys / "client.key"),
                    secret_key=str(keys / "client.key_secret")) as client:
            assert wait_until(lambda: _all_up(client), 60)
            futures = [client.submit({"i": i, "sleep": 0.2}) for i in range(4)]
            assert [f.result(60)["i"] for f in futures] == [0, 1, 2, 3]
            assert sorted(f.server for f in futures) == sorted(addresses * 2)
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(120) == 0, (tmp_path / "cli.log").read_text()
        assert cli.stdout.read().strip() == "phyrt cluster stopped: server exit statuses [0, 0]"
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait(30)
        cli.stdout.close()
        log.close()


def _all_up(client: RoutingClient) -> bool:
    return all(s["state"] == UP for s in client.info(timeout=2)["servers"])


@pytest.mark.timeout(60)
def test_cli_help_and_bad_launch_args():
    out = subprocess.run([sys.executable, "-m", "runtime.cluster", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--addresses-file" in out.stdout and "--keys-dir" in out.stdout
    out = subprocess.run([sys.executable, "-m", "runtime.cluster", "--keys-dir", str(ROOT), "--addresses-file",
                          "x.json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "exists" in out.stderr
    from runtime.cluster import RayFleet

    with pytest.raises(ValueError, match="--address"):
        RayFleet(["--address", "tcp://127.0.0.1:5555"])


def test_the_cli_writes_keys_and_addresses(tmp_path):
    from runtime.cluster.__main__ import write_addresses, write_keys
    from runtime.transport.endpoints import load_key

    import zmq

    server_public, _ = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    write_keys(str(tmp_path / "keys"), {"server_public_key": server_public, "public_key": public,
                                        "secret_key": secret})
    assert oct((tmp_path / "keys").stat().st_mode & 0o777) == "0o700"
    assert load_key(str(tmp_path / "keys" / "server.key"), secret=False) == server_public
    assert load_key(str(tmp_path / "keys" / "client.key_secret"), secret=True) == secret
    assert (tmp_path / "keys" / "client.key_secret").stat().st_mode & 0o077 == 0
    write_addresses(str(tmp_path / "fleet.json"), ["tcp://10.0.0.1:5000"], server_public)
    assert json.loads((tmp_path / "fleet.json").read_text()) == {"addresses": ["tcp://10.0.0.1:5000"],
                                                                 "server_public_key": server_public.decode()}
