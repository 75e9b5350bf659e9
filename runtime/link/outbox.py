"""``Outbox``: what a client link sends, in order, through the holder of its DEALER socket.

Torch-free; imports ``runtime.link.client_protocol`` (the release header) of the project. The
``Dealer`` (``runtime.link.dealer``) decides who holds the socket; the outbox is what that holder
sends, and how:

    holder, nothing queued: send(dealer, id, frames) -> the socket at once (zmq copies the frames)
    another thread holds it: queue(id, frames) -> FIFO, tensor frames snapshotted (the caller's
      arrays may change once it returns); the holder flushes before each poll, and whoever gives
      the socket back sends what came meanwhile
    flush(dealer): first the released result blocks waiting for a ride (a ``release``), then the
      queue; what cannot go fails its request (``Awaited.unsent``) or, with no request, is logged

Invariants:
- FIFO: a segment's ``register`` (posted by ``CurrentSession`` under its lock) goes out before any
  request that uses the segment; only the socket's holder sends.
- Releases go ahead of the queue, never alone: a server runs a request in the thread that read it
  only if no message came after it, and a message of their own would wake other threads. When the
  socket's queue is full they wait for a later ride (``ShmSession.give_back``).
- Nothing goes once the dealer is closed (``dealer.open`` false): ``close()`` fails what is in flight.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import zmq

from runtime.link.client_protocol import release_header

__all__ = ["Outbox"]

log = logging.getLogger("phyrt.client")

_NOBLOCK = int(zmq.NOBLOCK)


class Outbox(collections.deque):
    """The FIFO of (request id or None, frames) that the socket's holder sends (see the module)."""

    def __init__(self, address: str, awaited: Any) -> None:
        super().__init__()
        self.address = address
        self.awaited = awaited

    def queue(self, request_id: int | None, frames: list[Any]) -> None:
        """For the holder to send: tensor frames snapshotted (they view the caller's arrays)."""
        if len(frames) > 1:
            frames = [frames[0], *(bytes(frame) for frame in frames[1:])]
        self.append((request_id, frames))

    def send(self, dealer: Any, request_id: int | None, frames: list[Any], failed: list) -> None:
        """Holding the socket: send a message now, behind what is queued and waiting releases; the
        future of what could not go into ``failed``."""
        session = self.awaited.shm.current
        if self or not dealer.open or (session is not None and session.released):  # releases ride first
            self.append((request_id, frames))
            self.flush(dealer, failed)
            return
        try:
            if len(frames) == 1:
                dealer.sock.send(frames[0], _NOBLOCK)
            else:
                dealer.sock.send_multipart(frames, _NOBLOCK)
        except zmq.ZMQError:  # flush says why, and fails the request
            self.append((request_id, frames))
            self.flush(dealer, failed)

    def flush(self, dealer: Any, failed: list) -> None:
        """Holding the socket: the releases that wait for a ride, then the queue; the futures of what
        could not go into ``failed``."""
        sock = dealer.sock
        session = self.awaited.shm.current
        while session is not None and session.released and dealer.open and self:
            blocks = session.take_released()
            if not blocks:
                break
            try:
                sock.send(release_header(blocks), _NOBLOCK)
            except zmq.Again:  # the queue is full: they ride with a later message
                session.give_back(blocks)
                break
            except zmq.ZMQError as exc:
                log.warning("dropped a release of result blocks to %s: %s", self.address, exc)
        while self:
            request_id, frames = self.popleft()
            if not dealer.open:
                continue  # closed: close() fails what is in flight
            try:
                if len(frames) == 1:
                    sock.send(frames[0], _NOBLOCK)
                else:
                    sock.send_multipart(frames, _NOBLOCK)
                continue
            except zmq.Again:
                dealer.watch_monitor(failed)  # a refused handshake fails it (and all in flight) with its cause
                reason = "the send queue to the server is full (is it reachable?)"
            except zmq.ZMQError as exc:
                reason = f"the message could not be sent ({exc})"
            if request_id is None:
                log.warning("dropped a message to %s: %s", self.address, reason)
            else:
                self.awaited.unsent(request_id, reason, failed)
