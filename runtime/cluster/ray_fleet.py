"""``RayFleet``: phyrt servers placed on a Ray cluster as actors that Ray restarts.

Needs ``ray`` (``pip install 'phyrt[ray]'``); torch-free on the driver side.

    driver: RayFleet(launch_args)            CURVE pairs for the servers and for clients
      one ServerActor per alive node (NodeAffinity) or per GPU set (num_gpus, SPREAD),
      each with max_restarts; the server's secret key is an actor argument: it travels
      inside Ray (GCS, the node's raylet), never over a port of ours
    ServerActor.__init__ (on its node):      key files in a private directory (0700/0600, removed
                                             once the server has read them: its ready line),
      python -m runtime.cluster.serve ... --address tcp://NODE_IP:0 --curve-secret-key FILE
        --curve-authorized-clients DIR, stdin a pipe it holds; waits for the ready line
      a thread waits on the server: if it exits (killed, crashed, no replica left), the actor
      exits too and Ray starts it again (same arguments, a new port)
    driver: addresses()                      each actor's address (skipping one that restarts)
    Client(fleet.addresses(), refresh=fleet.addresses, **fleet.client_keys): requests go
      straight to the servers over ZeroMQ; Ray carries none of them

Invariants:
- A server process lives no longer than its actor: the stdin pipe's EOF stops it
  (``runtime.cluster.serve``), so ``ray.kill`` or a dead actor leaves no server behind.
- Every server of a fleet has the same CURVE pair and authorizes exactly the fleet's client key.
- ``close()`` stops every server (SIGTERM: it drains), then kills its actor for good. Idempotent.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

import ray
import zmq

__all__ = ["RayFleet", "ServerActor"]

log = logging.getLogger("phyrt.cluster")

#: how long a server may take to print its ready line (torch import, model load)
START_TIMEOUT_S = 300.0


def write_key(path: str, public: bytes, secret: bytes | None) -> None:
    """A key file as ``zmq.auth.create_certificates`` writes it (readable by ``load_key``), mode 0600."""
    lines = ["metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def _ready_address(proc: subprocess.Popen, timeout: float) -> str:
    """The address of the server's ready line ("phyrt ready address=... pid=...")."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if selector.select(timeout=0.5):
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith("phyrt ready "):
                    fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
                    return fields["address"]
            elif proc.poll() is not None:
                break
    raise RuntimeError(f"the server did not start within {timeout} s (exit status {proc.poll()}); "
                       "its log is in this actor's stderr")


