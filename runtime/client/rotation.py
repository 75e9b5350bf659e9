"""Which server of a ``RoutingClient`` takes the next request: ``Rotation``, one record per server.

Torch-free; imports the client's errors only. The rule is the in-process dispatcher's
(``runtime.execution.dispatcher``), one level up: whole requests, to servers.

    state      how it got there                                        routed to
    STARTING   added; no answer yet                                    only while no server is UP
    UP         a probe answered: ping, then info (accepting, a         yes: fewest in flight,
               healthy replica); or RoutingClient.info's answer        ties round-robin
               showed the same (``answered``)
    DOWN       a request failed with ServerUnavailableError            never; probed with backoff
               (EngineUnavailable, ConnectionLost, Handshake), its     (PROBE_FIRST_S doubling up to
               link failed (``failed``, its ``on_failure`` callback:   PROBE_MAX_S) until a probe
               connection lost, server restarted, handshake refused,   answers: then UP
               no word for heartbeat_timeout_s), a probe failed, or
               (added so) no server listened at its ipc:// path

Invariants:
- ``choose`` and the chosen server's in-flight increment happen under ``lock``, so concurrent
  callers see each other's load; every ``choose`` is matched by one ``release``.
- A request is never retried once sent. A failure counts against the server only if it was
  sent in the server's current ``epoch`` (one per UP): a late failure from before a restart
  does not take the restarted server out again.
- With no server STARTING or UP, ``choose`` raises ``ServerUnavailableError`` at once, naming
  each server's last cause (``causes``).
- At most one probe per server is in flight (``probing``).
- A server hears of its link's failures at once, by callback (``failed``, on the link's thread);
  after one, an ``info`` answer puts it back only once a ping was answered (``heard``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Iterable

from runtime.client.server_errors import ServerUnavailableError

log = logging.getLogger("phyrt.client")

__all__ = ["DOWN", "PROBE_FIRST_S", "PROBE_MAX_S", "STARTING", "UP", "Rotation", "Server", "Timers", "serving_cause"]

STARTING, UP, DOWN = "starting", "up", "down"
#: the first probe of a server that left the rotation, and the longest wait between probes
PROBE_FIRST_S, PROBE_MAX_S = 0.1, 2.0


class Server:
    """One server of the rotation: its single-address client, state, load and last cause."""

    __slots__ = ("address", "client", "state", "inflight", "cause", "epoch", "added", "backoff", "next_probe",
                 "probing", "served", "lost")

    def __init__(self, address: str, client: Any, now: float) -> None:
        self.address = address
        self.client = client
        self.cause: str | None = client._unreachable  # why it last left the rotation
        self.state = STARTING if self.cause is None else DOWN  # no server listens at its ipc:// path: out at once
        self.inflight = 0
        self.epoch = 0  # bumped at each UP
        self.added = now
        self.backoff = PROBE_FIRST_S
        self.next_probe = now  # probed at once: STARTING turns UP on its first answer
        self.probing = False
        self.served = 0  # requests handed to it
        self.lost = False  # its link failed since the last ping it answered


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
                    server = added[address] = Server(address, self._connect(address), time.monotonic())
                    server.client._on_failure(functools.partial(self.failed, server))
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

    # -- watching (the links' threads and the routing client's timers) ------------------------

    def failed(self, server: Server, reason: str) -> None:
        """``server``'s link failed (its ``on_failure`` callback): out of the rotation at once."""
        with self.lock:
            server.lost = True
            if server.state == UP:
                self._down(server, reason, time.monotonic())

    def heard(self, server: Server) -> None:
        """``server`` answered a ping: its link knows the server (again)."""
        server.lost = False

    def check(self, now: float) -> list[Server]:
        """Take out the servers that did not answer in time of connecting; the servers due for a
        probe (marked ``probing``)."""
        due = []
        with self.lock:
            for server in self.servers:
                if server.state == STARTING and now - server.added > self._timeout and not server.probing:
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
            if server is not None and serving_cause(address, info) is None and not server.lost:
                self._up(server)

    def _up(self, server: Server) -> None:
        """Under ``lock``: in the rotation (a new epoch), unless it is already."""
        if server.state != UP:
            server.state, server.cause = UP, None
            server.epoch += 1
        server.backoff = PROBE_FIRST_S

    def probe(self, server: Server) -> None:
        """ping, then info: back in the rotation if it accepts requests and has a healthy replica."""
        def on_info(future: Any) -> None:
            error = future.exception()
            self.probed(server, f"{type(error).__name__}: {error}" if error is not None
                        else serving_cause(server.address, future.result()))

        def on_ping(future: Any) -> None:
            error = future.exception()
            if error is not None:
                self.probed(server, f"{type(error).__name__}: {error}")
                return
            self.heard(server)
            self._send_probe(server, "info", on_info)

        self._send_probe(server, "ping", on_ping)

    def _send_probe(self, server: Server, op: str, then: Callable[[Any], None]) -> None:
        try:
            future = server.client._control_async(op)
        except Exception as exc:  # closed, or the handshake refused: the next probe later
            self.probed(server, f"{type(exc).__name__}: {exc}")
            return
        future.add_done_callback(then)

    def report(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{"address": s.address, "state": s.state, "in_rotation": s.state != DOWN,
                     "inflight": s.inflight, "served": s.served, "cause": s.cause} for s in self.servers]

    def report_with(self, futures: dict[str, Any]) -> dict[str, Any]:
        """``report()`` with each server's ``info`` answer (``futures`` by address) or why there is none;
        an answer that shows a server serving counts as a probe's (``answered``)."""
        for address, future in futures.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                self.answered(address, future.result())
        servers = self.report()
        for entry in servers:
            future = futures.get(entry["address"])
            entry["info"], entry["error"] = None, None
            if future is None or not future.done():
                entry["error"] = "no answer in time"
            elif future.exception() is not None:
                entry["error"] = f"{type(future.exception()).__name__}: {future.exception()}"
            else:
                entry["info"] = future.result()
        return {"servers": servers, "in_rotation": sum(e["in_rotation"] for e in servers)}


