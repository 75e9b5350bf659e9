"""What a client's socket monitor reports: ``HandshakeWatch`` turns its events into what to do.

Torch-free; imports ``runtime.transport`` (keys, the I/O context) only; ``open_dealer`` makes the socket. libzmq reports each connection to the server
through the monitor of the client's DEALER (an inproc PAIR, see ``runtime.link.dealer``):

    event                              verdict
    HANDSHAKE_SUCCEEDED                SERVED: the connection carries requests; a refusal that
                                       libzmq retries past (NO_DETAIL below) is forgotten
    DISCONNECTED after a handshake     LOST: the requests in flight fail (ConnectionLostError)
    DISCONNECTED before one            none: no request reached the server; they stay queued
                                       and libzmq connects again
    HANDSHAKE_FAILED_PROTOCOL, _AUTH   REFUSED for good: libzmq gives the address up, so every
                                       request fails with HandshakeError, now and later
    HANDSHAKE_FAILED_NO_DETAIL         the server dropped the connection mid-handshake (all that a
                                       wrong server_public_key gets): the DROPS_REFUSED-th in a row,
                                       with no handshake between, is REFUSED until one succeeds
                                       (libzmq keeps connecting)

A refusal's message names the likely cause: the server requires CURVE, it does not use it, it
is not the server of ``server_public_key``, or it does not authorize this client's key.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.transport.endpoints import load_key
from runtime.transport.zmq_context import io_context

__all__ = ["DROPS_REFUSED", "LOST", "MONITORED", "REFUSED", "SERVED", "HandshakeWatch", "Verdict", "open_dealer",
           "read_verdicts"]

SERVED, LOST, REFUSED = "served", "lost", "refused"
#: handshakes in a row that the server dropped (no detail) before the client calls it a refusal
DROPS_REFUSED = 2

# plain ints: compared per event, never on the request path
_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_NO_DETAIL = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_PROTOCOL = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: the events a client's monitor asks for (one or two per connection, none per request)
MONITORED = _SUCCEEDED | _DISCONNECTED | _NO_DETAIL | _PROTOCOL | _AUTH
_NOBLOCK = int(zmq.NOBLOCK)


class Verdict(NamedTuple):
    """What an event means for the client: SERVED, LOST or REFUSED (with why, and whether for good)."""

    action: str
    message: str = ""
    permanent: bool = False


class HandshakeWatch:
    """The handshakes of one client's connection, as its monitor reports them (one reader at a time)."""

    def __init__(self, address: str, curve: bool) -> None:
        self.address = address
        self.curve = curve  # this client speaks CURVE (it has the server's public key)
        self.handshaken = False  # the current connection completed its handshake
        self.drops = 0  # handshakes dropped by the server in a row

    def on_event(self, kind: int, value: int) -> Verdict | None:
        """The verdict on one monitor event (None: nothing to do)."""
        if kind == _SUCCEEDED:
            self.handshaken, self.drops = True, 0
            return Verdict(SERVED)
        if kind == _DISCONNECTED:
            was, self.handshaken = self.handshaken, False
            return Verdict(LOST) if was else None
        if kind == _NO_DETAIL:
            self.drops += 1
            return Verdict(REFUSED, self._dropped()) if self.drops >= DROPS_REFUSED else None
        if kind == _PROTOCOL:
            return Verdict(REFUSED, self._protocol(value), True)
        if kind == _AUTH:
            return Verdict(REFUSED, self._auth(value), True)
        return None

    def _failed(self, curve: bool, why: str) -> str:
        return f"the {'CURVE ' if curve else ''}handshake with {self.address} failed ({why})"

    def _dropped(self) -> str:
        if self.curve:
            return self._failed(True, "the server dropped it: is server_public_key this server's public key?")
        return self._failed(False, "the server dropped it: if it requires CURVE, pass server_public_key=... "
                                  "and this client's secret_key=...")

    def _protocol(self, value: int) -> str:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve:
                return self._failed(True, "the server does not use CURVE: leave out server_public_key and this "
                                         "client's keys")
            return self._failed(True, "the server requires CURVE: pass server_public_key=... and this client's "
                                     "secret_key=...")
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return self._failed(True, "a CURVE message did not decrypt: is server_public_key this server's public key?")
        return self._failed(self.curve, f"ZMTP protocol error {value:#x}: is a phyrt server listening there?")

    def _auth(self, status: int) -> str:
        if self.curve:
            return self._failed(True, f"authentication refused, status {status}: is this client's public key "
                                      "among the server's authorized clients (--curve-authorized-clients)?")
        return self._failed(False, f"authentication refused, status {status}")


def open_dealer(address: str, options: Any) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The context, a DEALER connected to ``address`` (CURVE with ``options``' keys) and its monitor."""
    ctx = io_context()
    sock = ctx.socket(zmq.DEALER)
    monitor = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # replies are never dropped on this side
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if options.server_public_key is not None:
            sock.curve_serverkey = load_key(options.server_public_key, secret=False)
            own_secret = load_key(options.secret_key, secret=True)
            if own_secret is None:
                raise ValueError("CURVE needs this client's secret_key too (public_key is derived from it)")
            sock.curve_secretkey = own_secret
            sock.curve_publickey = load_key(options.public_key, secret=False) or zmq.curve_public(own_secret)
        monitor = sock.get_monitor_socket(MONITORED)
        sock.connect(address)
    except BaseException:
        if monitor is not None:
            monitor.close(0)
        sock.close(0)
        ctx.term()
        raise
    return ctx, sock, monitor


def read_verdicts(monitor_lock: threading.Lock, owner: Any, watch: HandshakeWatch) -> list[Verdict]:
    """The verdicts on what ``owner.monitor`` reported since the last look (none once it is None)."""
    found = []
    with monitor_lock:
        monitor = owner.monitor
        while monitor is not None:
            try:
                event = recv_monitor_message(monitor, _NOBLOCK)
            except zmq.Again:
                break
            verdict = watch.on_event(event["event"], event["value"])
            if verdict is not None:
                found.append(verdict)
    return found