class ServerActor:
    """One ``runtime.launch`` server on this Ray node (the body of a Ray actor)."""

    def __init__(self, launch_args: Sequence[str], server_secret: bytes, client_public: bytes,
                 cwd: str | None = None, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self._dir = tempfile.mkdtemp(prefix="phyrt-ray-")  # mode 0700
        self._stopping = False
        self._proc: subprocess.Popen | None = None
        try:
            secret_file = os.path.join(self._dir, "server.key_secret")
            write_key(secret_file, zmq.curve_public(server_secret), server_secret)
            authorized = os.path.join(self._dir, "clients")
            os.mkdir(authorized, 0o700)
            write_key(os.path.join(authorized, "client.key"), client_public, None)
            host = ray.util.get_node_ip_address()
            command = [sys.executable, "-m", "runtime.cluster.serve", *launch_args, "--address", f"tcp://{host}:0",
                       "--curve-secret-key", secret_file, "--curve-authorized-clients", authorized]
            proc = self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                 cwd=cwd if cwd and os.path.isdir(cwd) else None)
            self._address = _ready_address(proc, start_timeout_s)
            shutil.rmtree(self._dir, ignore_errors=True)  # read at start-up: off the disk again
        except BaseException:
            self._stop(5.0)
            raise
        self._pid = proc.pid
        threading.Thread(target=self._exit_with_server, args=(proc,), name="phyrt-server-watch", daemon=True).start()

    def _exit_with_server(self, proc: subprocess.Popen) -> None:
        """The server exited on its own: end this actor's process so that Ray restarts it."""
        code = proc.wait()
        if not self._stopping:
            log.error("the phyrt server at %s exited (status %s): ending the actor for Ray to restart it",
                      self._address, code)
            shutil.rmtree(self._dir, ignore_errors=True)
            os._exit(1)

    def address(self) -> str:
        return self._address

    def node_id(self) -> str:
        """The Ray node this server runs on."""
        return ray.get_runtime_context().get_node_id()

    def server_pid(self) -> int:
        return self._pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server (SIGTERM: it drains); its exit status."""
        return self._stop(timeout)

    def _stop(self, timeout: float) -> int | None:
        self._stopping = True
        code = None
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        return code


class RayFleet:
    """phyrt servers on the Ray cluster this process is connected to (``ray.init`` first).

    One server per alive node, or, with ``gpus_per_server``, one per that many GPUs of
    the cluster. Each runs ``python -m runtime.launch`` with ``launch_args`` (not
    ``--address`` nor the CURVE options: the fleet sets those) and is restarted by Ray
    up to ``max_restarts`` times (-1: always). ``client_keys`` holds what a client needs;
    ``client(**kwargs)`` makes a ``Client`` over the fleet that follows restarts.
    """

    def __init__(self, launch_args: Sequence[str] = (), *, gpus_per_server: int | None = None,
                 num_cpus: float = 1.0, max_restarts: int = -1, cwd: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        reserved = {"--address", "--curve-secret-key", "--curve-public-key", "--curve-authorized-clients"}
        if reserved & {str(a).split("=", 1)[0] for a in launch_args}:
            raise ValueError(f"launch_args may not set {sorted(reserved)}: the fleet sets them")
        if gpus_per_server is not None and (not isinstance(gpus_per_server, int) or gpus_per_server < 1):
            raise ValueError(f"gpus_per_server must be a positive int, got {gpus_per_server!r}")
        if not ray.is_initialized():
            raise RuntimeError("connect to a Ray cluster first: ray.init(address=...)")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        #: what a client passes to ``Client`` (z85 keys): the servers' public key, its own pair
        self.client_keys = {"server_public_key": server_public, "public_key": client_public,
                            "secret_key": client_secret}
        self._timeout = start_timeout_s
        actor = ray.remote(max_restarts=max_restarts, max_task_retries=0)(ServerActor)
        args = (list(launch_args), server_secret, client_public, cwd or os.getcwd(), start_timeout_s)
        self.actors: list[Any] = []
        try:
            for options in self._placements(gpus_per_server, num_cpus):
                self.actors.append(actor.options(**options).remote(*args))
            ray.get([a.address.remote() for a in self.actors], timeout=start_timeout_s)  # every one started
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _placements(gpus_per_server: int | None, num_cpus: float) -> list[dict[str, Any]]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if gpus_per_server is None:
            return [{"num_cpus": num_cpus, "scheduling_strategy": NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)}
                    for n in nodes]
        count = sum(int(n.get("Resources", {}).get("GPU", 0)) // gpus_per_server for n in nodes)
        if count == 0:
            raise ValueError(f"no node of the cluster has {gpus_per_server} GPU(s)")
        return [{"num_cpus": num_cpus, "num_gpus": gpus_per_server, "scheduling_strategy": "SPREAD"}] * count

    def addresses(self, timeout: float = 1.0) -> list[str]:
        """The servers' addresses now; one whose actor does not answer within ``timeout`` (it is
        being restarted) or is gone for good is left out."""
        refs = {a.address.remote(): a for a in self.actors}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        found = []
        for ref in ready:
            try:
                found.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                log.warning("a phyrt server of the fleet is gone: %s", exc)
        return sorted(found)

    def client(self, **kwargs: Any) -> Any:
        """A ``Client`` over the fleet's servers, holding their keys, that follows Ray's restarts."""
        from runtime.client import Client

        return Client(self.addresses(self._timeout), refresh=self.addresses, **self.client_keys, **kwargs)

    def close(self, timeout: float = 30.0) -> list[int | None]:
        """Stop every server (it drains), then kill its actor for good; the servers' exit statuses
        (0: stopped cleanly; None: its actor did not answer). Idempotent."""
        actors, self.actors = self.actors, []
        stops = [a.stop.remote(timeout) for a in actors]
        ready, _ = ray.wait(stops, num_returns=len(stops), timeout=timeout + 5)
        codes: list[int | None] = []
        for ref in stops:
            try:
                codes.append(ray.get(ref) if ref in ready else None)
            except ray.exceptions.RayError:
                codes.append(None)
        for a in actors:
            ray.kill(a, no_restart=True)
        return codes
