"""``CurrentSession``: a client's shared-memory session with the current server instance.

Torch-free; imports ``runtime.transport`` (arena, encoder) and ``runtime.link`` (the session, the
lanes, the register header) of the project. One per ``runtime.link.link.Link``; the session itself,
the same at both ends, is ``runtime.link.session.ShmSession``.

    client: CurrentSession                             server
    start(server_id) -> register [run_id]         -->  a ShmSession for this connection
    registered(reply) <-- {result_run_id, mapped}:     map_peer; free the names it mapped
    encoder(session): a PayloadEncoder: a tensor of >= shm_threshold bytes lies in a block ``lend``
      gave (Client.empty)? borrowed, sent where it lies; else placed (copied) into a block of the
      arena, a new segment registered first; no usable session: frames

Invariants:
- A segment new to the client's arena is registered with the server before any request that uses
  it: its ``register`` is posted (the link's FIFO outbox, or the lane: ``_announce``) under
  ``CurrentSession.lock``, ahead of every request that could carry a tensor in it.
- A restarted server (a new ``server_id``) gets a new session; the old one is dropped first.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable

import numpy as np

from runtime.link.client_protocol import register_header
from runtime.link.lane import ClientLane, ReplyPipe
from runtime.link.lane import available as lanes_available
from runtime.link.session import ShmSession
from runtime.transport.arena import sweep_stale
from runtime.transport.protocol import PayloadEncoder

__all__ = ["CurrentSession"]


class CurrentSession:
    """The client's session with the current server instance (``current``; None: frames only, or not
    yet), and where a request's tensors go. ``post(frames)`` queues a message ahead of later requests."""

    def __init__(self, enabled: bool, shm_threshold: int, post: Callable[[list[Any]], None]) -> None:
        self.enabled = enabled
        self.shm_threshold = shm_threshold
        self._post = post
        self.lock = threading.Lock()  # current, and what is announced of its arena
        self.current: ShmSession | None = None
        self._bound: tuple[Any, Any, Any] = (None, None, None)  # (session, place, borrow), made once a session
        #: the link's reply pipe, for the lanes of its sessions (None: no lanes)
        self.replies = ReplyPipe() if enabled and lanes_available() else None

    @property
    def lane(self) -> ClientLane | None:
        """The current session's lane, once the server accepted it (requests may go by it)."""
        session = self.current
        lane = None if session is None else session.lane
        return lane if lane is not None and lane.up else None

    @property
    def reply_lane(self) -> ClientLane | None:
        """The current session's lane, accepted or not: the server may reply by it before its answer
        to ``lane`` is read."""
        session = self.current
        return None if session is None else session.lane

    def wants(self) -> bool:
        """Shared memory is on and not refused, but no usable session exists (yet)."""
        session = self.current
        return self.enabled and (session is None or (not session.usable and not session.refused))

    def start(self, server_id: str) -> bytes | None:
        """A new server instance (``server_id``): a new session (the old one dropped before); its
        ``register`` to send at once, or None with shared memory off."""
        if not self.enabled:
            return None
        with self.lock:
            self.current = ShmSession()
            return register_header(self.current.run_id, [], pid=os.getpid())

    def registered(self, header: dict[str, Any]) -> bool:
        """The server's answer to a ``register``; False if it refused shared memory (frames from now on)."""
        result = header.get("result")
        with self.lock:
            session = self.current
            if session is None or not isinstance(result, dict) or result.get("run_id") != session.run_id:
                if session is not None and header.get("ok") is not True:
                    session.refused = True
                    return False
                return True
            if isinstance(result.get("result_run_id"), str):
                session.map_peer(result["result_run_id"])
            session.peer_mapped(result.get("mapped") or [])  # unlinked by the server already; making sure
        return True

    def lane_request(self) -> bytes | None:
        """After a successful register: the ``lane`` op, over a new segment of the current session
        (None: no lanes, or no session)."""
        with self.lock:
            session = self.current
            if self.replies is None or session is None or not session.usable or session.lane is not None:
                return None
            return session.make_lane().ask(self.replies.writer)

    def lane_opened(self, header: dict[str, Any]) -> None:
        """The server's answer to ``lane``: the lane is up, or it stays down (libzmq alone)."""
        session = self.current
        if session is not None and session.lane is not None:
            session.lane.answered(header)

    def close(self) -> None:
        """The link is closed and nobody reads it: close the reply pipe."""
        if self.replies is not None:
            self.replies.close()

    def drop(self, swept: bool = False) -> None:
        """Close the current session (its views stay valid); ``swept``: also sweep the names a killed
        server left."""
        with self.lock:
            session, self.current = self.current, None
        if session is not None:
            session.close()
            if swept:
                sweep_stale()

    def encoder(self, session: ShmSession | None) -> PayloadEncoder:
        """An encoder for one request over ``session`` (None: frames only). Its frames view the
        caller's arrays: the link sends them at once (zmq copies them), or snapshots them."""
        if session is None:
            return PayloadEncoder(copy=False, shm_threshold=self.shm_threshold)
        bound, place, borrow = self._bound
        if bound is not session or (borrow is None and session.arena is not None):
            place = functools.partial(self._place, session)
            borrow = functools.partial(self._borrow, session) if session.arena is not None else None
            self._bound = (session, place, borrow)  # one tuple: threads racing here build the same
        return PayloadEncoder(copy=False, place=place, shm_threshold=self.shm_threshold, borrow=borrow)

    def lend(self, nbytes: int) -> np.ndarray | None:
        """A lent block of the current session's arena (``Client.empty``); None without a usable session."""
        with self.lock:
            session = self.current
            lent = session.lend(nbytes) if session is not None and session.usable else None
            if lent is None:
                return None
            segment, holder, new = lent
            if new:
                self._announce(session, segment)
        return holder

    def _place(self, session: ShmSession, nbytes: int) -> tuple[str, int, memoryview] | None:
        """A block of the arena for a request tensor."""
        with self.lock:
            placed = session.place(nbytes) if session is self.current and session.usable else None
            if placed is None:
                return None
            segment, offset, view, new = placed
            if new:
                self._announce(session, segment)
            return segment, offset, view

    def _announce(self, session: ShmSession, segment: str) -> None:
        """Under ``lock``: register a new segment ahead of every request that may use it, by the lane
        when it is up (the server handles the lane's messages in order), else by libzmq (the
        outbox); after one by libzmq, requests with blocks keep off the lane (which the server
        reads first)."""
        frames = [register_header(session.run_id, [segment])]
        lane = session.lane
        if lane is not None and lane.up and session.registers_by_lane and lane.send(frames):
            return
        session.registers_by_lane = False
        self._post(frames)

    def _borrow(self, session: ShmSession, address: int, nbytes: int) -> tuple[str, int, int] | None:
        """The lent block (``Client.empty``) a request tensor lies in, held by the request until its reply."""
        with self.lock:
            if session is not self.current or not session.usable:
                return None
            return session.borrow(address, nbytes)
