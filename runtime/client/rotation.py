"""Which server of a ``RoutingClient`` takes the next request: ``Rotation``, one record per server.

Torch-free; imports the client's errors only. The rule is the in-process dispatcher's
(``runtime.execution.dispatcher``), one level up: whole requests, to servers.

    state      how it got there                                        routed to
    STARTING   added; no answer yet                                    only while no server is UP
    UP         a probe answered: ping, then info (accepting, a         yes: fewest in flight,
               healthy replica); or RoutingClient.info's answer        ties round-robin
               showed the same (``answered``)
    DOWN       a request failed with ServerUnavailableError            never; probed with backoff
               (EngineUnavailable, ConnectionLost, Handshake), the     (PROBE_FIRST_S doubling up to
               connection was lost, heartbeats went unanswered for     PROBE_MAX_S) until a probe
               heartbeat_timeout_s, a probe failed, or (added so)      answers: then UP
               no server listened at its ipc:// path

Invariants:
- ``choose`` and the chosen server's in-flight increment happen under ``lock``, so concurrent
  callers see each other's load; every ``choose`` is matched by one ``release``.
- A request is never retried once sent. A failure counts against the server only if it was
  sent in the server's current ``epoch`` (one per UP): a late failure from before a restart
  does not take the restarted server out again.
- With no server STARTING or UP, ``choose`` raises ``ServerUnavailableError`` at once, naming
  each server's last cause (``causes``).
- At most one probe per server is in flight (``probing``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from runtime.client.server_errors import ServerUnavailableError

__all__ = ["DOWN", "PROBE_FIRST_S", "PROBE_MAX_S", "STARTING", "UP", "Rotation", "Server", "serving_cause"]

STARTING, UP, DOWN = "starting", "up", "down"
#: the first probe of a server that left the rotation, and the longest wait between probes
PROBE_FIRST_S, PROBE_MAX_S = 0.1, 2.0


class Server:
    """One server of the rotation: its single-address client, state, load and last cause."""

    __slots__ = ("address", "client", "state", "inflight", "cause", "epoch", "added", "backoff", "next_probe",
                 "probing", "served")

    def __init__(self, address: str, client: Any, now: float) -> None:
        self.address = address
        self.client = client
        self.cause: str | None = client._link.awaited.unreachable  # why it last left the rotation
        self.state = STARTING if self.cause is None else DOWN  # no server listens at its ipc:// path: out at once
        self.inflight = 0
        self.epoch = 0  # bumped at each UP
        self.added = now
        self.backoff = PROBE_FIRST_S
        self.next_probe = now  # probed at once: STARTING turns UP on its first answer
        self.probing = False
        self.served = 0  # requests handed to it


class Rotation:
    """The servers, and the choice among them; thread-safe."""

    def __init__(self, connect: Callable[[str], Any], heartbeat_timeout_s: float) -> None:
        self._connect = connect
        self._timeout = heartbeat_timeout_s
        self.lock = threading.Lock()
        self.servers: list[Server] = []
        self._cursor = 0

    # -- membership ------------------------------------------------------------------------

    def set_addresses(self, addresses: Iterable[str]) -> list[Server]:
        """Keep the servers still listed, add the new ones (STARTING); the removed ones, to close."""
        wanted = list(dict.fromkeys(addresses))
        with self.lock:
            known = {s.address: s for s in self.servers}
        added: dict[str, Server] = {}
        try:
            for address in wanted:
                if address not in known:
                    added[address] = Server(address, self._connect(address), time.monotonic())
        except BaseException:
            for server in added.values():
                server.client.close()
            raise
        with self.lock:
            removed = [s for s in self.servers if s.address not in wanted]
            self.servers = [known.get(a) or added[a] for a in wanted]
            self._cursor = 0
        return removed

    def by_address(self, address: Any) -> Server | None:
        with self.lock:
            return next((s for s in self.servers if s.address == address), None)

    # -- the choice ------------------------------------------------------------------------

    def choose(self, tried: set[str] | None = None) -> tuple[Server, int]:
        """The server for the next request, its in-flight count raised; with its epoch."""
        with self.lock:
            best = self._best(UP, tried) or self._best(STARTING, tried)
            if best is None:
                raise ServerUnavailableError.for_servers({s.address: s.cause or "refused the request before it was sent"
                                                          for s in self.servers})
            best.inflight += 1
            best.served += 1
            self._cursor = (self.servers.index(best) + 1) % len(self.servers)
            return best, best.epoch

    def _best(self, state: str, tried: set[str] | None) -> Server | None:
        count = len(self.servers)
        best = None
        for step in range(count):
            server = self.servers[(self._cursor + step) % count]
            if server.state != state or (tried and server.address in tried):
                continue
            if state == UP and connection_lost(server.client):  # seen by its monitor a moment ago
                self._down(server, f"the connection to {server.address} was lost", time.monotonic())
                continue
            if best is None or server.inflight < best.inflight:
                best = server
        return best

    def release(self, server: Server, epoch: int, error: BaseException | None = None) -> None:
        """A request chosen for ``server`` is over; a ServerUnavailableError takes it out."""
        with self.lock:
            server.inflight -= 1
            if isinstance(error, ServerUnavailableError) and epoch == server.epoch and server.state != DOWN:
                self._down(server, f"{type(error).__name__}: {error}", time.monotonic())

    def _down(self, server: Server, cause: str, now: float) -> None:
        """Under ``lock``: out of the rotation; first probe soon."""
        server.state, server.cause = DOWN, cause
        server.backoff = PROBE_FIRST_S
        server.next_probe = now + PROBE_FIRST_S

    # -- watching (the routing client's thread) ----------------------------------------------

    def check(self, now: float) -> list[Server]:
        """Take out the servers whose connection was lost or that missed heartbeats; the servers due
        for a probe (marked ``probing``)."""
        due = []
        with self.lock:
            for server in self.servers:
                if server.state == UP:
                    silent = silent_s(server.client, now)
                    if connection_lost(server.client):
                        self._down(server, f"the connection to {server.address} was lost", now)
                    elif silent > self._timeout:
                        self._down(server, f"no word from {server.address} for {silent:.1f} s "
                                           "(heartbeat_timeout_s)", now)
                elif server.state == STARTING and now - server.added > self._timeout and not server.probing:
                    self._down(server, f"no answer from {server.address} within {self._timeout} s "
                                       "(heartbeat_timeout_s) of connecting", now)
                if server.state != UP and not server.probing and now >= server.next_probe:
                    server.probing = True
                    due.append(server)
        return due

    def probed(self, server: Server, cause: str | None) -> None:
        """A probe ended: UP when ``cause`` is None, else the next probe after a longer wait."""
        now = time.monotonic()
        with self.lock:
            server.probing = False
            if cause is None:
                self._up(server)
                return
            if server.state == UP:
                return
            if server.state == STARTING and now - server.added <= self._timeout:
                server.next_probe = now + PROBE_FIRST_S  # still connecting: no cause, no backoff yet
                return
            server.state, server.cause = DOWN, cause
            server.next_probe = now + server.backoff
            server.backoff = min(server.backoff * 2, PROBE_MAX_S)

    def answered(self, address: str, info: Any) -> None:
        """``info`` answered outside a probe (``RoutingClient.info``): a server it shows serving is UP,
        as a probe that passed would make it, once its connection knows the server (a ping answered)."""
        with self.lock:
            server = next((s for s in self.servers if s.address == address), None)
            if server is not None and serving_cause(address, info) is None and not connection_lost(server.client):
                self._up(server)

    def _up(self, server: Server) -> None:
        """Under ``lock``: in the rotation (a new epoch), unless it is already."""
        if server.state != UP:
            server.state, server.cause = UP, None
            server.epoch += 1
        server.backoff = PROBE_FIRST_S

    def report(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{"address": s.address, "state": s.state, "in_rotation": s.state != DOWN,
                     "inflight": s.inflight, "served": s.served, "cause": s.cause} for s in self.servers]


def connection_lost(client: Any) -> bool:
    """The client's monitor saw its connection drop (or the server refused it) since its last answer.

    A single-address client forgets the server's id when that happens and learns it again from
    the next ping answered (``runtime.link.awaited``)."""
    return client._link.awaited.server_id is None


def serving_cause(address: str, info: Any) -> str | None:
    """None when a server's ``info`` answer shows it serving (accepting, a healthy replica); else why not."""
    replicas = (info.get("replicas") or []) if isinstance(info, dict) else []
    if isinstance(info, dict) and info.get("accepting", True) and any(
            isinstance(r, dict) and r.get("healthy") for r in replicas):
        return None
    causes = "; ".join(str(r.get("error")) for r in replicas if isinstance(r, dict) and r.get("error"))
    return f"{address} answers but cannot serve: {causes or 'not accepting requests'}"


def silent_s(client: Any, now: float) -> float:
    """Seconds since the client last heard from its server (heartbeats answer every interval)."""
    return now - client._link.awaited.last_heard