def serving_cause(address: str, info: Any) -> str | None:
    """None when a server's ``info`` answer shows it serving (accepting, a healthy replica); else why not."""
    replicas = (info.get("replicas") or []) if isinstance(info, dict) else []
    if isinstance(info, dict) and info.get("accepting", True) and any(
            isinstance(r, dict) and r.get("healthy") for r in replicas):
        return None
    causes = "; ".join(str(r.get("error")) for r in replicas if isinstance(r, dict) and r.get("error"))
    return f"{address} answers but cannot serve: {causes or 'not accepting requests'}"


class Timers:
    """A routing client's end on its ``LinkThread``: no descriptors; every ``period`` s the rotation's
    check and the probes due, every ``refresh_interval_s`` ``refresh()`` (if given)."""

    def __init__(self, rotation: Rotation, period: float, refresh: Callable[[], None] | None,
                 refresh_interval_s: float) -> None:
        self._rotation, self._refresh = rotation, refresh
        self._period, self._refresh_interval = period, refresh_interval_s
        now = time.monotonic()
        self._next, self._next_refresh = now + period, now + refresh_interval_s

    def tick(self, now: float) -> float:
        if now >= self._next:
            self._next = now + self._period
            try:
                for server in self._rotation.check(now):
                    self._rotation.probe(server)
                if self._refresh is not None and now >= self._next_refresh:
                    self._next_refresh = now + self._refresh_interval
                    self._refresh()
            except Exception:  # a bug here must not stop the probes of the other servers
                log.exception("the routing client's check failed")
        return self._next

    def poll_items(self) -> list:
        return []

    def after_poll(self) -> None:
        pass

    def broken(self, exc: BaseException) -> None:
        pass

    def shut(self) -> None:
        pass
